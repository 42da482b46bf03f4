"""Settings -> the server's composed parts: a strategy with the server update
and aggregation step its settings name, and the personal evaluation."""

from __future__ import annotations

from torch import nn

from ..catalog import (
    CENTRAL_DP_STEP,
    load,
)
from ..extensions import part
from ..settings import Settings
from ..task.sharing import Sharing
from .personal import PersonalEvaluation
from .secure_round import SecureAggregation
from .strategy import ObjectiveState, Strategy


def build_strategy(
    settings: Settings, model: nn.Module
) -> tuple[Strategy, PersonalEvaluation]:
    """The strategy with the server update named by `server-update` and the
    aggregation step named by `aggregator`, and the personal evaluation, both
    sharing by `sharing` and `bn-policy`."""
    sharing = Sharing.of(settings.sharing_policy, model)
    update = part("server-update", settings.server_update).load()
    update = update.from_settings(settings)
    aggregator = (
        load(CENTRAL_DP_STEP)
        if settings.central_dp != "off"
        else part("aggregator", settings.aggregator).load()
    )
    server_state = _server_state(settings, model, sharing)
    strategy = Strategy(
        num_clients=settings.num_clients,
        client_frac=settings.client_frac,
        seed=settings.seed,
        server_update=update,
        aggregator=aggregator.from_settings(settings, uniform=update.uniform_mean),
        sharing=sharing,
        min_replies=settings.min_train_replies,
        min_train_nodes=settings.min_train_nodes,
        norm_bound=settings.update_norm_bound,
        norm_action=settings.update_norm_action,
        server_state=server_state,
        secure=(
            SecureAggregation.from_settings(settings, update.uniform_mean)
            if settings.secure_aggregation != "off"
            else None
        ),
    )
    by_prototypes = settings.proto_inference == "prototypes"
    personal = PersonalEvaluation(
        sharing, settings.personal_eval_every, server_state if by_prototypes else None
    )
    return strategy, personal


def _server_state(
    settings: Settings, model: nn.Module, sharing: Sharing
) -> ObjectiveState | None:
    """What the server keeps for the local objective beside the model
    (SCAFFOLD's control variate, FedProto's prototypes), as its part names
    it; None for most."""
    path = part("local-objective", settings.local_objective).load().server_state
    return load(path).from_settings(settings, model, sharing) if path else None

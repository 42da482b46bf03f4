"""Server updates and sharing policies. `build_strategy` turns settings into one."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..settings import Settings
from .fedavg import FedAvg
from .feddyn import FedDyn
from .fedopt import FedOpt
from .sampling import Roster
from .sharing import Sharing


def build_strategy(
    settings: Settings,
    roster: Roster,
    model: nn.Module,
    shard_sizes: Sequence[int] | None = None,
) -> FedAvg:
    """The server update named by `server-update`, sharing by `sharing` and
    `bn-policy`; a client may claim at most its shard's size in examples."""
    base = {
        "roster": roster,
        "num_clients": settings.num_clients,
        "client_frac": settings.client_frac,
        "seed": settings.seed,
        "sharing": Sharing.of(settings.sharing_policy, model),
        "personal_eval_every": settings.personal_eval_every,
        "max_examples": dict(enumerate(shard_sizes or ())),
        "min_replies": settings.min_train_replies,
        "min_train_nodes": settings.min_train_nodes,
        "norm_bound": settings.update_norm_bound,
        "norm_action": settings.update_norm_action,
    }
    if settings.server_update == "fedavg":
        return FedAvg(**base)
    if settings.server_update == "feddyn":
        return FedDyn(
            alpha=settings.dyn_alpha,
            h_scale=settings.feddyn_h_scale,
            exclude_bn=settings.feddyn_exclude_bn,
            **base,
        )
    return FedOpt(
        optimizer=settings.server_update,
        server_lr=settings.server_lr,
        momentum=settings.server_momentum,
        beta1=settings.beta1,
        beta2=settings.beta2,
        tau=settings.tau,
        bias_correction=settings.bias_correction,
        **base,
    )

"""The local objectives as parts: what each needs and refuses, and its term.

Each `local-objective` name in `pollen.catalog.LOCAL_OBJECTIVES` points to a
class here. The class says whether the data gradient is taken at SAM's
perturbed point, which regulariser term (`pollen.task.objectives`) the
client adds, what the client keeps between rounds, and its rules:
`problem(settings)` is what `pollen.settings` asks of it. The classes are
torch-free, so a run config is validated (by the CLI, before anything
runs) without the seconds torch's import takes; the terms, which need
torch, are named by import path and loaded by the client that trains.

A plug-in objective is one such class (its term may live beside it):
`sam`, `term`, `batch_term`, `keeps_state`, `server_state`, `synchronous_only`,
`mean_only` and `problem` as below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..catalog import LOCAL_OBJECTIVES, MODELS
from ..extensions import model_info

if TYPE_CHECKING:
    from ..settings import Settings

TERMS = "pollen.task.objectives"
# SCAFFOLD's server control variate, the one server state SecAgg+ sums
CONTROL_VARIATE = "pollen.strategies.scaffold:ServerControl"


class Plain:
    """The data loss alone (FedAvg's client), and the defaults of every
    objective's part: no term, no state, any aggregator and mode."""

    # the data gradient is taken at SAM's perturbed point (Foret et al. 2021)
    sam: ClassVar[bool] = False
    # the regulariser's class ("module:attribute", built by its
    # `from_settings`), or "" for none
    term: ClassVar[str] = ""
    # a term of each batch's loss (`pollen.task.objectives.BatchTerm`, named
    # the same way), or "" for none
    batch_term: ClassVar[str] = ""
    # the client keeps state between rounds (FedDyn's h_k, SCAFFOLD's c_k),
    # which only a run that checkpoints saves for a resume
    keeps_state: ClassVar[bool] = False
    # what the server keeps beside the model, sent with each training message
    # and moved by the replies' records ("module:attribute" of a class with
    # `from_settings(settings, model, sharing)`: SCAFFOLD's control variate,
    # FedProto's prototypes; `pollen.strategies.strategy.ObjectiveState`), or ""
    server_state: ClassVar[str] = ""
    # its term reads what the server sends of the model (FedDyn's and
    # SCAFFOLD's server state, MOON's global representation): under sharing
    # "local", where nothing travels, it would act on a model that never moves
    reads_the_server: ClassVar[bool] = False
    # its server keeps global class prototypes, by which a client can predict
    # (FedProto's inference, `proto-inference`; a subclass of FedProto that
    # replaces `server_state` sets it False)
    prototypes: ClassVar[bool] = False
    # why it needs synchronous rounds of one model version ("": async too)
    synchronous_only: ClassVar[str] = ""
    # why it needs the mean as the aggregator, and what is allowed ("": any)
    mean_only: ClassVar[str] = ""

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        """Why this objective cannot train as `settings` ask, or None (its
        modes and aggregators `Settings` reads from the two attributes):
        SAM's second pass cannot be clipped per sample (DP-SGD), a batch
        term needs the whole batch's pass, which neither DP-SGD's per-sample
        clipping nor a vectorised cohort gives it, and a server state moves
        with a synchronous round's replies, masked by SecAgg+ only where it
        is SCAFFOLD's control variate."""
        name = settings.local_objective
        if problem := cls._server_state_problem(settings):
            return problem
        if cls.batch_term and (settings.dp or settings.client_execution == "cohort"):
            given = "dp=true" if settings.dp else "client-execution='cohort'"
            return (
                f"local-objective={name!r} with {given}: its term on each batch "
                "needs the batch's own forward pass, which DP-SGD's per-sample "
                "clipping and a vectorised cohort do not give it; allowed with "
                f"{name}: dp=false and client-execution='sequential'"
            )
        if not (cls.sam and settings.dp):
            return None
        plain = [n for n, part in LOCAL_OBJECTIVES.items() if not part.load().sam]
        return (
            f"dp=true with local-objective={name!r}: SAM's second pass has no "
            "per-sample clipping; allowed with dp: " + ", ".join(plain)
        )

    @classmethod
    def _server_state_problem(cls, settings: Settings) -> str | None:
        """Why the server state this objective keeps cannot move as `settings`
        run, or None (a part that says it is `synchronous_only` is refused
        under FedBuff with its own reason)."""
        name = settings.local_objective
        if cls.server_state and not cls.synchronous_only and settings.mode == "async":
            return (
                f"mode='async' with local-objective={name!r}: its server state "
                "moves with a synchronous round's replies, which FedBuff's buffer "
                "never gives it; allowed with it: mode='sync'"
            )
        if settings.secure_aggregation != "off" and cls.server_state not in (
            "",
            CONTROL_VARIATE,
        ):
            return (
                f"local-objective={name!r} with secure-aggregation: SecAgg+ masks "
                "the model and SCAFFOLD's control variate only, so the records "
                "its server state reads would reach the server unmasked; allowed "
                f"with {name}: secure-aggregation='off'"
            )
        return None


class Sam(Plain):
    """The data loss at SAM's perturbed point (FedSAM)."""

    sam = True


class Prox(Plain):
    """FedProx's proximal term (stateless)."""

    term = f"{TERMS}:ProxTerm"


class ProxSam(Prox):
    """FedProx's term, the data gradient at SAM's point."""

    sam = True


class FedDyn(Plain):
    """FedDyn's dynamic regulariser; the client keeps h_k."""

    term = f"{TERMS}:DynTerm"
    keeps_state = True
    reads_the_server = True


class FedDynSam(FedDyn):
    """FedDyn's regulariser, the data gradient at SAM's point."""

    sam = True


class Scaffold(Plain):
    """SCAFFOLD's correction c - c_k: the client keeps c_k, the server c;
    the update of c_k reads the round's mean gradient off SGD steps, and c
    must move with the aggregate of the same round's replies."""

    term = f"{TERMS}:ControlTerm"
    keeps_state = True
    reads_the_server = True
    server_state = CONTROL_VARIATE
    synchronous_only = (
        "SCAFFOLD's control variates are defined for synchronous rounds of one "
        "model version"
    )
    mean_only = (
        "SCAFFOLD's server control variate moves by every accepted client's "
        "Delta c_k while the model would follow another rule, so c would stop "
        "tracking the clients' corrections; allowed with scaffold: mean"
    )

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        if problem := super().problem(settings):
            return problem
        if settings.client_optimizer == "sgd":
            return None
        return (
            f"local-objective={settings.local_objective!r} with client-optimizer="
            f"{settings.client_optimizer!r}: SCAFFOLD's c_k^+ = c_k - c + "
            "(x - y) / (lr K) reads the round's mean gradient off SGD steps; "
            "allowed: client-optimizer='sgd'"
        )


class ScaffoldSam(Scaffold):
    """SCAFFOLD's correction, the data gradient at SAM's point."""

    sam = True


def _representation_problem(settings: Settings, why: str) -> str | None:
    """Why `settings`' model has no representation for its local objective
    (`pollen.task.representation`: the input of its last `nn.Linear`, not a
    LoRA head, computed by trained layers below it), or None; `why` says
    what the objective does with it."""
    info = model_info(settings.model, settings.data_set)
    if info.linear and info.body and not info.lora:
        return None
    allowed = [name for name, m in MODELS.items() if m.linear and m.body and not m.lora]
    return (
        f"local-objective={settings.local_objective!r} with model="
        f"{settings.model!r}: {why} (its last nn.Linear, not a LoRA head), which "
        "trained layers below it must compute; allowed: " + ", ".join(allowed)
    )


class Moon(Plain):
    """MOON's model-contrastive loss on each batch; the client keeps its
    previous model. Its representation is the input of the model's last
    `nn.Linear`, so the model needs trained layers below that classifier,
    and those layers must travel (under `lg` they stay on the client, the
    received ones are the previous ones, and the term is a constant)."""

    batch_term = "pollen.task.moon:ModelContrast"
    keeps_state = True
    reads_the_server = True

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        if problem := super().problem(settings):
            return problem
        if problem := _representation_problem(
            settings, "MOON contrasts the input of the model's classifier"
        ):
            return problem
        if settings.sharing == "lg":
            return (
                "local-objective='moon' with sharing='lg': the layers below the "
                "classifier stay on each client, so the received model's "
                "representation is the previous model's and the term is constant; "
                "allowed with moon: any other sharing"
            )
        return None


class FedProto(Plain):
    """FedProto's pull of each representation to its class's global
    prototype (`pollen.task.fedproto`); the server keeps the global
    prototypes (`pollen.strategies.prototypes`) and each reply carries the
    client's. The representation is the input of the model's last
    `nn.Linear`; the prototypes travel as they are, so neither SecAgg+ nor
    central DP would cover them."""

    batch_term = "pollen.task.fedproto:PrototypeDistance"
    server_state = "pollen.strategies.prototypes:ServerPrototypes"
    prototypes = True
    synchronous_only = (
        "FedProto's global prototypes are the mean of one round's replies"
    )
    mean_only = (
        "FedProto's prototypes are averaged over every accepted reply while "
        "the model would follow another rule; allowed with fedproto: mean"
    )

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        if problem := super().problem(settings):
            return problem
        return _representation_problem(
            settings, "a prototype is the mean input of the model's classifier"
        )

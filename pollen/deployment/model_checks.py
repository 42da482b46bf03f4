"""What `pollen run` checks of the run's model and partition before any
process starts.

The model is built once on its data set's input shape: a resumed
checkpoint must hold its entries (a layer of a user's factory renamed or
resized since would otherwise fail the ServerApp after start-up), and the
copies of it a simulation keeps are estimated against this machine's
available memory (a warning, not a refusal: the estimate is coarse). A
user's local-objective term is tried for one step on it
(`pollen.task.term_check`), and a user's aggregator and server update on a
made-up round of its entries (`pollen.strategies.part_trial`).

Only a user's model or data set is built: the settings' validation has
imported torch for it already. A built-in model on a built-in data set
keeps the command torch-free (importing torch takes seconds): its entries
follow from settings a resume already compares, and the largest of them
(vgg16-lora, about 15 million parameters, most of them frozen) takes well
under a GB per client.

The run's partition is drawn here too (`partition_problem`), as the
ServerApp draws it, so one that no draw can give (a client left empty, a
`min-size` no draw meets) stops the command before Flower starts, and the
shards wait in the partition cache for the ServerApp to read. `iid` and
`niid-client` are not drawn: their equal shards cannot fail once the
settings' arithmetic has passed. The draw needs a copy of the data on this
machine: digits, a user's data set (its loader ran when the settings were
validated) or a built-in data set under `data-root`, decoded there but
never downloaded. Where there is none (the `data-root` of a remote
SuperLink, `download=true` with nothing here yet) or it cannot be read,
the ServerApp draws as before (and `check_local_data` names what is wrong
with a copy a local ServerApp would read). Labels and shards are read
without torch: a cached partition costs the command a read of the labels,
a hash of them and one file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..catalog import (
    ADAPTIVE_OPTIMIZERS,
    AGGREGATORS,
    DATA_SETS,
    LOCAL_OBJECTIVES,
    MODELS,
    SERVER_UPDATES,
)
from ..runs.checkpoints import Checkpoint, CheckpointError, model_problem
from ..settings import Settings

FLOAT_BYTES = 4  # a float32 entry: what pollen trains and sends
AGGREGATE_BYTES = 8  # the server aggregates in float64
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class ModelSize:
    """The run's model as built: each entry's shape, its parameter counts."""

    entries: dict[str, tuple[int, ...]]  # state_dict: parameters and buffers
    parameters: int
    trainable: int


def built_model(settings: Settings) -> ModelSize | None:
    """The run's model built once, as the ServerApp builds it, on its data
    set's input shape and classes; None for a built-in model on a built-in
    data set (not built: see the module's docstring). A frozen backbone
    gets random weights: the same shapes, nothing downloaded."""
    if settings.model in MODELS and settings.data_set in DATA_SETS:
        return None
    from ..task.inputs import shape_model
    from ..task.sharing import count_parameters

    model = shape_model(settings)  # a user's: built once, by the validation
    counts = count_parameters(model)
    return ModelSize(
        {name: tuple(value.shape) for name, value in model.state_dict().items()},
        counts["total"],
        counts["trainable"],
    )


def user_term_problem(settings: Settings) -> str | None:
    """Why a user's local objective's term cannot train, from one step of
    it (`pollen.task.term_check`), or None; pollen's own terms are not tried
    (they are tested, and trying one would import torch)."""
    if settings.local_objective in LOCAL_OBJECTIVES:
        return None
    from ..task.term_check import term_problem

    return term_problem(settings)


def user_round_problem(settings: Settings) -> str | None:
    """Why a user's aggregator or server update cannot finish a round of
    made-up replies to the run's model (`pollen.strategies.part_trial`), or
    None; where both parts are pollen's own, nothing is tried."""
    if settings.aggregator in AGGREGATORS and settings.server_update in SERVER_UPDATES:
        return None
    from ..strategies.compose import build_strategy
    from ..strategies.part_trial import round_trial_problem
    from ..task.inputs import shape_model

    model = shape_model(settings)
    strategy, _ = build_strategy(settings, model)
    arrays = {
        key: value.detach().cpu().numpy() for key, value in model.state_dict().items()
    }
    return round_trial_problem(strategy, arrays)


def partition_problem(settings: Settings) -> str | None:
    """Why the run's partition cannot be drawn (a `PartitionError`'s words),
    or None: drawn from this machine's copy of the data where there is one
    (see the module's docstring), and kept in the partition cache of
    `data-root` for the ServerApp, which reads the same file."""
    from ..extensions import data_set_info
    from ..task.data import local_training_labels, partition_cache
    from ..task.partition import EQUAL_SHARDS, PartitionError, run_partition

    if settings.partition in EQUAL_SHARDS:
        return None
    labels = local_training_labels(settings.data_set, settings.data_root)
    if labels is None:
        return None
    classes = data_set_info(settings.data_set).classes
    try:
        run_partition(labels, classes, settings, partition_cache(settings.data_root))
    except PartitionError as err:
        return f"{err} (data-set={settings.data_set!r})"
    return None


def check_resumed_model(
    checkpoint: Checkpoint, size: ModelSize | None, model: str
) -> None:
    """Refuse a checkpoint whose entries (names, shapes) are not those of
    the model built now (`model_problem`, as the ServerApp words it)."""
    if size is not None and (problem := model_problem(checkpoint, size.entries, model)):
        raise CheckpointError(problem)


@dataclass(frozen=True)
class MemoryEstimate:
    """What a simulated run holds of its model at once, in bytes: each client
    training (its model, gradients and optimiser state) and the server's
    copies (the global model, the float64 aggregate, the round's replies)."""

    parameters: int
    at_once: int  # clients training at once
    sampled: int  # clients a round sends the model to, and whose replies it holds
    client_bytes: int  # one training client's
    server_bytes: int

    @property
    def total(self) -> int:
        return self.at_once * self.client_bytes + self.server_bytes

    @property
    def round_traffic(self) -> int:
        """Bytes a round sends each way: the model to and from every sampled
        client (all of it; a sharing policy that keeps entries local sends less)."""
        return self.sampled * self.parameters * FLOAT_BYTES


def optimizer_copies(optimizer: str, momentum: float) -> int:
    """Copies of the trainable parameters a client optimiser keeps: adam's
    and adamw's two moments, SGD's momentum buffer, none for plain SGD."""
    if optimizer in ADAPTIVE_OPTIMIZERS:
        return 2
    return 1 if momentum > 0 else 0


def memory_estimate(
    size: ModelSize, copies: int, at_once: int, sampled: int
) -> MemoryEstimate:
    """The bytes of `MemoryEstimate`: a training client holds the model, and
    a gradient and `copies` optimiser states of each trainable parameter;
    the server the global model, the aggregate in float64 and `sampled`
    replies."""
    model = size.parameters * FLOAT_BYTES
    client = model + size.trainable * FLOAT_BYTES * (1 + copies)
    server = model * (1 + sampled) + size.parameters * AGGREGATE_BYTES
    return MemoryEstimate(size.parameters, at_once, sampled, client, server)


def clients_sent(settings: Settings) -> int:
    """Clients the model is sent to at once: a round's sampled clients
    (async: `concurrency`, or as many as a round samples)."""
    if settings.mode == "async":
        return settings.concurrency or settings.sample_size
    return settings.sample_size


def clients_at_once(settings: Settings, actors: int) -> int:
    """Clients a simulation of `actors` ClientApp actors trains at once:
    those sent the model, at most one per actor."""
    return max(1, min(clients_sent(settings), actors))


def available_memory(meminfo: Path = MEMINFO) -> int | None:
    """This machine's available memory in bytes (`MemAvailable` of
    /proc/meminfo), or None where it cannot be read (not Linux)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable" and value.split()[1:] == ["kB"]:
            return int(value.split()[0]) * 1024
    return None


def memory_warning(settings: Settings, estimate: MemoryEstimate, available: int) -> str:
    """The one line that says `estimate` is above `available` bytes, and
    what to change."""
    return (
        f"pollen: warning: model {settings.model!r} ({estimate.parameters:,} "
        f"parameters) may not fit this machine's memory: a simulation here needs "
        f"about {_gb(estimate.total)} GB ({estimate.at_once} clients training at "
        f"once, {_gb(estimate.client_bytes)} GB each with {settings.client_optimizer}"
        f"'s state; the server's copies {_gb(estimate.server_bytes)} GB), "
        f"{_gb(available)} GB is available; each round sends "
        f"{_gb(estimate.round_traffic)} GB down and {_gb(estimate.round_traffic)} "
        f"GB up ({estimate.sampled} clients); train fewer clients at once "
        '(--federation-config "client-resources-num-cpus=2"), sample fewer '
        "(client-frac), or choose a smaller model"
    )


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f}"


def warn_about_memory(settings: Settings, size: ModelSize | None, actors: int) -> None:
    """Print `memory_warning` on stderr where the estimate of a simulation
    on this machine with `actors` ClientApp actors is above its available
    memory; nothing where the model was not built or the memory cannot be
    read (a deployment's nodes have memory of their own: not estimated)."""
    available = available_memory()
    if size is None or available is None:
        return
    copies = optimizer_copies(settings.client_optimizer, settings.momentum)
    at_once = clients_at_once(settings, actors)
    estimate = memory_estimate(size, copies, at_once, clients_sent(settings))
    if estimate.total > available:
        print(
            memory_warning(settings, estimate, available), file=sys.stderr, flush=True
        )

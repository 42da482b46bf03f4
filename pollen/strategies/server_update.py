"""The server update: how the next global model follows from the aggregate.

A server update is the third step of a round (after the replies are checked
and aggregated). It receives the current shared entries, the float64
aggregate of the clients' entries, and which shared entries are trained
(the ones an optimiser or correction may step: never BatchNorm statistics
or other buffers, which are simply averaged). What it keeps between rounds
(moments, FedDyn's h) it exports as plain arrays for checkpoints.

Implementations: `fedavg.FedAvgUpdate`, the FedOpt optimisers in `fedopt`,
`feddyn.FedDynUpdate`, each named in `pollen.catalog.SERVER_UPDATES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from .aggregation import Aggregate, Arrays

# which shared entries are trained: (exclude BatchNorm's affine entries?) -> names
TrainedKeys = Callable[[bool], tuple[str, ...]]


class ServerUpdate:
    """Base of every server update; subclasses implement `apply`."""

    # the aggregation step weights replies by example count unless this is set
    uniform_mean: bool = False
    # the server learning rate `server-lr = "auto"` stands for
    auto_server_lr: ClassVar[float] = 1.0
    # why it needs synchronous rounds of one model version ("": async too)
    synchronous_only: ClassVar[str] = ""
    # why it needs the mean as the aggregator, and what is allowed ("": any)
    mean_only: ClassVar[str] = ""

    @classmethod
    def problem(cls, settings: Any) -> str | None:
        """Why this update cannot run with `settings`, or None (what
        `pollen.settings` asks of the run's server update beside its modes
        and aggregators, which it reads from the two attributes)."""
        return None

    def apply(
        self, current: Arrays, aggregate: Aggregate, trained: TrainedKeys
    ) -> dict[str, np.ndarray]:
        """The next shared entries, each in its current dtype."""
        raise NotImplementedError

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What a resumed run needs of this update's state (none by default)."""
        return {}

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_arrays` returned."""


def prefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` under `prefix/` names, to share one flat checkpoint namespace."""
    return {f"{prefix}/{key}": value for key, value in arrays.items()}


def unprefixed(prefix: str, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The entries of `state` saved by `prefixed(prefix, ...)`."""
    start = f"{prefix}/"
    return {k.removeprefix(start): v for k, v in state.items() if k.startswith(start)}

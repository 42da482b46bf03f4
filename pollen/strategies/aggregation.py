"""The aggregation step: the replies of a round -> one aggregate per entry.

It sits between the checked replies and the server update. Today's rule is
the weighted mean (FedAvg's, McMahan et al. 2017,
https://arxiv.org/abs/1602.05629),

    x_bar = sum_k w_k x_k / sum_k w_k,

with w_k the client's example count, or 1 for every client where the server
update asks for a uniform mean (FedDyn). The aggregate stays in float64 so
the server update that follows (FedAvg, FedOpt, FedDyn) works at full
precision and casts once. The Byzantine-robust rules (median, trimmed
mean, Krum, Bulyan) are the other aggregators (`robust`); each is named in
`pollen.catalog.AGGREGATORS` and built by its `from_settings`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # settings validation loads the rules without Flower
    from flwr.app import MetricRecord

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ClientUpdate:
    """One accepted training reply: the client, its decoded shared entries,
    its checked metrics, its weight (example count) and any further checked
    array records the round expects (SCAFFOLD's Delta c_k), by record name."""

    client: int
    arrays: Arrays
    metrics: MetricRecord
    num_examples: float
    records: Mapping[str, Arrays] = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregate:
    """What the aggregation step hands the server update: one float64 value
    per shared entry, the updates it was made of (in client order), and what
    the step reports for the history (central DP: clip norm, epsilon)."""

    arrays: dict[str, np.ndarray]
    updates: tuple[ClientUpdate, ...]
    report: Mapping[str, float] = field(default_factory=dict)


def normalized(weights: Sequence[float], count: int) -> np.ndarray:
    """Weights as float64 summing to one; refuse a wrong count or a non-positive one."""
    w = np.asarray(weights, dtype=np.float64)
    if count == 0:
        raise ValueError("nothing to average")
    if w.shape != (count,) or not np.all(w > 0):
        raise ValueError(f"need one positive weight per record, got {list(weights)}")
    return w / w.sum()


def mean64(records: Sequence[Arrays], weights: np.ndarray, key: str) -> np.ndarray:
    """sum_k w_k x_k for one entry, in float64 (`weights` already sum to one)."""
    return sum(
        (
            wk * r[key].astype(np.float64)
            for wk, r in zip(weights, records, strict=True)
        ),
        start=np.zeros(records[0][key].shape),
    )


def cast_like(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    """`value` in `like`'s dtype; integer entries (BatchNorm counters) are rounded."""
    if not np.issubdtype(like.dtype, np.floating):
        value = np.rint(value)
    return np.asarray(value, dtype=like.dtype)


class Aggregator(Protocol):
    """An aggregation step: the accepted updates (in client order), the
    shared entries the clients were sent (`current`) and which of them are
    trained -> one float64 aggregate per entry."""

    @property
    def min_updates(self) -> int:
        """The fewest updates the rule is defined for (a round with fewer is
        skipped)."""
        ...

    # metrics every reply must carry as positive numbers for this rule
    required_metrics: tuple[str, ...]

    def train_config(self) -> dict[str, float]: ...

    def state_arrays(self) -> dict[str, np.ndarray]: ...

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None: ...

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        current: Arrays,
        trained: Collection[str] = (),
    ) -> Aggregate: ...


class Rule:
    """Defaults of an aggregation rule: defined for one update, reads no
    metric, adds nothing to the training config, keeps no state, built from
    settings without parameters, refused by asynchronous training."""

    min_updates = 1
    required_metrics: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> Any:
        return cls()

    @classmethod
    def problem(cls, settings: Any) -> str | None:
        """Why this rule cannot aggregate the rounds `settings` describe, or
        None (what `pollen.settings` asks of the run's aggregator)."""
        if settings.mode == "async":
            return (
                f"aggregator={settings.aggregator!r} with mode='async': FedBuff "
                "aggregates its buffer by the staleness-weighted mean; allowed "
                "with async: mean"
            )
        return cls.round_problem(settings, settings.sample_size)

    @classmethod
    def round_problem(cls, settings: Any, n: int) -> str | None:
        """Why a round of `n` replies is too small for this rule, or None:
        its `min_updates` as built from `settings`."""
        needed = cls.from_settings(settings).min_updates
        if n >= needed:
            return None
        return (
            f"aggregator={settings.aggregator!r} needs {needed} replies per round; "
            f"a round samples {n} (client-frac x num-clients); sample more clients"
        )

    def train_config(self) -> dict[str, float]:
        """Entries for every training message's config (none by default)."""
        return {}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What a resumed run needs of this rule's state (none by default)."""
        return {}

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_arrays` returned."""


class Mean(Rule):
    """The example-weighted (or, with `uniform`, plain) mean of every entry."""

    def __init__(self, uniform: bool = False) -> None:
        self.uniform = uniform

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> Mean:
        """`uniform` comes from the server update (FedDyn's plain mean)."""
        return cls(uniform)

    @classmethod
    def problem(cls, settings: Any) -> str | None:
        """None: the mean takes any round (FedBuff's buffer has its own)."""
        return None

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        weights = [1.0 if self.uniform else u.num_examples for u in updates]
        w = normalized(weights, len(updates))
        records = [u.arrays for u in updates]
        return Aggregate({key: mean64(records, w, key) for key in keys}, tuple(updates))

"""Byzantine-robust aggregation steps: median, trimmed mean, Krum, Bulyan.

Each one replaces the weighted mean of `aggregation.Mean` between the checked
replies and the server update, so FedAvg takes its result as the model and
FedOpt's optimisers take its pseudo-gradient. All of them are equivariant
under translation, so applying them to the clients' models (what the replies
carry) equals applying them to the updates and adding the current model.
Notation: n replies, of which at most f (`byzantine-clients`) are Byzantine.

- coordinate-wise **median** (Yin et al. 2018, "Byzantine-robust distributed
  learning: towards optimal statistical rates"): x_bar[j] = median_k x_k[j];
- coordinate-wise **trimmed mean** (same paper): per coordinate, drop the
  floor(beta n) smallest and largest values, average the rest;
- **Krum** and **multi-Krum** (Blanchard et al. 2017, "Machine learning with
  adversaries: Byzantine tolerant gradient descent"): score(k) = sum of the
  squared distances from x_k to its n - f - 2 nearest other replies; Krum
  takes the reply of lowest score, multi-Krum the mean of the m lowest;
- **Bulyan** (El Mhamdi et al. 2018, "The hidden vulnerability of
  distributed learning in Byzantium", Algorithm 2): Krum applied
  recursively (pick, remove, re-score the rest) selects theta = n - 2f
  replies; per coordinate, the mean of the beta = theta - 2f selected values
  closest to their median.

The rules are unweighted, as the papers are: a Byzantine client could
claim any example count (Flower's MultiKrum weights its selected replies by
it; the test compares them with equal counts). Flower 1.42 ships the
same rules as strategies (FedMedian, FedTrimmedAvg, Krum, MultiKrum,
Bulyan); tests/test_robust_aggregators.py checks pollen's results against theirs. One
difference is deliberate: Flower's Bulyan selects its theta replies by one
pass of multi-Krum's scores, pollen re-scores after each pick as the paper
does; the two agree whenever the first ranking survives the removals (the
usual case of far-off attackers), and the test shows both.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from .aggregation import Aggregate, ClientUpdate, Mean, Rule


class Median(Rule):
    """The coordinate-wise median of the replies."""

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        stacked = {key: _stack(updates, key) for key in keys}
        return Aggregate(
            {key: np.median(values, axis=0) for key, values in stacked.items()},
            tuple(updates),
        )


class TrimmedMean(Rule):
    """Per coordinate, the mean after dropping the floor(beta n) smallest and
    floor(beta n) largest values (beta = `trim-fraction`, below 1/2)."""

    def __init__(self, beta: float) -> None:
        if not 0 <= beta < 0.5:
            raise ValueError(f"trim fraction {beta!r}: allowed in [0, 0.5)")
        self.beta = beta

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> TrimmedMean:
        return cls(settings.trim_fraction)

    @staticmethod
    def trimmed(beta: float, n: int) -> int:
        """floor(beta n), `beta` read as the decimal it was written as (0.29
        of 100 is 29; the float product is 28.999999999999996)."""
        return math.floor(Fraction(repr(beta)) * n)

    @classmethod
    def round_problem(cls, settings: Any, n: int) -> str | None:
        """A fraction that trims no value of `n` would be the plain mean."""
        beta = settings.trim_fraction
        if cls.trimmed(beta, n) > 0:
            return None
        return (
            f"trim-fraction={beta:g} of the {n} replies a round samples trims none "
            f"(floor({beta:g} x {n}) = 0): the rule would be the plain mean; "
            f"allowed: at least {math.ceil(1e6 / n) / 1e6:g}"
        )

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        n = len(updates)
        cut = self.trimmed(self.beta, n)
        arrays = {}
        for key in keys:
            ordered = np.sort(_stack(updates, key), axis=0)
            arrays[key] = ordered[cut : n - cut].mean(axis=0)
        return Aggregate(arrays, tuple(updates))


def _byzantine_problem(settings: Any, n: int, needed: int, rule: str) -> str | None:
    """Why a round of `n` replies is too small for a rule that needs `needed`
    (`rule`, in terms of f = `byzantine-clients`), or None."""
    if n >= needed:
        return None
    return (
        f"aggregator={settings.aggregator!r} with byzantine-clients="
        f"{settings.byzantine_clients} needs {rule} replies per round ({needed}); "
        f"a round samples {n} (client-frac x num-clients); sample more clients "
        "or lower byzantine-clients"
    )


class Krum(Rule):
    """Multi-Krum: the mean of the `select` replies of lowest Krum score;
    `select` = 1 is Krum itself (its one reply, unchanged), as `krum`
    builds it. `select` = 0 means n - f, Blanchard et al.'s suggestion."""

    def __init__(self, byzantine: int, select: int = 1) -> None:
        if byzantine < 0 or select < 0:
            raise ValueError(
                f"byzantine={byzantine}, select={select}: allowed >= 0 each"
            )
        self.byzantine = byzantine
        self.select = select
        self.mean = Mean(uniform=True)

    @staticmethod
    def fewest(byzantine: int) -> int:
        """Krum's condition n > 2f + 2: the fewest replies it scores."""
        return 2 * byzantine + 3

    @property
    def min_updates(self) -> int:
        """Krum's condition n > 2f + 2, and m <= n - f."""
        return max(self.fewest(self.byzantine), self.select + self.byzantine)

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> Krum:
        return cls(settings.byzantine_clients)

    @classmethod
    def round_problem(cls, settings: Any, n: int) -> str | None:
        f = settings.byzantine_clients
        return _byzantine_problem(settings, n, cls.fewest(f), "n >= 2f + 3")

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        select = self.select or len(updates) - self.byzantine
        distances = squared_distances(updates, _compared(keys, trained))
        chosen = lowest_scores(distances, self.byzantine, select)
        return self.mean([updates[i] for i in sorted(chosen)], keys)


class MultiKrum(Krum):
    """Multi-Krum as `multi-krum` builds it: `krum-select` replies."""

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> MultiKrum:
        return cls(settings.byzantine_clients, settings.krum_select)

    @classmethod
    def round_problem(cls, settings: Any, n: int) -> str | None:
        """Krum's condition, and m <= n - f: more would average Byzantine
        replies too."""
        if problem := super().round_problem(settings, n):
            return problem
        f, select = settings.byzantine_clients, settings.krum_select
        if select <= n - f:
            return None
        return (
            f"krum-select={select} above n - f = {n - f} (a round samples {n}, "
            f"byzantine-clients={f}): multi-Krum would average Byzantine replies "
            "too; allowed: 1 to n - f, or 0 for n - f"
        )


class Bulyan(Rule):
    """Recursive Krum selects theta = n - 2f replies; per coordinate, the mean
    of the beta = theta - 2f selected values closest to their median."""

    def __init__(self, byzantine: int) -> None:
        if byzantine < 0:
            raise ValueError(f"byzantine={byzantine}: allowed >= 0")
        self.byzantine = byzantine

    @property
    def min_updates(self) -> int:
        """Bulyan's condition n >= 4f + 3."""
        return 4 * self.byzantine + 3

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> Bulyan:
        return cls(settings.byzantine_clients)

    @classmethod
    def round_problem(cls, settings: Any, n: int) -> str | None:
        needed = cls.from_settings(settings).min_updates
        return _byzantine_problem(settings, n, needed, "n >= 4f + 3")

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        f = self.byzantine
        theta = len(updates) - 2 * f
        beta = theta - 2 * f
        distances = squared_distances(updates, _compared(keys, trained))
        chosen = sorted(recursive_krum(distances, f, theta))
        selected = [updates[i] for i in chosen]
        arrays = {}
        for key in keys:
            values = _stack(selected, key)
            gap = np.abs(values - np.median(values, axis=0))
            closest = np.argsort(gap, axis=0, kind="stable")[:beta]
            arrays[key] = np.take_along_axis(values, closest, axis=0).mean(axis=0)
        return Aggregate(arrays, tuple(selected))


def _compared(keys: Collection[str], trained: Collection[str]) -> list[str]:
    """The entries Krum's distances are taken over: the trained ones (all of
    `keys` when none are named). Not BatchNorm's batch counter: it grows by
    each client's number of local steps, so shard size, not the update,
    would decide whom Krum picks."""
    return [key for key in keys if key in trained] if trained else list(keys)


def squared_distances(
    updates: Sequence[ClientUpdate], keys: Collection[str]
) -> np.ndarray:
    """The n x n matrix of squared L2 distances between the replies, over
    every entry in `keys`, in float64."""
    n = len(updates)
    distances = np.zeros((n, n))
    for key in keys:
        flat = _stack(updates, key).reshape(n, -1)
        gram = flat @ flat.T
        norms = np.diag(gram)
        distances += norms[:, None] + norms[None, :] - 2 * gram
    np.fill_diagonal(distances, 0.0)
    return np.maximum(distances, 0.0)


def krum_scores(distances: np.ndarray, byzantine: int) -> np.ndarray:
    """score(k): the sum of the squared distances from reply k to its
    max(1, n - f - 2) nearest other replies (Blanchard et al., eq. in
    Section 4)."""
    n = len(distances)
    neighbours = max(1, n - byzantine - 2)
    others = distances[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    return np.sort(others, axis=1)[:, :neighbours].sum(axis=1)


def lowest_scores(distances: np.ndarray, byzantine: int, count: int) -> list[int]:
    """The indices of the `count` replies of lowest Krum score (ties: the
    lower index first)."""
    order = np.argsort(krum_scores(distances, byzantine), kind="stable")
    return [int(i) for i in order[:count]]


def recursive_krum(distances: np.ndarray, byzantine: int, count: int) -> list[int]:
    """Bulyan's selection: `count` times, the reply of lowest Krum score among
    those not yet chosen, scored again among them after each pick."""
    left = list(range(len(distances)))
    chosen = []
    for _ in range(count):
        among = distances[np.ix_(left, left)]
        best = left[lowest_scores(among, byzantine, 1)[0]]
        chosen.append(best)
        left.remove(best)
    return chosen


def _stack(updates: Sequence[ClientUpdate], key: str) -> np.ndarray:
    """One entry of every reply, stacked along a new first axis, in float64."""
    return np.stack([u.arrays[key].astype(np.float64) for u in updates])

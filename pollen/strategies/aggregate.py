"""Weighted averaging of named model entries that keeps each entry's dtype."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]


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


def weighted_average(
    records: Sequence[Arrays], weights: Sequence[float]
) -> dict[str, np.ndarray]:
    """sum_k w_k x_k / sum_k w_k for every entry, accumulated in float64.

    Floating entries come back in their own dtype (float32 on the wire);
    integer entries such as BatchNorm's `num_batches_tracked` are rounded and
    stay integers.
    """
    w = normalized(weights, len(records))
    return {
        key: cast_like(mean64(records, w, key), records[0][key]) for key in records[0]
    }

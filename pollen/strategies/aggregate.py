"""Weighted averaging of named model entries that keeps each entry's dtype."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord


def weighted_average(
    records: Sequence[ArrayRecord], weights: Sequence[float]
) -> ArrayRecord:
    """sum_k w_k x_k / sum_k w_k for every entry, accumulated in float64.

    Floating entries come back in their own dtype (float32 on the wire);
    integer entries such as BatchNorm's `num_batches_tracked` are rounded and
    stay integers.
    """
    if not records:
        raise ValueError("nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(records),) or not np.all(w > 0):
        raise ValueError(f"need one positive weight per record, got {list(weights)}")
    w = w / w.sum()
    out = {}
    for key in records[0]:
        parts = [r[key].numpy() for r in records]
        total = sum(wk * p.astype(np.float64) for wk, p in zip(w, parts, strict=True))
        dtype = parts[0].dtype
        if not np.issubdtype(dtype, np.floating):
            total = np.rint(total)
        out[key] = Array(np.asarray(total, dtype=dtype))
    return ArrayRecord(out)

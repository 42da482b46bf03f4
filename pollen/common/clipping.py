"""Clipping an update to a norm bound: central DP's sensitivity C.

DP-FedAvg (McMahan et al., 2018, https://arxiv.org/abs/1710.06963, Algorithm
1) bounds each client's contribution by scaling its update Delta = y - x
back to norm C. The server clips in its aggregation step
(`strategies/central_dp.py`); with `central-clip-on = "client"` the client
clips first (`client_app`), so its update never leaves it unclipped.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Array, ArrayRecord


def clipped(delta: dict[str, np.ndarray], clip_norm: float) -> tuple[dict, float]:
    """Delta min(1, C / ||Delta||) over all entries together, and ||Delta||."""
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: d * scale for k, d in delta.items()}, norm


def clipped_reply(
    sent: ArrayRecord, trained: ArrayRecord, clip_norm: float
) -> tuple[ArrayRecord, float]:
    """A client's clipping (`central-clip-on = "client"`): its floating
    entries moved back to x + Delta min(1, C / ||Delta||), and ||Delta||."""
    values = {k: trained[k].numpy() for k in trained}  # each decoded once
    start = {
        k: sent[k].numpy().astype(np.float64)
        for k, v in values.items()
        if np.issubdtype(v.dtype, np.floating)
    }
    delta, norm = clipped({k: values[k] - x for k, x in start.items()}, clip_norm)
    for k, x in start.items():
        values[k] = (x + delta[k]).astype(values[k].dtype)
    return ArrayRecord({k: Array(v) for k, v in values.items()}), norm

"""FedBuff's aggregation (Nguyen et al. 2022, "Federated Learning with
Buffered Asynchronous Aggregation", Algorithm 1,
https://arxiv.org/abs/2106.06639).

A client trains from the model version it was sent, v_k, and returns its
model y_k; its update is Delta_k = y_k - x_{v_k}. The server collects K
updates in a buffer and then applies

    Delta_bar = (1 / K) * sum_k s(tau_k) * Delta_k,   s(tau) = 1 / sqrt(1 + tau),

where tau_k, the update's staleness, is the number of server updates made
since v_k. The paper steps x <- x + eta_g * Delta_bar; pollen hands the
server update the aggregate x + Delta_bar, so FedAvg's update takes it as the
model (eta_g = 1), FedOpt's `sgd` steps eta_g = server-lr along it (FedBuff's
own rule; the `fedbuff` preset) and the adaptive optimisers take -Delta_bar as
their pseudo-gradient. The mean divides by K, not by the sum of the weights,
as in the paper: stale buffers move the model less.

Each update is first rebased onto the current model (x_t + Delta_k), so the
norm bound and the reply checks see it as they see a synchronous reply.
That holds for trained entries. Statistics and buffers (BatchNorm's running
mean and variance, its batch counter) are not rebased: a running variance
moved by a stale update's change can turn negative. They are the
staleness-weighted mean of the clients' own values,
sum_k s(tau_k) v_k / sum_k s(tau_k), as a synchronous round averages them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import numpy as np

from .aggregation import Aggregate, Arrays, ClientUpdate, mean64


def staleness_weight(staleness: int) -> float:
    """s(tau) = 1 / sqrt(1 + tau): FedBuff's polynomial staleness scaling."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1 / math.sqrt(1 + staleness)


def rebased(
    update: ClientUpdate, sent: Arrays, current: Arrays, trained: Collection[str]
) -> ClientUpdate:
    """The update's `trained` entries as x_t + Delta_k (float64): their
    change from the entries it was sent (`sent`, version v_k), applied to
    the `current` ones; its other entries (statistics) as they are."""
    arrays = {
        key: current[key].astype(np.float64)
        + (update.arrays[key].astype(np.float64) - sent[key].astype(np.float64))
        if key in trained
        else update.arrays[key].astype(np.float64)
        for key in current
    }
    return dataclasses.replace(update, arrays=arrays)


def buffered_mean(
    updates: Sequence[ClientUpdate],
    staleness: Sequence[int],
    current: Arrays,
    trained: Collection[str],
) -> Aggregate:
    """x_t + Delta_bar on the `trained` entries of updates already `rebased`
    onto `current`; the staleness-weighted mean of the others."""
    if not updates or len(updates) != len(staleness):
        raise ValueError(
            f"need one staleness per update, got {len(updates)} updates and "
            f"{len(staleness)} staleness values"
        )
    scale = np.array([staleness_weight(tau) for tau in staleness])
    records = [u.arrays for u in updates]
    arrays = {}
    for key, x in current.items():
        if key in trained:
            base = x.astype(np.float64)
            steps = [r[key] - base for r in records]
            arrays[key] = base + mean64(
                [{key: d} for d in steps], scale / len(updates), key
            )
        else:
            arrays[key] = mean64(records, scale / scale.sum(), key)
    return Aggregate(arrays, tuple(updates))

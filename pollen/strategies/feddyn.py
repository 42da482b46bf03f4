"""FedDyn's server (Acar et al. 2021): a plain mean corrected by the state h.

https://arxiv.org/abs/2111.04263, Algorithm 1.

After each round, over the participating clients S_t and the previous model
theta_prev,

    h     <- h - alpha * (1/m) * sum_{k in S_t} (theta_k - theta_prev)
    theta  = (1/|S_t|) * sum_{k in S_t} theta_k - h / alpha

with m = `num_clients` (the paper's choice) or |S_t| (`h_scale=participants`).
Only trained shared entries are corrected; with `exclude_bn` BatchNorm's
scale and shift are left out too (seed 001). Everything else, BatchNorm's
running statistics included, is plainly (uniformly) averaged. h is float64.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..catalog import FEDDYN_H_SCALES
from ..settings import Settings
from .aggregation import Aggregate, Arrays, cast_like
from .server_update import ServerUpdate, TrainedKeys, prefixed, unprefixed


class FedDynUpdate(ServerUpdate):
    """Uniform mean of the clients' models minus h / alpha."""

    uniform_mean = True
    synchronous_only = (
        "FedDyn's server state h corrects a synchronous round's mean of one "
        "model version"
    )
    mean_only = (
        "FedDyn's server state h is corrected by the plain mean of the "
        "participants' models (Acar et al. 2021, eq. 4); another aggregate "
        "breaks that correction; allowed with feddyn: mean"
    )

    def __init__(
        self, *, alpha: float, num_clients: int, h_scale: str = "num-clients",
        exclude_bn: bool = True,
    ) -> None:  # fmt: skip
        if h_scale not in FEDDYN_H_SCALES:
            raise ValueError(
                f"unknown h scale {h_scale!r}; allowed: {', '.join(FEDDYN_H_SCALES)}"
            )
        self.alpha = alpha
        self.num_clients = num_clients
        self.h_scale = h_scale
        self.exclude_bn = exclude_bn
        self.h: dict[str, np.ndarray] = {}

    @classmethod
    def from_settings(cls, s: Settings) -> FedDynUpdate:
        return cls(
            alpha=s.dyn_alpha, num_clients=s.num_clients, h_scale=s.feddyn_h_scale,
            exclude_bn=s.feddyn_exclude_bn,
        )  # fmt: skip

    def state_arrays(self) -> dict[str, np.ndarray]:
        return prefixed("h", self.h)

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        self.h = unprefixed("h", state)

    def apply(
        self, current: Arrays, aggregate: Aggregate, trained: TrainedKeys
    ) -> dict[str, np.ndarray]:
        participants = len(aggregate.updates)
        corrected = set(trained(self.exclude_bn))
        m = self.num_clients if self.h_scale == "num-clients" else participants
        out = {}
        for key, prev in current.items():
            mean = aggregate.arrays[key]
            if key in corrected:
                drift_sum = participants * (mean - prev.astype(np.float64))
                h = self.h.get(key, 0.0) - self.alpha / m * drift_sum
                self.h[key] = h
                mean = mean - h / self.alpha
            out[key] = cast_like(mean, prev)
        return out

"""FedDyn's server (Acar et al. 2021): a plain mean corrected by the state h.

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

from .aggregate import Arrays, cast_like, mean64, normalized
from .fedavg import FedAvg, prefixed, unprefixed

H_SCALES = ("num-clients", "participants")


class FedDyn(FedAvg):
    """Uniform mean of the clients' models minus h / alpha."""

    def __init__(
        self, *, alpha: float, h_scale: str = "num-clients", exclude_bn: bool = True,
        **base,
    ) -> None:  # fmt: skip
        super().__init__(**base)
        if h_scale not in H_SCALES:
            raise ValueError(
                f"unknown h scale {h_scale!r}; allowed: {', '.join(H_SCALES)}"
            )
        self.alpha = alpha
        self.h_scale = h_scale
        self.exclude_bn = exclude_bn
        self.h: dict[str, np.ndarray] = {}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {**super().state_arrays(), **prefixed("h", self.h)}

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(state)
        self.h = unprefixed("h", state)

    def update(
        self, current: Arrays, updates: list[Arrays], weights: list[float]
    ) -> dict[str, np.ndarray]:
        uniform = normalized([1.0] * len(updates), len(updates))
        corrected = set(self.trained_keys(self.exclude_bn))
        m = self.num_clients if self.h_scale == "num-clients" else len(updates)
        out = {}
        for key, prev in current.items():
            mean = mean64(updates, uniform, key)
            if key in corrected:
                drift_sum = len(updates) * (mean - prev.astype(np.float64))
                h = self.h.get(key, 0.0) - self.alpha / m * drift_sum
                self.h[key] = h
                mean = mean - h / self.alpha
            out[key] = cast_like(mean, prev)
        return out

"""FedOpt (Reddi et al. 2021): a server optimiser stepping on the pseudo-gradient.

With Delta = sum_k p_k (x_k - x) / sum_k p_k (p_k: example counts), one
server step per round on the trained shared entries:

- `sgd`:     v = mu v + Delta;  x += lr v          (mu > 0: FedAvgM; lr 1, mu 0: FedAvg)
- `adagrad`: m = b1 m + (1 - b1) Delta;  v += Delta^2
- `adam`:    m as above;  v = b2 v + (1 - b2) Delta^2
- `yogi`:    m as above;  v -= (1 - b2) Delta^2 sign(v - Delta^2)

and for the adaptive three x += lr m_hat / (sqrt(v_hat) + tau), where the hats
are m / (1 - b1^t) and (adam, yogi) v / (1 - b2^t) with `bias_correction`,
else m and v themselves. Moments start at zero, as in the seed notebook.
Each optimiser is one class here, named in `pollen.catalog.SERVER_UPDATES`.

BatchNorm statistics and other buffers never enter an optimiser: they are
averaged. Optimiser state is float64; the model stays float32 on the wire.
(Flower's own FedAdam/FedYogi/FedAdagrad step every entry, buffers included,
and upcast to float64, hence this module.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from ..settings import Settings
from .aggregation import Aggregate, Arrays, cast_like
from .server_update import ServerUpdate, TrainedKeys, prefixed, unprefixed


class FedOptUpdate(ServerUpdate):
    """A server optimiser on the example-weighted pseudo-gradient; each
    subclass is one optimiser's step."""

    def __init__(
        self,
        *,
        server_lr: float,
        momentum: float = 0.0,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: bool = False,
    ) -> None:
        self.server_lr = server_lr
        self.momentum = momentum
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.bias_correction = bias_correction
        self.steps = 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    @classmethod
    def from_settings(cls, s: Settings) -> FedOptUpdate:
        return cls(
            server_lr=s.server_lr, momentum=s.server_momentum, beta1=s.beta1,
            beta2=s.beta2, tau=s.tau, bias_correction=s.bias_correction,
        )  # fmt: skip

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {
            **prefixed("m", self.m),
            **prefixed("v", self.v),
            "steps": np.array(self.steps, np.int64),
        }

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        self.m, self.v = unprefixed("m", state), unprefixed("v", state)
        self.steps = int(state["steps"])

    def apply(
        self, current: Arrays, aggregate: Aggregate, trained: TrainedKeys
    ) -> dict[str, np.ndarray]:
        """x + lr * step(Delta) on trained entries, Delta = aggregate - x; the
        aggregate itself on the others (BatchNorm statistics, buffers)."""
        stepped = set(trained(False))
        self.steps += 1
        out = {}
        for key, x in current.items():
            mean = aggregate.arrays[key]
            if key in stepped:
                x64 = x.astype(np.float64)
                out[key] = cast_like(x64 + self._increment(key, mean - x64), x)
            else:
                out[key] = cast_like(mean, x)
        return out

    def _increment(self, key: str, delta: np.ndarray) -> np.ndarray:
        """lr times the step direction for one entry; updates the moments."""
        raise NotImplementedError


class ServerSgd(FedOptUpdate):
    """Server SGD with heavy-ball momentum (FedAvgM; FedAvg at lr 1, mu 0)."""

    def _increment(self, key: str, delta: np.ndarray) -> np.ndarray:
        if not self.momentum:
            return self.server_lr * delta
        v = self.momentum * self.v.get(key, 0.0) + delta
        self.v[key] = v
        return self.server_lr * v


class Adaptive(FedOptUpdate):
    """The adaptive optimisers: m_hat / (sqrt(v_hat) + tau), each with its
    own second moment."""

    auto_server_lr = 1e-2  # the seed notebook's value
    # bias correction divides v by 1 - b2^t (not Adagrad's running sum)
    decaying_v: ClassVar[bool] = True

    def _increment(self, key: str, delta: np.ndarray) -> np.ndarray:
        b1, b2, t = self.beta1, self.beta2, self.steps
        m = b1 * self.m.get(key, 0.0) + (1 - b1) * delta
        v = self._second_moment(self.v.get(key, np.zeros_like(delta)), delta * delta)
        self.m[key], self.v[key] = m, v
        if self.bias_correction:
            m = m / (1 - b1**t)
            if self.decaying_v:
                v = v / (1 - b2**t)
        return self.server_lr * m / (np.sqrt(v) + self.tau)

    def _second_moment(self, v: np.ndarray, square: np.ndarray) -> np.ndarray:
        """The next v from the last and Delta^2."""
        raise NotImplementedError


class ServerAdagrad(Adaptive):
    """v += Delta^2."""

    decaying_v = False

    def _second_moment(self, v: np.ndarray, square: np.ndarray) -> np.ndarray:
        return v + square


class ServerAdam(Adaptive):
    """v = b2 v + (1 - b2) Delta^2."""

    def _second_moment(self, v: np.ndarray, square: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1 - self.beta2) * square


class ServerYogi(Adaptive):
    """v -= (1 - b2) Delta^2 sign(v - Delta^2)."""

    def _second_moment(self, v: np.ndarray, square: np.ndarray) -> np.ndarray:
        return v - (1 - self.beta2) * square * np.sign(v - square)

"""FedAvg's server update (McMahan et al. 2017): the aggregate is the model.

https://arxiv.org/abs/1602.05629 (Algorithm 1, the server's step):

    x_{t+1} = sum_k n_k x_k / sum_k n_k

over the round's accepted replies (n_k: example counts), computed by the
aggregation step; this update casts it back to each entry's dtype (float32
weights, integer BatchNorm counters rounded).
"""

from __future__ import annotations

import numpy as np

from ..settings import Settings
from .aggregation import Aggregate, Arrays, cast_like
from .server_update import ServerUpdate, TrainedKeys


class FedAvgUpdate(ServerUpdate):
    """The next shared entries are the example-weighted mean of the clients'."""

    @classmethod
    def from_settings(cls, s: Settings) -> FedAvgUpdate:
        return cls()

    def apply(
        self, current: Arrays, aggregate: Aggregate, trained: TrainedKeys
    ) -> dict[str, np.ndarray]:
        return {key: cast_like(aggregate.arrays[key], x) for key, x in current.items()}

"""SCAFFOLD's server control variate (Karimireddy et al. 2020, Algorithm 1,
option II, https://arxiv.org/abs/1910.06378).

The server keeps c, one array per trained shared entry, zero at the start.
Every training message carries it (record `control`); a client k corrects
each local gradient by c - c_k (its local objective `scaffold`,
`pollen.task.objectives.ControlTerm`), and replies with its model and
Delta c_k = c_k^+ - c_k. After the round, with S the clients whose updates
were accepted and N = `num-clients`,

    c <- c + (1/N) sum_{k in S} Delta c_k,

so c stays the mean of all N client variates (those not sampled keep theirs).
The model itself follows from the aggregate as with any local objective
(FedAvg's weighted mean, or a FedOpt server step on it). c is server state:
checkpointed with the model, restored on resume; its bytes travel both ways
and are counted in the round's traffic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord

from ..protocol import CONTROL
from .aggregation import Arrays, ClientUpdate
from .server_update import prefixed, unprefixed

if TYPE_CHECKING:
    from torch import nn

    from ..settings import Settings
    from ..task.sharing import Sharing


class ServerControl:
    """c over the trained shared entries, and its update from the replies."""

    record_name = CONTROL

    def __init__(self, like: Arrays, num_clients: int) -> None:
        self.c = {key: np.zeros_like(value) for key, value in like.items()}
        self.num_clients = num_clients

    @classmethod
    def from_settings(
        cls, settings: Settings, model: nn.Module, sharing: Sharing
    ) -> ServerControl:
        """c at zero over the model's trained shared entries."""
        state = model.state_dict()
        trained = sharing.trained_shared(exclude_bn=False)
        like = {name: state[name].detach().cpu().numpy() for name in trained}
        return cls(like, settings.num_clients)

    def record(self) -> ArrayRecord:
        """c as the `control` record of a training message."""
        return ArrayRecord({key: Array(value) for key, value in self.c.items()})

    def expected(self) -> dict[str, Arrays]:
        """What a reply's records must hold: Delta c_k shaped like c."""
        return {CONTROL: self.c}

    def update(self, updates: Sequence[ClientUpdate]) -> None:
        """c <- c + (1/N) sum_k Delta c_k over the accepted updates, in float64."""
        self.add(
            {
                key: sum(
                    (u.records[CONTROL][key].astype(np.float64) for u in updates),
                    start=np.zeros(value.shape),
                )
                for key, value in self.c.items()
            }
        )

    def add(self, total: Arrays) -> None:
        """c <- c + total / N, given sum_k Delta c_k (a secure round's sum)."""
        for key, value in self.c.items():
            self.c[key] = (value + total[key] / self.num_clients).astype(value.dtype)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return prefixed("scaffold-c", self.c)

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        stored = unprefixed("scaffold-c", state)
        if set(stored) != set(self.c):
            raise ValueError(
                "the checkpoint holds no SCAFFOLD control variate for this model "
                "(was it written by another local objective?)"
            )
        self.c = {
            key: np.asarray(stored[key], dtype=self.c[key].dtype) for key in self.c
        }

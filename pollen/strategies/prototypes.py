"""FedProto's server half: the global prototypes, the mean of the clients'.

FedProto (Tan et al. 2022, https://arxiv.org/abs/2105.00243, "Global
Prototype Aggregation") keeps one global prototype per class j, the mean of
the prototypes the clients that hold the class report, weighed by their
examples of it:

    C_bar^(j) = sum_{i in N_j} (|D_i,j| / N_j) C_i^(j),    N_j = sum_{i in N_j} |D_i,j|

(the paper writes a further 1/|N_j| in front, which would shrink every
prototype by the number of clients; the authors' code and PFLlib average
the clients' prototypes with equal weights). A reply carries each class's
sum and count of its representations (`pollen.task.fedproto`), so C_bar^(j)
is their totals' quotient over the round's accepted replies; a class no
accepted reply holds keeps its prototype. Every training message carries
C_bar and which classes it holds (none before the first round, when the
clients train on the data loss alone). The prototypes are server state:
checkpointed with the model, restored on resume; their bytes count in the
round's traffic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from logging import WARNING
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log

from ..protocol import (
    PROTOTYPE_CENTERS,
    PROTOTYPE_COUNTS,
    PROTOTYPE_KNOWN,
    PROTOTYPE_SUMS,
    PROTOTYPES,
)
from ..task.sharing import classifier_name
from .aggregation import Arrays, ClientUpdate
from .server_update import prefixed, unprefixed

if TYPE_CHECKING:
    from torch import nn

    from ..settings import Settings
    from ..task.sharing import Sharing

STATE_PREFIX = "fedproto"


class ServerPrototypes:
    """C_bar over the classes, and its update from the replies."""

    record_name = PROTOTYPES

    def __init__(self, classes: int, width: int, local_epochs: int) -> None:
        self.centers = np.zeros((classes, width), np.float32)
        self.known = np.zeros(classes, np.float32)
        self.local_epochs = local_epochs  # a reply counts each example this often

    @classmethod
    def from_settings(
        cls, settings: Settings, model: nn.Module, sharing: Sharing
    ) -> ServerPrototypes:
        """No prototype yet, one row per output of the model's classifier,
        as wide as its input."""
        name = classifier_name(model)
        if name is None:
            raise ValueError("FedProto needs a model whose classifier is an nn.Linear")
        head = model.get_submodule(name)
        return cls(head.out_features, head.in_features, settings.local_epochs)

    def record(self) -> ArrayRecord:
        """C_bar and its known classes as a training message's record."""
        return ArrayRecord(
            {
                PROTOTYPE_CENTERS: Array(self.centers),
                PROTOTYPE_KNOWN: Array(self.known),
            }
        )

    def expected(self) -> dict[str, Arrays]:
        """What every reply must carry: per-class sums and counts."""
        return {
            PROTOTYPES: {
                PROTOTYPE_SUMS: np.zeros_like(self.centers),
                PROTOTYPE_COUNTS: np.zeros_like(self.known),
            }
        }

    def update(self, updates: Sequence[ClientUpdate]) -> None:
        """C_bar^(j) <- (sum of the replies' sums) / (sum of their counts) for
        each class some accepted reply holds, in float64; a reply's class
        with a count below 1 adds nothing, and a reply whose counts add up to
        more than its examples times the local epochs (a bad client's claim
        to weigh more) is not counted."""
        sums = np.zeros(self.centers.shape)
        counts = np.zeros(self.known.shape)
        for update in updates:
            reply = update.records[PROTOTYPES]
            claimed = float(np.clip(reply[PROTOTYPE_COUNTS], 0, None).sum())
            if claimed > update.num_examples * self.local_epochs:
                log(WARNING, "pollen: client %d's prototypes count %g examples, "
                    "more than its %g x %d epochs: not counted", update.client,
                    claimed, update.num_examples, self.local_epochs)  # fmt: skip
                continue
            held = reply[PROTOTYPE_COUNTS] >= 1
            sums[held] += reply[PROTOTYPE_SUMS][held]
            counts[held] += reply[PROTOTYPE_COUNTS][held]
        seen = counts > 0
        self.centers[seen] = (sums[seen] / counts[seen, None]).astype(np.float32)
        self.known[seen] = 1.0

    def state_arrays(self) -> dict[str, np.ndarray]:
        return prefixed(
            STATE_PREFIX,
            {PROTOTYPE_CENTERS: self.centers, PROTOTYPE_KNOWN: self.known},
        )

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        stored = unprefixed(STATE_PREFIX, state)
        if set(stored) != {PROTOTYPE_CENTERS, PROTOTYPE_KNOWN}:
            raise ValueError(
                "the checkpoint holds no FedProto prototypes "
                "(was it written by another local objective?)"
            )
        centers = np.asarray(stored[PROTOTYPE_CENTERS], np.float32)
        known = np.asarray(stored[PROTOTYPE_KNOWN], np.float32)
        if centers.shape != self.centers.shape or known.shape != self.known.shape:
            raise ValueError(
                f"the checkpoint's prototypes are {centers.shape}, this model's "
                f"{self.centers.shape}"
            )
        self.centers, self.known = centers, known

"""A Grid wrapper that sends each node one training message for its cohort.

Under `client-execution = "cohort"` the round is built and checked as
always, one message and one reply per client; this wrapper only changes
what travels: the training messages of one node go as one `train.cohort`
message, and its reply comes back as one reply per client
(`pollen.common.cohorts`). Personal evaluation's messages pass unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from ..common.cohorts import pack, unpack


class CohortGrid:
    """`grid`, with training messages packed per node and replies unpacked."""

    def __init__(self, grid: Any) -> None:
        self._grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        sent = list(messages)
        replies = self._grid.send_and_receive(pack(sent), timeout=timeout)
        return unpack(sent, replies)

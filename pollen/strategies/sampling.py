"""Which node trains which client, and which clients train in a round.

pollen's clients are data partitions (`num-clients` of them). Each SuperNode
reports its own `partition-id` and `num-partitions` (from its node config);
the `Roster` maps every client to the node that serves it:

- one node per client (deployment, or a simulation with `num-supernodes` =
  `num-clients`): node with partition-id k serves client k;
- fewer simulated nodes than clients (e.g. plain `flwr run .` with Flower's
  default federation): node j serves clients j, j + n, j + 2n, ...

Clients are sampled from a generator seeded by (seed, round), so a run with
the same settings samples the same clients whatever the node IDs are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message


class RosterError(RuntimeError):
    """The connected nodes cannot serve the configured clients."""


@dataclass(frozen=True)
class Roster:
    """client (partition) id -> node id."""

    owner: dict[int, int]

    @classmethod
    def from_nodes(cls, nodes: dict[int, tuple[int, int]], num_clients: int) -> Roster:
        """Build from {node id: (partition-id, num-partitions)} reported by nodes."""
        if not nodes:
            raise RosterError("no SuperNode answered; nothing can train")
        by_partition: dict[int, int] = {}
        for node_id, (pid, _) in sorted(nodes.items(), key=lambda kv: kv[1]):
            if pid in by_partition:
                raise RosterError(
                    f"nodes {by_partition[pid]} and {node_id} both hold partition-id "
                    f"{pid}; give every SuperNode its own partition-id"
                )
            by_partition[pid] = node_id
        reported = {n for _, n in nodes.values()}
        if reported == {num_clients} and len(by_partition) == num_clients:
            return cls(owner=by_partition)
        n = len(by_partition)
        if (
            reported == {n}
            and sorted(by_partition) == list(range(n))
            and n < num_clients
        ):
            return cls(owner={c: by_partition[c % n] for c in range(num_clients)})
        raise RosterError(
            f"{len(nodes)} nodes report partitions {sorted(by_partition)} of "
            f"{sorted(reported)}, which cannot serve num-clients={num_clients}; start "
            f"one node per client (partition-id 0..{num_clients - 1}, "
            f"num-partitions={num_clients})"
        )

    @property
    def num_nodes(self) -> int:
        return len(set(self.owner.values()))


def sample_clients(
    num_clients: int, fraction: float, seed: int, server_round: int
) -> list[int]:
    """max(1, floor(fraction * K)) distinct clients, seeded by (seed, round)."""
    count = max(1, int(fraction * num_clients + 1e-9))
    rng = np.random.default_rng([seed, server_round])
    return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))


class OneMessagePerNode:
    """A Grid wrapper that never has two messages in flight for the same node.

    When one node serves several clients, their messages go out in successive
    waves, so a node's state is never touched by two trainings at once.
    """

    def __init__(self, grid: Any) -> None:
        self._grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        pending, replies = list(messages), []
        while pending:
            wave, later, busy = [], [], set()
            for message in pending:
                node = message.metadata.dst_node_id
                (later if node in busy else wave).append(message)
                busy.add(node)
            replies.extend(self._grid.send_and_receive(wave, timeout=timeout))
            pending = later
        return replies

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

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message

from ..flower_waits import PollClock
from ..settings import sample_size


class RosterError(RuntimeError):
    """The connected nodes cannot serve the configured clients."""


@dataclass(frozen=True)
class Roster:
    """client (partition) id -> node id."""

    owner: dict[int, int]

    @classmethod
    def from_nodes(cls, nodes: dict[int, tuple[int, int]], num_clients: int) -> Roster:
        """Build from {node id: (partition-id, num-partitions)} reported by nodes.

        With one node per client, clients whose node is not (yet) connected
        are simply absent; they are served when their node joins (`joined`).
        """
        if not nodes:
            raise RosterError("no SuperNode answered; nothing can train")
        by_partition: dict[int, int] = {}
        for node_id, (pid, count) in sorted(nodes.items(), key=lambda kv: kv[1]):
            if not 0 <= pid < count:
                raise RosterError(
                    f"node {node_id} reports partition-id {pid} of num-partitions "
                    f"{count}; a partition-id must be in 0..num-partitions - 1"
                )
            if pid in by_partition:
                raise RosterError(
                    f"nodes {by_partition[pid]} and {node_id} both hold partition-id "
                    f"{pid}; give every SuperNode its own partition-id"
                )
            by_partition[pid] = node_id
        reported = {n for _, n in nodes.values()}
        if reported == {num_clients}:
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

    def joined(
        self,
        connected: Iterable[int],
        new: dict[int, tuple[int, int]],
        num_clients: int,
    ) -> tuple[Roster, list[str]]:
        """The roster after nodes left (not in `connected`) and `new` nodes
        joined, with a note for each new node that cannot serve a client.

        A new node takes over its partition when the node that held it has
        left (a restarted SuperNode without a registered key gets a new ID);
        while that node is still connected, the newcomer is not used.
        """
        connected = set(connected)
        owner = {c: n for c, n in self.owner.items() if n in connected}
        notes = []
        for node_id, (pid, count) in sorted(new.items()):
            if count != num_clients or not 0 <= pid < count:
                notes.append(
                    f"node {node_id} reports partition-id {pid} of {count}; this run "
                    f"has num-clients={num_clients}: not used"
                )
            elif pid in owner:
                notes.append(
                    f"node {node_id} also holds partition-id {pid}, served by node "
                    f"{owner[pid]}: not used while that node is connected"
                )
            else:
                owner[pid] = node_id
        return Roster(owner=dict(sorted(owner.items()))), notes

    @property
    def num_nodes(self) -> int:
        return len(set(self.owner.values()))


@dataclass(frozen=True)
class Participants:
    """Who can take part in a round, as the server loop knows it before the
    round starts: the roster, the most examples each client may claim
    (its shard's size, or what an own-data node reported), and a failure
    line for each connected node that does not answer (its clients are not
    in the roster; the round records the lines)."""

    roster: Roster
    max_examples: Mapping[int, int] = field(default_factory=dict)
    unreachable: tuple[str, ...] = ()


def sample_clients(
    num_clients: int,
    fraction: float,
    seed: int,
    server_round: int,
    available: Sequence[int] | None = None,
    minimum: int = 1,
) -> list[int]:
    """max(minimum, floor(fraction * K)) distinct clients, seeded by (seed, round).

    Drawn from `available` (the clients whose node is connected; all K when
    None), and never more than there are. With every client available the
    draw is the same as from range(K), so simulations do not depend on it.
    """
    pool = np.arange(num_clients) if available is None else np.asarray(available)
    count = min(sample_size(num_clients, fraction, minimum), len(pool))
    if count == 0:
        return []
    rng = np.random.default_rng([seed, server_round])
    return sorted(int(c) for c in rng.choice(pool, size=count, replace=False))


# A deployed grid's pull is an HTTP request that costs the SuperLink about
# 9 ms of CPU (2 cores, docs/lab-notes/deployment.md): asked every 0.01 s, the two
# processes took most of a core from the nodes' training. A deployed server
# asks `poll_seconds` after a message went out or a reply came in, then every
# 5 % of the time since, at most every 0.5 s. A simulation's grid is a dict.
DEPLOYED_REPLY_SHARE = 0.05
LONGEST_REPLY_POLL = 0.5


def reply_clock(poll_seconds: float, simulation: bool) -> PollClock:
    """When a server asks its grid for replies again (`PollClock.sleep`
    with `LONGEST_REPLY_POLL`): every `poll_seconds` in a simulation, paced
    by `DEPLOYED_REPLY_SHARE` in a deployment."""
    return PollClock(poll_seconds, 0.0 if simulation else DEPLOYED_REPLY_SHARE)


class OneMessagePerNode:
    """A Grid wrapper that never has two messages in flight for the same node.

    When one node serves several clients, its messages wait in a queue of
    its own: the next goes out as soon as the node answers the one before,
    so a node's state is never touched by two trainings at once and no node
    waits for another's stragglers. The timeout bounds the whole call, as it
    does for Flower's grid. A node that did not answer within it may still
    be busy (a simulation runs the message all the same), so it is sent
    nothing more until it answers, in this call or a later one; meanwhile
    its clients count as not answered, and that late reply is dropped.
    """

    def __init__(self, grid: Any, clock: PollClock | None = None) -> None:
        self._grid = grid
        self.clock = clock or PollClock(0.05)
        self._unanswered: dict[str, int] = {}  # earlier calls' messages: id -> node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Push every free node's first message, then each node's next one as
        its reply comes in; pull replies as `clock` says (`reply_clock`), at
        most `LONGEST_REPLY_POLL` s apart (Flower's own `send_and_receive`
        sleeps 3 s between pulls in a deployment, which would round every
        round's time up to a multiple of 3 s).

        The grid is asked until one pull starts at or after the deadline,
        and whatever a pull returns is taken: a reply that reached the
        SuperLink in time is never late, even when the pull before took past
        the deadline (Flower retrying a killed node's half-pushed reply can
        hold one for a minute). After the deadline nothing more is pushed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        queues: dict[int, deque[Message]] = {}
        for message in messages:
            queues.setdefault(message.metadata.dst_node_id, deque()).append(message)
        earlier = self._unanswered
        in_flight: dict[str, int] = {}  # this call's messages: id -> node
        replies: list[Message] = []
        busy = set(earlier.values())
        ready = [n for n in queues if n not in busy]
        while True:
            if deadline is None or time.monotonic() < deadline:
                nexts = [queues[n].popleft() for n in ready if queues.get(n)]
                self._push(nexts, in_flight)
            holding = [i for i, n in earlier.items() if queues.get(n)]
            if not in_flight and not holding:
                break
            asked = time.monotonic()
            got = list(self._grid.pull_messages([*in_flight, *earlier]))
            ready = []
            for reply in got:
                message_id = reply.metadata.reply_to_message_id
                if (node := in_flight.pop(message_id, None)) is not None:
                    replies.append(reply)
                    ready.append(node)
                elif (node := earlier.pop(message_id, None)) is not None:
                    ready.append(node)  # free again; its reply is too late
            if deadline is not None and asked >= deadline:
                break
            if got:
                self.clock.message_seen()
            else:
                left = math.inf if deadline is None else deadline - time.monotonic()
                self.clock.sleep(max(0.0, min(LONGEST_REPLY_POLL, left)))
        earlier.update(in_flight)
        return replies

    def _push(self, messages: list[Message], in_flight: dict[str, int]) -> None:
        """Push `messages`; note those the grid took. Flower's grids set each
        message's ID as they push it and leave a message they could not
        store out of the IDs they return (or return none): its client counts
        as not answered, as a node's silence does."""
        if not messages:
            return
        pushed = {i for i in self._grid.push_messages(messages) if i}
        self.clock.message_seen()
        for message in messages:
            if message.metadata.message_id in pushed:
                in_flight[message.metadata.message_id] = message.metadata.dst_node_id

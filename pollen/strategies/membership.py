"""Which SuperNodes are connected, and which client each serves, round by round.

In a deployment nodes come and go: a SuperNode is killed, a machine
reboots, a restarted node rejoins (with the same node ID when its key is
registered, with a new one otherwise). Before every round the ServerApp
asks the SuperLink which nodes are connected, waits a bounded time
(`node-wait`) for `min-available-nodes` of them, asks each node it has not
met (or that left and came back) which partition it holds, and updates the
`Roster`: clients of nodes that left are not sampled, a node that joins
serves its partition from then on.

A node's answer is waited for `node-wait` s (at least `LEAST_ANSWER_WAIT`:
a first answer may decode a data set) from when it was asked, and no
longer: a node the SuperLink lists as connected but that does not answer
(a SuperNode stuck on a message of a run that ended with a restarted
SuperLink, say) would otherwise hold every round. Its question stays
asked: its answer is taken whenever it comes, and until then each round
records it as a failure (`Participants.unreachable`) and its clients are not
sampled.

A node's answer also says how many training examples it holds for its
client and whether they are its own data file rather than a shard of the
shared data set: for such a node that count bounds the examples its
replies may claim (the server cannot compute its shard).

A simulation's nodes are asked nothing: they share the server's data set
and machine, hold no data of their own, and never come or go, so node i of
their sorted IDs serves clients i, i + n, i + 2n, ... for the whole run.
Start-up then costs two lookups of the node IDs 0.05 s apart (until they
agree: Flower may still be registering the nodes), whatever the number of
clients (the query took 12-20 s for 1,000 nodes, docs/lab-notes/performance.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..protocol import (
    CLIENT,
    CONFIG,
    NODE_RECORD,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    OWN_DATA,
    SHARD_FINGERPRINT,
)
from .sampling import Participants, Roster, RosterError


@dataclass(frozen=True)
class Question:
    """The query a node was sent: its message ID and when (`time.monotonic()`)."""

    message_id: str
    asked_at: float


LEAST_ANSWER_WAIT = 30.0  # s for a node's answer, however short node-wait is
POLL_SECONDS = 1.0  # while waiting for min-available-nodes
ANSWER_POLL_SECONDS = 0.2  # while waiting for the nodes' answers
SETTLE_SECONDS = 0.05  # a simulation's nodes are registered in one burst


@dataclass(frozen=True)
class NodeReport:
    """A node's answer to the server's query."""

    partition_id: int
    num_partitions: int
    num_examples: int
    own_data: bool
    shard_fingerprint: str = ""  # absent from an older node's answer

    @classmethod
    def parse(cls, msg: Message) -> NodeReport:
        """The report in `msg`, or ValueError saying what is wrong with it."""
        info = msg.content.get(NODE_RECORD) if msg.content else None
        if not isinstance(info, ConfigRecord):
            raise ValueError(f"no {NODE_RECORD!r} config record")
        values = {}
        for key, kind in ((CLIENT, int), (NUM_PARTITIONS, int),
                          (NUM_EXAMPLES, int), (OWN_DATA, bool)):  # fmt: skip
            value = info.get(key)
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key!r} is {value!r}, not an integer")
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{key!r} is {value!r}, not true or false")
            values[key] = value
        if values[NUM_EXAMPLES] < 0:
            raise ValueError(f"{NUM_EXAMPLES!r} is {values[NUM_EXAMPLES]}, below 0")
        fingerprint = info.get(SHARD_FINGERPRINT, "")
        if not isinstance(fingerprint, str):
            raise ValueError(f"{SHARD_FINGERPRINT!r} is {fingerprint!r}, not text")
        return cls(*values.values(), fingerprint)


class Membership:
    """The run's view of its nodes; `refresh` before every round."""

    def __init__(
        self,
        grid: Grid,
        num_clients: int,
        config: ConfigRecord,
        *,
        min_available: int = 1,
        wait: float = 120.0,
        shards: dict[int, tuple[int, str]] | None = None,
        simulated: bool = False,
    ) -> None:
        self.grid = grid
        self.num_clients = num_clients
        self.config = config
        self.min_available = min_available
        self.wait = wait
        self.shards = shards or {}  # client -> (size, fingerprint) the server computed
        self.roster: Roster | None = None
        self.own_examples: dict[int, int] = {}  # client -> examples of its own data
        self.simulated = simulated
        self._met: set[int] = set()
        self._asked: dict[int, Question] = {}  # node -> its unanswered query

    def connected(self) -> set[int]:
        """The connected node IDs once there are `min_available`, waiting at
        most `wait` s for them (RosterError after that)."""
        deadline = time.monotonic() + self.wait
        while len(nodes := set(self.grid.get_node_ids())) < self.min_available:
            if time.monotonic() >= deadline:
                raise RosterError(
                    f"{len(nodes)} SuperNode(s) connected after waiting "
                    f"{self.wait:.0f} s (node-wait); min-available-nodes is "
                    f"{self.min_available}: start more SuperNodes or lower "
                    "min-available-nodes"
                )
            time.sleep(POLL_SECONDS)
        return nodes

    def participants(self) -> Participants:
        """Who can take part in the next round: the refreshed roster, and the
        most examples each client may claim (its shard's size, or what its
        own-data node reported)."""
        roster = self.refresh()
        sizes = {client: size for client, (size, _) in self.shards.items()}
        return Participants(roster, {**sizes, **self.own_examples}, self.unreachable())

    def unreachable(self) -> tuple[str, ...]:
        """A failure line for each connected node whose answer is past due."""
        now = time.monotonic()
        return tuple(
            f"node {node}: connected, but no answer to pollen's query for "
            f"{now - question.asked_at:.0f} s (node-wait); its clients are not "
            "sampled until it answers"
            for node, question in sorted(self._asked.items())
            if self._past_due(question, now)
        )

    def _past_due(self, question: Question, now: float) -> bool:
        return now - question.asked_at >= self.answer_wait

    @property
    def answer_wait(self) -> float:
        """How long a node's answer is waited for (see module docstring)."""
        return max(self.wait, LEAST_ANSWER_WAIT)

    def refresh(self) -> Roster:
        """The roster for the next round (see module docstring)."""
        if self.simulated:
            return self._simulated_roster()
        nodes = self.connected()
        left = self._met - nodes
        self._met &= nodes
        # a node that left is asked again when it is back
        self._asked = {n: q for n, q in self._asked.items() if n in nodes}
        self._ask(sorted(nodes - self._met - set(self._asked)))
        reports = self._answers()
        self._met |= set(reports)
        pairs = {n: (r.partition_id, r.num_partitions) for n, r in reports.items()}
        if self.roster is None:
            self.roster = Roster.from_nodes(pairs, self.num_clients)
        else:
            self.roster, notes = self.roster.joined(nodes, pairs, self.num_clients)
            for note in notes:
                log(WARNING, "pollen: %s", note)
        if left:
            log(WARNING, "pollen: node(s) %s left; their clients are not sampled "
                "until they rejoin", sorted(left))  # fmt: skip
        self._note_examples(reports)
        return self.roster

    def _simulated_roster(self) -> Roster:
        """A simulation's fixed placement: the k-th of the sorted node IDs
        serves clients k, k + n, ... (see module docstring); nodes beyond
        `num-clients` serve none."""
        if self.roster is None:
            nodes = sorted(self._settled())[: self.num_clients]
            self.roster = Roster.from_nodes(
                {node: (k, len(nodes)) for k, node in enumerate(nodes)},
                self.num_clients,
            )
        return self.roster

    def _settled(self) -> set[int]:
        """The connected nodes, read until two reads `SETTLE_SECONDS` apart
        agree: Flower's simulation starts the ServerApp's thread before it
        registers the nodes, and the placement, fixed for the run, must not
        be made from some of them."""
        nodes = self.connected()
        while True:
            time.sleep(SETTLE_SECONDS)
            if (again := set(self.grid.get_node_ids())) == nodes:
                return nodes
            nodes = again

    def _ask(self, node_ids: list[int]) -> None:
        """Send each of `node_ids` the query; a query the grid did not take
        is sent again at the next refresh."""
        if not node_ids:
            return
        queries = [
            Message(
                RecordDict({CONFIG: self.config}),
                message_type=MessageType.QUERY,
                dst_node_id=n,
            )
            for n in node_ids
        ]
        taken = {i for i in self.grid.push_messages(queries) if i}
        now = time.monotonic()
        for query in queries:
            if query.metadata.message_id in taken:
                self._asked[query.metadata.dst_node_id] = Question(
                    query.metadata.message_id, now
                )

    def _answers(self) -> dict[int, NodeReport]:
        """The usable answers to the queries asked, waiting until each has
        one or is past due; an unusable answer is logged and its node not
        used (it is asked again at the next refresh)."""
        reports: dict[int, NodeReport] = {}
        while self._asked:
            nodes = {q.message_id: n for n, q in self._asked.items()}
            for reply in self.grid.pull_messages(list(nodes)):
                node = nodes.get(reply.metadata.reply_to_message_id)
                if node is None or self._asked.pop(node, None) is None:
                    continue
                try:
                    if reply.has_error():
                        raise ValueError(reply.error.reason)
                    reports[node] = NodeReport.parse(reply)
                except ValueError as problem:
                    log(WARNING, "pollen: node %d is not used: its answer to the "
                        "query is unusable: %s", node, problem)  # fmt: skip
            now = time.monotonic()
            if all(self._past_due(q, now) for q in self._asked.values()):
                break
            time.sleep(ANSWER_POLL_SECONDS)
        if self.roster is not None and reports:
            log(INFO, "pollen: node(s) %s joined", sorted(reports))
        return reports

    def _note_examples(self, reports: dict[int, NodeReport]) -> None:
        """Record own-data nodes' example counts; warn when a node's shard of
        the shared data set is not the one the server computed (other size,
        or other labels in it: a copy of the data set ordered otherwise)."""
        assert self.roster is not None
        for node, report in reports.items():
            client = report.partition_id
            if self.roster.owner.get(client) != node:
                continue
            if report.own_data:
                self.own_examples[client] = report.num_examples
                continue
            if client not in self.shards or report.num_partitions != self.num_clients:
                continue
            size, fingerprint = self.shards[client]
            if report.num_examples != size:
                log(WARNING, "pollen: node %d holds %d examples for client %d, the "
                    "server's partition gives it %d: is its data set the same "
                    "file?", node, report.num_examples, client, size)  # fmt: skip
            elif report.shard_fingerprint not in ("", fingerprint):
                log(WARNING, "pollen: node %d's shard for client %d holds other "
                    "examples than the server's partition gives it: its copy of "
                    "the data set differs (another file, or the same images in "
                    "another order)", node, client)  # fmt: skip

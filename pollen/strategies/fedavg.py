"""FedAvg (McMahan et al. 2017) on Flower's message API, made reproducible.

Differences from `flwr.serverapp.strategy.FedAvg`, all for exact, comparable runs:

- clients (data partitions) are sampled by a generator seeded with
  (seed, round) among those whose node is connected, and routed through a
  `Roster`, instead of `random.sample` over node IDs that change from run
  to run; the server keeps the roster current as nodes leave and join;
- only the entries the sharing policy lets travel are sent and accepted;
- every reply is checked (`replies.checked_reply`: its client, entries,
  dtypes, finite values, example count, metrics); one that fails is dropped
  and logged, as is every sampled client whose node sent no reply in time,
  and the round goes on with the others; with fewer than
  `min_replies` left the round is skipped and the model stays as it was;
- optionally an update whose norm exceeds `norm_bound` x the round's median
  is clipped or dropped;
- replies are aggregated in client order, so float sums do not depend on the
  order in which replies arrive;
- every entry keeps its dtype (float32 weights, integer BatchNorm counters);
- bytes sent and received per round are counted from the records themselves;
- with entries kept on the clients (FedBN, SiloBN, FedSA), every client that
  has trained evaluates its own model each `personal_eval_every` rounds;
- under DP-SGD, the largest epsilon any client has reported is recorded;
- the server-side state a checkpoint must keep is exported and restored as
  plain arrays (`state_arrays`, `load_state_arrays`).

Subclasses change one thing, `update`: how the shared entries of the next
global model follow from the current ones and the clients' replies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from .aggregate import Arrays, weighted_average
from .replies import (
    CLIENT_KEY,
    PERSONAL_METRICS,
    Expectation,
    ReplyError,
    bound_update_norms,
    checked_personal_reply,
    checked_reply,
)
from .sampling import Roster, sample_clients
from .sharing import Sharing


@dataclass
class RoundTraffic:
    """What one round moved, and who took part."""

    clients: list[int] = field(default_factory=list)
    evaluating: list[int] = field(default_factory=list)  # asked for personal metrics
    bytes_down: int = 0
    bytes_up: int = 0
    eval_bytes: int = 0
    failures: list[str] = field(default_factory=list)  # replies dropped, and why
    clipped: list[str] = field(default_factory=list)  # updates scaled back
    skipped: bool = False  # too few valid replies: the model was not updated
    dp_epsilon: float | None = None


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: record[key].numpy() for key in record}


def prefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` under `prefix/` names, to share one flat checkpoint namespace."""
    return {f"{prefix}/{key}": value for key, value in arrays.items()}


def unprefixed(prefix: str, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The entries of `state` saved by `prefixed(prefix, ...)`."""
    start = f"{prefix}/"
    return {k.removeprefix(start): v for k, v in state.items() if k.startswith(start)}


class FedAvg(FlowerFedAvg):
    """Weighted FedAvg over seeded client samples (see module docstring)."""

    def __init__(
        self,
        *,
        roster: Roster,
        num_clients: int,
        client_frac: float,
        seed: int,
        sharing: Sharing | None = None,
        personal_eval_every: int = 0,
        max_examples: Mapping[int, int] | None = None,
        min_replies: int = 1,
        min_train_nodes: int = 1,
        norm_bound: float = 0.0,
        norm_action: str = "clip",
    ) -> None:
        super().__init__(
            fraction_train=client_frac,
            fraction_evaluate=0.0,  # the ServerApp evaluates the global model itself
            min_train_nodes=min_train_nodes,
            min_available_nodes=1,  # waited for by the ServerApp, bounded in time
        )
        self.roster = roster
        self.num_clients = num_clients
        self.seed = seed
        self.sharing = sharing
        self.personal_eval_every = personal_eval_every
        self.max_examples = dict(max_examples or {})
        self.min_replies = min_replies
        self.norm_bound = norm_bound
        self.norm_action = norm_action
        self.traffic: dict[int, RoundTraffic] = {}
        self.personal: dict[int, dict[int, dict[str, float]]] = {}
        self.trained_clients: set[int] = set()
        self.dp_epsilon: dict[int, float] = {}
        self._global: dict[str, np.ndarray] = {}

    # ---- checkpointed state ---------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Server state beyond the global model that a resumed run needs."""
        return {"trained-clients": np.array(sorted(self.trained_clients), np.int64)}

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_arrays` returned."""
        self.trained_clients = {int(c) for c in state["trained-clients"]}

    # ---- what travels -------------------------------------------------------

    def shared_keys(self, arrays: Mapping[str, object]) -> tuple[str, ...]:
        """Entries that travel (all of them without a sharing policy)."""
        return self.sharing.shared if self.sharing else tuple(arrays)

    def trained_keys(self, exclude_bn: bool = False) -> tuple[str, ...]:
        """Shared entries a server optimiser or correction may change."""
        if self.sharing:
            return self.sharing.trained_shared(exclude_bn)
        return tuple(
            k for k, v in self._global.items() if np.issubdtype(v.dtype, np.floating)
        )

    def outgoing(self, arrays: ArrayRecord) -> ArrayRecord:
        """The entries sent to clients: the shared ones."""
        return ArrayRecord({key: arrays[key] for key in self.shared_keys(arrays)})

    def _messages(
        self,
        kind: str,
        clients: list[int],
        payload: ArrayRecord,
        config: Mapping,
        server_round: int,
    ) -> list[Message]:
        messages = []
        for client in clients:
            client_config = ConfigRecord(
                {**config, "server-round": server_round, CLIENT_KEY: client}
            )
            content = RecordDict(
                {self.arrayrecord_key: payload, self.configrecord_key: client_config}
            )
            messages.append(
                Message(
                    content=content,
                    message_type=kind,
                    dst_node_id=self.roster.owner[client],
                )
            )
        return messages

    # ---- training -------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled client, addressed to the node that serves it."""
        self._global = to_numpy(arrays)
        clients = sample_clients(
            self.num_clients, self.fraction_train, self.seed, server_round,
            available=sorted(self.roster.owner), minimum=self.min_train_nodes,
        )  # fmt: skip
        payload = self.outgoing(arrays)
        self.traffic[server_round] = RoundTraffic(
            clients=clients, bytes_down=payload.count_bytes() * len(clients)
        )
        return self._messages(MessageType.TRAIN, clients, payload, config, server_round)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The next global model from the valid replies, taken in client order
        (None when too few are valid: the round is skipped)."""
        valid, failed = self._check_and_log_replies(
            replies, is_train=True, validate=False
        )
        traffic = self.traffic.setdefault(server_round, RoundTraffic())
        traffic.failures = self._failures(traffic.clients, valid, failed)
        shared = self.shared_keys(self._global)
        current = {key: self._global[key] for key in shared}
        accepted = self._accepted(valid, current, traffic)
        if len(accepted) < self.min_replies:
            traffic.skipped = True
            log(WARNING, "pollen: round %d skipped, the model is unchanged: %d valid "
                "replies, min-train-replies is %d", server_round, len(accepted),
                self.min_replies)  # fmt: skip
            return None, None
        self.trained_clients.update(client for client, _, _ in accepted)
        self._record_privacy(traffic, accepted)
        new_shared = self.update(
            current,
            [arrays for _, _, arrays in accepted],
            [float(m[self.weighted_by_key]) for _, m, _ in accepted],
        )
        merged = {**self._global, **new_shared}
        metrics = self.train_metrics_aggr_fn(
            [RecordDict({"metrics": m}) for _, m, _ in accepted], self.weighted_by_key
        )
        return ArrayRecord({k: Array(v) for k, v in merged.items()}), metrics

    def _failures(
        self, clients: list[int], valid: list[Message], failed: list[Message]
    ) -> list[str]:
        """One line per error reply, and one per node that answered fewer of
        its sampled clients' messages than it was sent.

        Flower's error reply for a node it has lost ("Node Unavailable") does
        not name that node as its source, so such an error is told as the
        reason of the nodes that went silent; without one they timed out."""
        nodes = set(self.roster.owner.values())
        lines = [f"node {m.metadata.src_node_id}: {m.error.reason}"
                 for m in failed if m.metadata.src_node_id in nodes]  # fmt: skip
        unattributed = sorted(
            {m.error.reason for m in failed if m.metadata.src_node_id not in nodes}
        )
        why = (
            ": " + "; ".join(unattributed) if unattributed else " within round-timeout"
        )
        sent: dict[int, list[int]] = {}
        for client in clients:
            sent.setdefault(self.roster.owner[client], []).append(client)
        answered: dict[int, int] = {}
        for msg in [*valid, *failed]:
            node = msg.metadata.src_node_id
            answered[node] = answered.get(node, 0) + 1
        for node, served in sent.items():
            missing = len(served) - answered.get(node, 0)
            if missing > 0:
                lines.append(
                    f"node {node}: no reply for {missing} of clients {served}{why}"
                )
                log(WARNING, "pollen: %s", lines[-1])
        return lines

    def _accepted(
        self, replies: list[Message], current: Arrays, traffic: RoundTraffic
    ) -> list[tuple[int, MetricRecord, Arrays]]:
        """The replies that pass every check against the `current` shared
        entries (and the norm bound), in client order: each client, its
        checked metrics and its decoded entries."""
        expected = Expectation(
            arrays=current,
            owner=self.roster.owner,
            sampled=frozenset(traffic.clients),
            max_examples=self.max_examples,
            weight_key=self.weighted_by_key,
        )
        accepted: list[tuple[int, MetricRecord, Arrays]] = []
        seen: set[int] = set()
        for msg in replies:
            arrays = msg.content.get(self.arrayrecord_key)
            if isinstance(arrays, ArrayRecord):
                traffic.bytes_up += arrays.count_bytes()
            try:
                client, metrics, decoded = checked_reply(msg, expected, seen)
            except ReplyError as problem:
                self._reject(traffic, msg.metadata.src_node_id, str(problem))
                continue
            seen.add(client)
            accepted.append((client, metrics, decoded))
        accepted.sort(key=lambda item: item[0])
        if not self.norm_bound or not accepted:
            return accepted
        bounded = bound_update_norms(
            current, [a for _, _, a in accepted], self.norm_bound, self.norm_action
        )
        kept = []
        for (client, metrics, _), (arrays, note) in zip(accepted, bounded, strict=True):
            node = self.roster.owner[client]
            if arrays is None:
                self._reject(traffic, node, f"client {client}: {note}")
                continue
            if note:
                traffic.clipped.append(f"node {node}: client {client}: {note}")
                log(WARNING, "pollen: clipped update: client %d: %s", client, note)
            kept.append((client, metrics, arrays))
        return kept

    @staticmethod
    def _reject(traffic: RoundTraffic, node: int, problem: str, what: str = "") -> None:
        traffic.failures.append(f"{what}node {node}: {problem}")
        log(WARNING, "pollen: rejected %sreply from node %d: %s", what, node, problem)

    def _record_privacy(
        self, traffic: RoundTraffic, accepted: list[tuple[int, MetricRecord, Arrays]]
    ) -> None:
        """Keep each client's reported epsilon; the round records the largest."""
        for client, metrics, _ in accepted:
            epsilon = metrics.get("dp-epsilon")
            if isinstance(epsilon, float):
                self.dp_epsilon[client] = epsilon
        if self.dp_epsilon:
            traffic.dp_epsilon = max(self.dp_epsilon.values())

    def update(
        self, current: Arrays, updates: list[Arrays], weights: list[float]
    ) -> dict[str, np.ndarray]:
        """The next shared entries: the example-weighted average of the clients'."""
        return weighted_average(updates, weights)

    # ---- personalised evaluation ----------------------------------------------

    def evaluates_personal(self, server_round: int) -> bool:
        """Whether clients evaluate their own models after this round."""
        return bool(
            self.personal_eval_every
            and self.sharing is not None
            and self.sharing.local
            and server_round % self.personal_eval_every == 0
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Every client that has trained evaluates shared + its own local entries."""
        if not self.evaluates_personal(server_round):
            return []
        payload = self.outgoing(arrays)
        clients = sorted(self.trained_clients & set(self.roster.owner))
        traffic = self.traffic.setdefault(server_round, RoundTraffic())
        traffic.eval_bytes += payload.count_bytes() * len(clients)
        traffic.evaluating = clients
        return self._messages(
            MessageType.EVALUATE, clients, payload, config, server_round
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Keep each client's accuracies and losses (replies checked like
        training ones, a bad one dropped with its reason); return their means."""
        valid, failed = self._check_and_log_replies(
            replies, is_train=False, validate=False
        )
        traffic = self.traffic.setdefault(server_round, RoundTraffic())
        traffic.failures += [
            f"evaluate, node {m.metadata.src_node_id}: {m.error.reason}" for m in failed
        ]
        per_client: dict[int, dict[str, float]] = {}
        for msg in valid:
            try:
                client, values = checked_personal_reply(
                    msg, self.roster.owner, traffic.evaluating, set(per_client)
                )
            except ReplyError as problem:
                node = msg.metadata.src_node_id
                self._reject(traffic, node, str(problem), what="evaluate, ")
                continue
            per_client[client] = values
        if not per_client:
            return None
        self.personal[server_round] = dict(sorted(per_client.items()))
        means = {
            k: float(np.nanmean([v[k] for v in per_client.values()]))
            for k in PERSONAL_METRICS
        }
        return MetricRecord({k: v for k, v in means.items() if np.isfinite(v)})

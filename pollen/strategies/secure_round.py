"""A round's training half under SecAgg+: the server learns only the sum.

`play_round` hands a round to `SecureAggregation.train` when the run sets
`secure-aggregation = "secagg+"`. Between sampling (`configure_train`) and
the server update (`Strategy.step`) the protocol runs four Message-API
exchanges with the sampled clients (`pollen.task.secagg_client` answers):

1. keys: each client advertises two public keys and a commitment to its seed;
2. shares: each gets its neighbours' keys (SecAgg+'s ring graph,
   `pollen.common.secagg.ring_neighbours`) and returns its secrets' Shamir
   shares, encrypted per neighbour, which the server only relays;
3. training: the round's training message, with the shares relayed to the
   client; the reply holds one masked, quantised vector instead of entries;
4. unmask: the survivors reveal the shares that remove the masks
   (`pollen.strategies.unmask`).

Stages 1 and 2 of round t+1 need nothing from round t, so when every client
that round t+1 will sample (the draw is known ahead: `Strategy.sampled`)
trains in round t, they ride on round t's stages 3 and 4: the training
message asks for round t+1's keys, the unmask message relays them and asks
for round t+1's shares. Round t+1 then starts at its training exchange: two
exchanges a round instead of four, each exchange a deployed round's fixed
cost. Round t+1 uses what was set up ahead only when every one of its
clients shared; otherwise (a client dropped in round t, the roster changed)
it runs stages 1 and 2 itself, so who takes part is as without the overlap.

The sum then gives the weighted mean of the clients' shared entries,

    x_bar = x + (S / sum_k n_k) * sum_k (n_k / S) (x_k - x),

with S the largest shard of the round (uniform means use weight 1), and
SCAFFOLD's sum of Delta c_k; the server update steps from that mean as it
steps from a plain one. A client that fails any stage drops out; the round
goes on while every survivor's secrets can be rebuilt from `threshold` of
their holders and at least `min_updates` vectors arrived, and is skipped
otherwise (said in its failures). Bytes and seconds per stage, the
survivors, the clipped entries and the bound on the quantisation error of
the mean go into the history (the round's `aggregation` columns).

Compared with Flower's `SecAggPlusWorkflow` (its legacy API): the same
primitives and stages, run inside pollen's round for any server update that
consumes a weighted mean; the update quantised is the change from the
global model, not the model, so the clipping range bounds a step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..common import secagg
from ..protocol import (
    CLIENT,
    CONFIG,
    MASKED,
    METRICS,
    SECAGG,
    SECAGG_KEYS,
    SECAGG_NEXT,
    SECAGG_SHARES,
    SECAGG_UNMASK,
    SERVER_ROUND,
)
from ..settings import Settings
from .aggregation import Aggregate, ClientUpdate
from .replies import ReplyError, named_client, reply_failures
from .strategy import Strategy, TrainOutcome, TrainRequest, rejected
from .unmask import Committed, Revealed, UnmaskError, unmasked_sum

TAIL = 2  # integers after the quantised values: the example weight, clipped


Shares = dict[int, tuple[int, dict[int, bytes]]]  # client -> threshold, holder -> ct


@dataclass
class Stages:
    """What the protocol's exchanges cost and dropped, stage by stage."""

    seconds: dict[str, float] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    set_up_ahead: bool = False  # stages 1 and 2 ran in the round before

    def report(self) -> dict[str, float]:
        out = {"secagg-set-up-ahead": float(self.set_up_ahead)}
        for stage, seconds in self.seconds.items():
            out[f"secagg-{stage}-seconds"] = round(seconds, 4)
            if stage in self.bytes_down:  # an exchange (not the server's compute)
                out[f"secagg-{stage}-bytes-down"] = self.bytes_down[stage]
                out[f"secagg-{stage}-bytes-up"] = self.bytes_up[stage]
        return out


@dataclass(frozen=True)
class Plan:
    """A round's clients numbered 1..n in order, and SecAgg+'s ring graph."""

    clients: list[int]
    ids: dict[int, int]  # client -> its number in the protocol
    client_of: dict[int, int]
    graph: dict[int, list[int]]  # number -> its neighbours' numbers

    @classmethod
    def of(cls, clients: list[int], neighbours: float) -> Plan:
        ids = {client: i for i, client in enumerate(clients, start=1)}
        return cls(
            clients,
            ids,
            {i: client for client, i in ids.items()},
            secagg.ring_neighbours(len(clients), neighbours),
        )


@dataclass(frozen=True)
class SetUp:
    """A round's stages 1 and 2 as the server holds them: each client's
    advertised keys and, for each that shared, its threshold and ciphertexts;
    with the node that served each client (a restarted node has new keys)."""

    owners: dict[int, int]  # client -> node, in the round's client order
    keys: dict[int, ConfigRecord]
    shared: Shares


@dataclass
class SecureAggregation:
    """SecAgg+ for a strategy whose aggregation step is the (weighted) mean.

    With `ahead`, a round before `last_round` sets up the next one's keys and
    shares in its own exchanges (the module's docstring). What it set up
    waits in `ready` until that round starts: the one state kept from round
    to round (in memory: a resumed run's first round sets itself up)."""

    params: secagg.SecAggParams
    seed: int
    uniform: bool  # every client weighs 1 (FedDyn's mean)
    last_round: int = 1  # (1: no round is set up ahead)
    ahead: bool = True
    ready: dict[int, SetUp] = field(default_factory=dict, repr=False)

    @classmethod
    def from_settings(cls, s: Settings, uniform: bool) -> SecureAggregation:
        params = secagg.SecAggParams(
            s.secagg_threshold, s.secagg_neighbours, s.secagg_clip, s.secagg_bits
        )
        return cls(params, s.seed, uniform, s.rounds, s.secagg_ahead)

    def train(
        self, grid: Grid, strategy: Strategy, request: TrainRequest, timeout: float
    ) -> TrainOutcome:
        """The round's training half: the four stages, then the mean's step
        (or a skipped outcome naming why)."""
        run = _SecureRun(self, grid, strategy, request, timeout)
        return run.play()


class _SecureRun:
    """One round of the protocol (its state lives only for that round)."""

    def __init__(
        self,
        options: SecureAggregation,
        grid: Grid,
        strategy: Strategy,
        request: TrainRequest,
        timeout: float,
    ) -> None:
        self.options, self.grid, self.strategy = options, grid, strategy
        self.request, self.timeout = request, timeout
        self.plan = Plan.of(request.clients, options.params.neighbours)
        self.stages = Stages()
        current = request.current
        # every floating shared entry (BatchNorm's running statistics too, as
        # the mean in the clear averages them); integer ones keep their value
        self.entries = sorted(
            k for k, v in current.items() if np.issubdtype(v.dtype, np.floating)
        )
        control = strategy.server_state  # SCAFFOLD's c: FedProto refuses SecAgg+
        self.control_entries = sorted(control.c) if control else []
        self.scale = 0  # S, the round's largest shard (0: a uniform mean)

    # ---- the stages ----------------------------------------------------------

    def play(self) -> TrainOutcome:
        set_up = self._set_up()
        keys, shared = set_up.keys, set_up.shared
        upcoming = self._upcoming(shared)
        updates, vectors, next_keys = self._trained(shared, upcoming)
        outcome = TrainOutcome(
            updates=updates, failures=self.stages.failures, answered=len(updates)
        )
        # never fewer than MIN_SURVIVORS: the sum of one is its update
        needed = max(self.strategy.min_updates, secagg.MIN_SURVIVORS)
        if len(vectors) < needed:
            return self._skipped(
                outcome, f"{len(vectors)} masked vectors arrived, it needs {needed}"
            )
        revealed = self._revealed(vectors, shared, upcoming, next_keys)
        committed = Committed(
            {self.plan.ids[c]: bytes(r["seed-hash"]) for c, r in keys.items()},
            {self.plan.ids[c]: bytes(r["mask-public"]) for c, r in keys.items()},
            {self.plan.ids[c]: t for c, (t, _) in shared.items()},
        )
        started = time.perf_counter()
        dropped = sorted(self.plan.ids[c] for c in shared if c not in vectors)
        ids = self.plan.ids
        try:
            total, wrong = unmasked_sum(
                {ids[c]: v for c, v in vectors.items()}, dropped, self.plan.graph,
                {ids[c] for c in shared}, revealed, committed,
            )  # fmt: skip
        except UnmaskError as err:
            return self._skipped(outcome, f"the sum cannot be unmasked: {err}")
        self.stages.seconds["unmask-compute"] = time.perf_counter() - started
        for holder in wrong:
            self.stages.failures.append(
                rejected(self._node(self.plan.client_of[holder]),
                         f"client {self.plan.client_of[holder]}: a revealed share "
                         "is inconsistent with its owner's commitment", "unmask ")
            )  # fmt: skip
        return self._stepped(outcome, total, len(vectors), len(dropped))

    def _set_up(self) -> SetUp:
        """Stages 1 and 2: as the round before set them up, when every client
        of this round shared there; otherwise run now."""
        ready = self.options.ready.pop(self.request.server_round, None)
        owners = self._owners(self.request.clients)
        if ready is not None and list(ready.owners.items()) == list(owners.items()):
            self.stages.set_up_ahead = True
            return ready
        asked = {
            c: secagg.config_record(id=self.plan.ids[c]) for c in self.request.clients
        }
        answers = self._exchange(SECAGG_KEYS, asked, "keys")
        keys = self._good_keys(
            {c: content[SECAGG] for c, content in answers.items()}, "keys"
        )
        asked = self._share_requests(self.plan, keys)
        for client in keys.keys() - asked.keys():
            self._drop(client, "shares", "none of its neighbours sent keys, so "
                       "its own seed alone would mask its vector")  # fmt: skip
        answers = self._exchange(SECAGG_SHARES, asked, "shares")
        replies = {c: content[SECAGG] for c, content in answers.items()}
        return SetUp(owners, keys, self._shares(asked, replies, "shares"))

    def _upcoming(self, shared: Shares) -> Plan | None:
        """The next round's plan, when its stages 1 and 2 can ride on this
        round's exchanges: overlap on, a next round, and every client it
        samples training in this one."""
        options, this_round = self.options, self.request.server_round
        if not options.ahead or this_round >= options.last_round:
            return None
        clients = self.strategy.sampled(this_round + 1, self.request.participants)
        if not clients or not set(clients) <= set(shared):
            return None
        return Plan.of(clients, options.params.neighbours)

    def _good_keys(
        self, answers: Mapping[int, ConfigRecord], stage: str
    ) -> dict[int, ConfigRecord]:
        """Stage 1's answers that hold well-formed keys, each key its own
        (a repeated one would make every neighbour's stage 2 fail); the
        others dropped."""
        good = {}
        for client, record in answers.items():
            try:
                secagg.load_public(bytes(record["mask-public"]))
                secagg.load_public(bytes(record["share-public"]))
                if len(bytes(record["seed-hash"])) != 32:
                    raise ValueError("a seed commitment is 32 bytes")
            except (KeyError, TypeError, ValueError) as err:
                self._drop(client, stage, f"malformed keys ({err})")
                continue
            good[client] = record
        uses = Counter(
            bytes(r[k]) for r in good.values() for k in ("mask-public", "share-public")
        )
        for client, record in list(good.items()):
            if any(uses[bytes(record[k])] > 1 for k in ("mask-public", "share-public")):
                self._drop(client, stage, "a public key it sent is not its own alone")
                del good[client]
        return good

    def _share_requests(
        self, plan: Plan, keys: Mapping[int, ConfigRecord]
    ) -> dict[int, ConfigRecord]:
        """Stage 2's request to each client with keys and a neighbour that
        sent keys: those neighbours' public keys and the threshold of its
        holders."""
        asked = {}
        for client in keys:
            neighbours = [v for v in plan.graph[plan.ids[client]]
                          if plan.client_of[v] in keys]  # fmt: skip
            holders = 1 + len(neighbours)
            if holders < secagg.MIN_HOLDERS:
                continue
            asked[client] = secagg.config_record(
                neighbours=neighbours,
                **{"share-publics": [keys[plan.client_of[v]]["share-public"]
                                     for v in neighbours],
                   "mask-publics": [keys[plan.client_of[v]]["mask-public"]
                                    for v in neighbours]},
                threshold=secagg.threshold_for(holders, self.options.params.threshold),
            )  # fmt: skip
        return asked

    def _shares(
        self,
        asked: Mapping[int, ConfigRecord],
        answers: Mapping[int, ConfigRecord],
        stage: str,
    ) -> Shares:
        """Stage 2's answers that match their request: who shared, with its
        threshold and ciphertexts by holder; the others dropped."""
        shared = {}
        for client, record in answers.items():
            try:
                to = [int(v) for v in record.get("to", [])]
                ciphertexts = [bytes(c) for c in record.get("ciphertexts", [])]
            except (TypeError, ValueError) as err:
                self._drop(client, stage, f"malformed shares ({err})")
                continue
            if to != list(asked[client].get("neighbours", [])) or len(
                ciphertexts
            ) != len(to):
                self._drop(client, stage, "its shares do not match its holders")
                continue
            shared[client] = (
                int(asked[client]["threshold"]), dict(zip(to, ciphertexts, strict=True))
            )  # fmt: skip
        return shared

    def _trained(
        self, shared: Shares, upcoming: Plan | None
    ) -> tuple[list[ClientUpdate], dict[int, np.ndarray], dict[int, ConfigRecord]]:
        """Stage 3: the training messages with the relayed shares (and the
        next round's stage 1 to its clients); the survivors' updates (metrics
        only) and masked vectors, and the next round's well-formed keys."""
        bounds = [self.request.participants.max_examples.get(c, 0) for c in shared]
        self.scale = 0 if self.options.uniform else max(bounds, default=0)
        messages = self._training_messages(shared, upcoming)
        length = self._length() + TAIL
        replies = self._send(messages, "train", list(shared))
        updates, vectors, next_keys = [], {}, {}
        seen: set[int] = set()
        for reply in replies:
            try:
                client, metrics, vector = self._checked_vector(
                    reply, length, shared, seen
                )
            except ReplyError as err:
                self.stages.failures.append(
                    rejected(reply.metadata.src_node_id, str(err))
                )
                continue
            seen.add(client)
            vectors[client] = vector
            updates.append(ClientUpdate(client, {}, metrics, 0.0))
            if upcoming is not None and client in upcoming.ids:
                next_keys[client] = reply.content.get(SECAGG_NEXT, ConfigRecord())
        updates.sort(key=lambda u: u.client)
        return updates, vectors, self._good_keys(next_keys, "next round's keys")

    def _training_messages(
        self, shared: Shares, upcoming: Plan | None
    ) -> list[Message]:
        """The round's training message of each client that shared, with the
        shares relayed to it and what its vector holds (and, for the next
        round's clients, its number there, to advertise keys for it)."""
        params = self.options.params
        messages = []
        for message in self.request.messages:
            client = int(message.content[CONFIG][CLIENT])
            if client not in shared:
                continue
            me = self.plan.ids[client]
            relayed = {
                self.plan.ids[c]: cts[me] for c, (_, cts) in shared.items() if me in cts
            }
            record = secagg.config_record(
                **{"from": sorted(relayed),
                   "ciphertexts": [relayed[v] for v in sorted(relayed)],
                   "entries": self.entries,
                   "control-entries": self.control_entries,
                   "weight-scale": float(self.scale)},
                clip=params.clip, bits=params.bits, seed=self.options.seed,
            )  # fmt: skip
            content = RecordDict({**message.content, SECAGG: record})
            if upcoming is not None and client in upcoming.ids:
                content[SECAGG_NEXT] = secagg.config_record(id=upcoming.ids[client])
            messages.append(
                Message(content, dst_node_id=message.metadata.dst_node_id,
                        message_type=message.metadata.message_type)
            )  # fmt: skip
        return messages

    def _revealed(
        self,
        vectors: Mapping[int, np.ndarray],
        shared: Shares,
        upcoming: Plan | None,
        next_keys: Mapping[int, ConfigRecord],
    ) -> Revealed:
        """Stage 4: the survivors' revealed shares, by owner (with the next
        round's stage 2 when every one of its clients advertised keys and
        survived)."""
        survived = sorted(self.plan.ids[c] for c in vectors)
        dropped = sorted(self.plan.ids[c] for c in shared if c not in vectors)
        asked = {
            c: secagg.config_record(survived=survived, dropped=dropped) for c in vectors
        }
        ahead = {}
        if upcoming is not None and set(next_keys) == set(upcoming.clients):
            ahead = self._share_requests(upcoming, next_keys)
        answers = self._exchange(SECAGG_UNMASK, asked, "unmask", ahead)
        if ahead:
            self._keep_set_up(upcoming, next_keys, ahead, answers)
        seeds: dict[int, list[tuple[int, bytes]]] = {}
        keys: dict[int, list[tuple[int, bytes]]] = {}
        for client, content in answers.items():
            record = content[SECAGG]
            try:
                its_seeds = _owned_shares(record, "seed-of", "seeds", survived)
                its_keys = _owned_shares(record, "key-of", "keys", dropped)
            except (TypeError, ValueError) as err:
                self._drop(client, "unmask", f"malformed revealed shares ({err})")
                continue
            holder = self.plan.ids[client]
            for owner, share in its_seeds:
                seeds.setdefault(owner, []).append((holder, share))
            for owner, share in its_keys:
                keys.setdefault(owner, []).append((holder, share))
        return Revealed(seeds, keys)

    def _keep_set_up(
        self,
        upcoming: Plan,
        keys: Mapping[int, ConfigRecord],
        asked: Mapping[int, ConfigRecord],
        answers: Mapping[int, RecordDict],
    ) -> None:
        """The next round's stage 2 from the unmask replies, kept in `ready`
        when every one of its clients shared (otherwise it sets itself up)."""
        replies = {}
        for client in asked:
            record = answers[client].get(SECAGG_NEXT) if client in answers else None
            if isinstance(record, ConfigRecord):
                replies[client] = record
            elif client in answers:
                self._drop(client, "next round's shares", "it sent none")
        shared = self._shares(asked, replies, "next round's shares")
        if set(shared) == set(upcoming.clients):
            self.options.ready[self.request.server_round + 1] = SetUp(
                self._owners(upcoming.clients), dict(keys), shared
            )

    # ---- the mean ------------------------------------------------------------

    def _stepped(
        self, outcome: TrainOutcome, total: np.ndarray, count: int, dropped: int
    ) -> TrainOutcome:
        """The outcome with the server update stepped from the unmasked mean."""
        params, request = self.options.params, self.request
        weight, clipped = int(total[-2]), int(total[-1])
        # each survivor adds 1 (uniform) or its n_k in [1, S]
        possible = weight == count if self.options.uniform else (
            count <= weight <= count * self.scale
        )  # fmt: skip
        if not possible:
            return self._skipped(outcome, f"the unmasked example weight {weight} "
                                 "is impossible: inconsistent vectors")  # fmt: skip
        sums = iter(self._split(secagg.dequantize(
            total[:-TAIL], count, params.clip, params.bits
        )))  # fmt: skip
        # sum_k (n_k / S) d_k times S / sum_k n_k; uniform: sum_k d_k / m
        factor = 1.0 / count if self.options.uniform else self.scale / weight
        current = request.current
        mean = {k: v.astype(np.float64) for k, v in current.items()}
        for key in self.entries:
            mean[key] = mean[key] + factor * next(sums)
        if self.strategy.server_state:
            self.strategy.server_state.add(
                {key: next(sums) for key in self.control_entries}
            )
        report = {
            **self.stages.report(),
            "secagg-survivors": count,
            "secagg-dropped": len(request.clients) - count,
            "secagg-dropped-after-sharing": dropped,
            "secagg-clipped": clipped,
            "secagg-error-bound": count * params.quantum * factor,
        }
        aggregate = Aggregate(mean, tuple(outcome.updates), report)
        return dataclasses.replace(
            outcome,
            report=report,
            bytes_up=sum(self.stages.bytes_up.values()),
            bytes_down=sum(self.stages.bytes_down.values()),
            arrays=self.strategy.step(request.model, request.shared, aggregate),
        )

    def _split(self, values: np.ndarray) -> list[np.ndarray]:
        """The flat values as the entries, then the control entries, shaped."""
        out, offset = [], 0
        for shape in self._shapes():
            size = int(np.prod(shape))
            out.append(values[offset : offset + size].reshape(shape))
            offset += size
        return out

    def _skipped(self, outcome: TrainOutcome, why: str) -> TrainOutcome:
        log(WARNING, "pollen: secure round %d skipped, the model is unchanged: %s",
            self.request.server_round, why)  # fmt: skip
        self.stages.failures.append(f"secure round skipped: {why}")
        return dataclasses.replace(
            outcome,
            failures=self.stages.failures,
            report=self.stages.report(),
            bytes_up=sum(self.stages.bytes_up.values()),
            bytes_down=sum(self.stages.bytes_down.values()),
        )

    # ---- messages ------------------------------------------------------------

    def _exchange(
        self,
        action: str,
        asked: Mapping[int, ConfigRecord],
        stage: str,
        ahead: Mapping[int, ConfigRecord] | None = None,
    ) -> dict[int, RecordDict]:
        """One query per client in `asked` (with its `ahead` record, the next
        round's, where there is one); the valid replies' content by client."""
        owner = self.request.participants.roster.owner
        ahead = ahead or {}
        messages = []
        for client, record in asked.items():
            content = RecordDict({
                CONFIG: ConfigRecord({
                    CLIENT: client, SERVER_ROUND: self.request.server_round,
                }),
                SECAGG: record,
            })  # fmt: skip
            if client in ahead:
                content[SECAGG_NEXT] = ahead[client]
            messages.append(
                Message(content, dst_node_id=owner[client],
                        message_type=f"{MessageType.QUERY}.{action}")
            )  # fmt: skip
        answers: dict[int, RecordDict] = {}
        for reply in self._send(messages, stage, list(asked)):
            try:
                client = named_client(reply, owner, asked, set(answers), stage)
            except ReplyError as err:
                self.stages.failures.append(
                    rejected(reply.metadata.src_node_id, str(err), f"{stage} ")
                )
                continue
            if isinstance(reply.content.get(SECAGG), ConfigRecord):
                answers[client] = reply.content
            else:
                self._drop(client, stage, f"reply lacks its {SECAGG!r} record")
        return answers

    def _send(
        self, messages: list[Message], stage: str, clients: list[int]
    ) -> list[Message]:
        """The valid replies to `messages`; the stage's cost and the failed
        clients noted."""
        started = time.perf_counter()
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        self.stages.seconds[stage] = time.perf_counter() - started
        self.stages.bytes_down[stage] = sum(_bytes(m.content) for m in messages)
        valid = [r for r in replies if not r.has_error()]
        self.stages.bytes_up[stage] = sum(_bytes(r.content) for r in valid)
        owner = self.request.participants.roster.owner
        failed = [r for r in replies if r.has_error()]
        for line in reply_failures(clients, owner, valid, failed):
            self.stages.failures.append(f"secagg {stage}: {line}")
        return valid

    def _checked_vector(
        self, reply: Message, length: int, asked: Shares, seen: set[int]
    ) -> tuple[int, MetricRecord, np.ndarray]:
        """A training reply's client (one that shared), metrics and vector."""
        owner = self.request.participants.roster.owner
        client = named_client(reply, owner, asked.keys(), seen, "train")
        record, metrics = reply.content.get(MASKED), reply.content.get(METRICS)
        if not isinstance(record, ArrayRecord) or not isinstance(metrics, MetricRecord):
            raise ReplyError(f"reply lacks its {MASKED!r} or {METRICS!r} record")
        if set(record) != {MASKED}:
            raise ReplyError(f"a secure reply carries only {MASKED!r}")
        vector = record[MASKED].numpy()
        if vector.dtype != np.uint32 or vector.shape != (length,):
            raise ReplyError(
                f"masked vector is {vector.dtype}{list(vector.shape)}, expected "
                f"uint32[{length}]"
            )
        for name, value in metrics.items():
            if isinstance(value, list) or not np.isfinite(value):
                raise ReplyError(f"metric {name!r} must be a finite number")
        return client, metrics, vector

    def _shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the values a vector carries: the entries, then the
        control entries."""
        shapes = [self.request.current[k].shape for k in self.entries]
        if self.strategy.server_state:
            shapes += [
                self.strategy.server_state.c[k].shape for k in self.control_entries
            ]
        return shapes

    def _length(self) -> int:
        return sum(int(np.prod(shape)) for shape in self._shapes())

    def _drop(self, client: int, stage: str, why: str) -> None:
        node = self._node(client)
        self.stages.failures.append(
            rejected(node, f"client {client}: {why}", f"secagg {stage} ")
        )

    def _node(self, client: int) -> int:
        return self.request.participants.roster.owner[client]

    def _owners(self, clients: list[int]) -> dict[int, int]:
        return {client: self._node(client) for client in clients}


def _owned_shares(
    record: ConfigRecord, owners_key: str, shares_key: str, wanted: list[int]
) -> list[tuple[int, bytes]]:
    """The (owner, share) pairs of a stage-4 reply whose owner is `wanted`;
    a TypeError or ValueError when the lists are not of numbers and bytes."""
    pairs = zip(record.get(owners_key, []), record.get(shares_key, []), strict=False)
    return [(int(o), bytes(share)) for o, share in pairs if o in wanted]


def _bytes(content: RecordDict) -> int:
    return sum(record.count_bytes() for record in content.values())

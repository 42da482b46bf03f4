"""SecAgg+'s compute per round against the clients in it, server and client.

    .venv/bin/python benchmarks/secagg.py [--clients 10,50,100] [--repeat 2]

One secure round (`pollen.strategies.secure_round`) of FedAvg over the
MNIST `mlp` (109,386 parameters), with every sampled client's ClientApp
stage handlers (`pollen.task.secagg_client`) answering in this process, so
nothing but the protocol's own work is timed: no training (each client
replies with a given update), no network, no Flower processes. Each
handler call is timed by stage; the client columns are the mean per client
(what each of them computes), the server column is the round's remaining
time (relaying, checking, unmasking, the mean). Two graphs: every other
client as a neighbour (SecAgg, `secagg-neighbours = 1`) and SecAgg+'s
sparse ring (about 2 log2(n) neighbours each). `plain mean` is the
example-weighted mean the same round takes in the clear (`Mean` on the n
updates), for scale. Medians of `--repeat` rounds after one untimed round.
Measured numbers, with the date and the machine's load:
docs/secure-aggregation.md, "Cost".
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from pollen.common import secagg
from pollen.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    CONFIG,
    LR,
    METRICS,
    NUM_EXAMPLES,
    SECAGG_KEYS,
    SECAGG_SHARES,
    SECAGG_UNMASK,
)
from pollen.strategies.aggregation import ClientUpdate, Mean
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.secure_round import SecureAggregation
from pollen.strategies.strategy import Strategy
from pollen.task import secagg_client
from pollen.task.models import build_model

STAGES = {
    f"{MessageType.QUERY}.{SECAGG_KEYS}": ("keys", secagg_client.advertise_keys),
    f"{MessageType.QUERY}.{SECAGG_SHARES}": ("shares", secagg_client.share_keys),
    f"{MessageType.QUERY}.{SECAGG_UNMASK}": ("unmask", secagg_client.reveal_shares),
}


class TimedClients:
    """Every client answering in this process, each handler call timed."""

    def __init__(self, updates: dict[int, dict[str, np.ndarray]]) -> None:
        self.updates = updates
        self.contexts: dict[int, Context] = {}
        self.seconds: dict[str, float] = defaultdict(float)

    def train(self, msg: Message, context: Context) -> Message:
        client = int(msg.content[CONFIG][CLIENT])
        arrays = ArrayRecord({k: Array(v) for k, v in self.updates[client].items()})
        content = RecordDict({
            ARRAYS: arrays, METRICS: MetricRecord({NUM_EXAMPLES: 600}),
            CLIENT_RECORD: ConfigRecord({CLIENT: client}),
        })  # fmt: skip
        return Message(content, reply_to=msg)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            kind = msg.metadata.message_type
            stage, handler = STAGES.get(
                kind, ("masking", lambda m, c: secagg_client.secagg_mod(m, c, self.train))
            )  # fmt: skip
            context = self.contexts.setdefault(
                msg.metadata.dst_node_id, Context(1, 0, {}, RecordDict(), {})
            )
            started = time.perf_counter()
            replies.append(handler(msg, context))
            self.seconds[stage] += time.perf_counter() - started
        return replies


def one_round(
    model: dict[str, np.ndarray], count: int, neighbours: float
) -> dict[str, float]:
    """Seconds of one secure round: per client by stage, and the server's."""
    rng = np.random.default_rng(count)
    updates = {
        c: {k: v + rng.normal(0, 0.01, v.shape).astype(v.dtype) for k, v in model.items()}
        for c in range(count)
    }  # fmt: skip
    params = secagg.SecAggParams(0.6, neighbours, 1.0, 20)  # clip, bits: no cost
    strategy = Strategy(
        num_clients=count, client_frac=1.0, seed=1, server_update=FedAvgUpdate(),
        secure=SecureAggregation(params, 1, uniform=False),
    )  # fmt: skip
    owner = {c: 1000 + c for c in range(count)}
    participants = Participants(Roster(owner), {c: 600 for c in range(count)})
    arrays = ArrayRecord({k: Array(v) for k, v in model.items()})
    request = strategy.configure_train(1, arrays, ConfigRecord({LR: 0.1}), participants)
    clients = TimedClients(updates)
    started = time.perf_counter()
    outcome = strategy.secure.train(clients, strategy, request, 10.0)
    total = time.perf_counter() - started
    assert not outcome.skipped and not outcome.failures, outcome.failures
    plain_started = time.perf_counter()
    Mean()(
        [ClientUpdate(c, u, MetricRecord({NUM_EXAMPLES: 600}), 600.0)
         for c, u in updates.items()],
        model, tuple(model),
    )  # fmt: skip
    plain = time.perf_counter() - plain_started
    per_client = {s: t / count for s, t in clients.seconds.items()}
    return {**per_client, "server": total - sum(clients.seconds.values()),
            "plain mean": plain}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,50,100")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    net = build_model("mlp", (1, 28, 28), 10, 1)
    model = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    size = sum(v.size for v in model.values())
    print(f"MNIST mlp, {size:,} parameters; seconds per round "
          f"(client columns: per client), median of {args.repeat}")  # fmt: skip
    columns = ["keys", "shares", "masking", "unmask", "server", "plain mean"]
    print(f"| clients | neighbours | {' | '.join(columns)} |")
    print("|---:|---:|" + "---:|" * len(columns))
    for count in (int(c) for c in args.clients.split(",")):
        sparse = min(1.0, 2 * math.ceil(math.log2(count)) / (count - 1))
        for share in dict.fromkeys([1.0, sparse]):
            one_round(model, count, share)  # untimed: first-use imports
            rounds = [one_round(model, count, share) for _ in range(args.repeat)]
            cells = [statistics.median(r[c] for r in rounds) for c in columns]
            degree = secagg.ring_neighbours(count, share)[1]
            print(f"| {count} | {len(degree)} | "
                  + " | ".join(f"{v:.3f}" for v in cells) + " |")  # fmt: skip


if __name__ == "__main__":
    main()

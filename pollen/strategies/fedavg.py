"""FedAvg (McMahan et al. 2017) on Flower's message API, made reproducible.

Differences from `flwr.serverapp.strategy.FedAvg`, all for exact, comparable runs:

- clients (data partitions) are sampled by a generator seeded with
  (seed, round) and routed through a `Roster`, instead of `random.sample`
  over node IDs that change from run to run;
- replies are aggregated in client order, so float sums do not depend on the
  order in which replies arrive;
- every entry keeps its dtype (float32 weights, integer BatchNorm counters);
- bytes sent and received per round are counted from the records themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from .aggregate import weighted_average
from .sampling import Roster, sample_clients

CLIENT_KEY = "partition-id"


@dataclass
class RoundTraffic:
    """What one round moved, and who took part."""

    clients: list[int] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0
    failures: list[str] = field(default_factory=list)


class FedAvg(FlowerFedAvg):
    """Weighted FedAvg over seeded client samples (see module docstring)."""

    def __init__(
        self, *, roster: Roster, num_clients: int, client_frac: float, seed: int
    ) -> None:
        super().__init__(
            fraction_train=client_frac,
            fraction_evaluate=0.0,  # the ServerApp evaluates the global model itself
            min_train_nodes=1,
            min_available_nodes=1,
        )
        self.roster = roster
        self.num_clients = num_clients
        self.seed = seed
        self.traffic: dict[int, RoundTraffic] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled client, addressed to the node that serves it."""
        clients = sample_clients(
            self.num_clients, self.fraction_train, self.seed, server_round
        )
        payload = self.outgoing(arrays)
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
                    message_type=MessageType.TRAIN,
                    dst_node_id=self.roster.owner[client],
                )
            )
        self.traffic[server_round] = RoundTraffic(
            clients=clients, bytes_down=payload.count_bytes() * len(clients)
        )
        return messages

    def outgoing(self, arrays: ArrayRecord) -> ArrayRecord:
        """The entries sent to clients (all of them, for FedAvg)."""
        return arrays

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Example-weighted average of the replies, in client order."""
        valid, failed = self._check_and_log_replies(replies, is_train=True)
        valid.sort(key=lambda m: int(m.content["client"][CLIENT_KEY]))
        traffic = self.traffic.setdefault(server_round, RoundTraffic())
        traffic.bytes_up = sum(
            m.content[self.arrayrecord_key].count_bytes() for m in valid
        )
        traffic.failures = [
            f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed
        ]
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        arrays = self.aggregate_arrays(
            [c[self.arrayrecord_key] for c in contents],
            [float(c["metrics"][self.weighted_by_key]) for c in contents],
        )
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return arrays, metrics

    def aggregate_arrays(
        self, records: list[ArrayRecord], weights: list[float]
    ) -> ArrayRecord:
        """The new global model from the clients' models."""
        return weighted_average(records, weights)

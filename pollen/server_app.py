"""ServerApp: settings -> data -> model -> strategy -> rounds -> results on disk.

After every round the global model is evaluated on the test split, the
learning rate for the next round is set by ReduceLROnPlateau on that loss,
and the history is rewritten, so a run that dies keeps every finished round.
"""

from __future__ import annotations

import io
import time
from logging import INFO
from pathlib import Path

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from .results import (
    RoundRecord,
    create_run_dir,
    default_run_name,
    plot_curves,
    plot_label_heatmap,
    round_lines,
    summarize,
    write_atomic,
    write_history,
    write_json,
)
from .settings import Settings
from .strategies import build_strategy
from .strategies.fedavg import CLIENT_KEY, FedAvg, RoundTraffic
from .strategies.sampling import OneMessagePerNode, Roster, RosterError
from .task import federated_data
from .task.data import Dataset
from .task.models import build_model
from .task.partition import format_label_counts, label_counts
from .task.train import Preprocess, evaluate, pick_device

NODE_WAIT_SECONDS = 120.0
QUERY_TIMEOUT_SECONDS = 120.0

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one federated training job and write its results directory."""
    started = time.monotonic()
    settings = Settings.from_run_config(context.run_config)
    run_name = settings.run_name or default_run_name(
        settings.strategy, settings.data_set
    )
    run_dir = create_run_dir(settings.output_dir, run_name)
    write_json(
        run_dir / "settings.json", {**settings.to_run_config(), "run-name": run_name}
    )
    print(f"pollen: results go to {run_dir}", flush=True)
    history: list[RoundRecord] = []
    try:
        _train(grid, settings, run_dir, history)
    except BaseException as err:
        summary = summarize(history, "failed", time.monotonic() - started, _reason(err))
        write_json(run_dir / "summary.json", summary)
        raise
    write_json(
        run_dir / "summary.json",
        summarize(history, "completed", time.monotonic() - started),
    )
    print(f"pollen: run completed; results in {run_dir}", flush=True)


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _train(
    grid: Grid, settings: Settings, run_dir: Path, history: list[RoundRecord]
) -> None:
    dataset, shards = federated_data(settings)
    counts = label_counts(dataset.y_train.numpy(), shards, dataset.num_classes)
    print(
        f"pollen: {dataset.name} from {dataset.source}: {len(dataset.y_train)} train / "
        f"{len(dataset.y_test)} test, {settings.num_clients} clients "
        f"({settings.partition}), {int(counts.sum())} training samples used",
        flush=True,
    )
    if settings.print_labels:
        print(format_label_counts(counts), flush=True)
    plot_label_heatmap(
        counts,
        run_dir / "labels.png",
        f"{dataset.name}: {settings.partition} partition",
    )
    device = pick_device(settings.device)
    model = build_model(
        settings.model, dataset.input_shape, dataset.num_classes, settings.seed
    )
    roster = discover_roster(grid, settings.num_clients)
    log(INFO, "pollen: %d clients on %d nodes", settings.num_clients, roster.num_nodes)
    strategy = build_strategy(settings, roster, model)
    initial = ArrayRecord({k: v.clone() for k, v in model.state_dict().items()})
    train_config = ConfigRecord({"lr": settings.lr})
    evaluator = RoundEvaluator(
        settings, dataset, model.to(device), device, strategy, train_config,
        history, run_dir,
    )  # fmt: skip
    result = strategy.start(
        grid=OneMessagePerNode(grid),
        initial_arrays=initial,
        num_rounds=settings.rounds,
        train_config=train_config,
        evaluate_fn=evaluator,
    )
    buffer = io.BytesIO()
    torch.save(result.arrays.to_torch_state_dict(), buffer)
    write_atomic(run_dir / "model.pt", buffer.getvalue())
    plot_curves(
        history, run_dir / "curves.png", f"{settings.strategy} on {dataset.name}"
    )


def discover_roster(grid: Grid, num_clients: int) -> Roster:
    """Ask every connected node which partition it holds; map clients to nodes."""
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    while not (node_ids := sorted(grid.get_node_ids())):
        if time.monotonic() > deadline:
            raise RosterError(
                f"no SuperNode connected within {NODE_WAIT_SECONDS:.0f} s"
            )
        time.sleep(1.0)
    queries = [
        Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=n)
        for n in node_ids
    ]
    nodes = {}
    for reply in grid.send_and_receive(queries, timeout=QUERY_TIMEOUT_SECONDS):
        if reply.has_error():
            log(INFO, "pollen: node %d did not answer: %s", reply.metadata.src_node_id,
                reply.error.reason)  # fmt: skip
            continue
        info = reply.content["node"]
        nodes[reply.metadata.src_node_id] = (
            int(info[CLIENT_KEY]),
            int(info["num-partitions"]),
        )
    return Roster.from_nodes(nodes, num_clients)


class RoundEvaluator:
    """Flower's `evaluate_fn`: test the global model, step the lr, record the round.

    Flower calls it after the round's federated evaluation, so the clients'
    personalised results (FedBN, SiloBN) are already in `strategy.personal`.
    """

    def __init__(
        self,
        settings: Settings,
        dataset: Dataset,
        model: torch.nn.Module,
        device: torch.device,
        strategy: FedAvg,
        train_config: ConfigRecord,
        history: list[RoundRecord],
        run_dir: Path,
    ) -> None:
        self.settings = settings
        self.model = model
        self.device = device
        self.x_test = dataset.x_test.to(device)
        self.y_test = dataset.y_test.to(device)
        self.preprocess = Preprocess(
            dataset.mean, dataset.std, settings.normalize, device=device
        )
        self.strategy = strategy
        self.train_config = train_config
        self.history = history
        self.run_dir = run_dir
        self._lr_holder = torch.optim.SGD(
            [torch.zeros(1, requires_grad=True)], lr=settings.lr
        )
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self._lr_holder,
            mode="min",
            factor=settings.lr_factor,
            patience=settings.lr_patience,
            threshold=settings.lr_threshold,
            cooldown=settings.lr_cooldown,
            min_lr=settings.min_lr,
        )
        self._last = time.monotonic()

    @property
    def lr(self) -> float:
        return float(self._lr_holder.param_groups[0]["lr"])

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # Flower's call before the first round: start the clock
            self._last = time.monotonic()
            return None
        state = arrays.to_torch_state_dict()
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
        loss, accuracy = evaluate(
            self.model,
            self.x_test,
            self.y_test,
            batch_size=self.settings.test_batch_size,
            preprocess=self.preprocess,
        )
        now = time.monotonic()
        traffic = self.strategy.traffic.get(server_round, RoundTraffic())
        record = RoundRecord(
            round=server_round,
            accuracy=accuracy,
            loss=loss,
            lr=self.lr,
            seconds=round(now - self._last, 4),
            bytes_up=traffic.bytes_up,
            bytes_down=traffic.bytes_down,
            clients=traffic.clients,
            failures=traffic.failures,
            eval_bytes=traffic.eval_bytes,
            personal=self.strategy.personal.get(server_round, {}),
        )
        self._last = now
        self.history.append(record)
        write_history(self.run_dir, self.history)
        mean_seconds = sum(r.seconds for r in self.history) / len(self.history)
        left = mean_seconds * (self.settings.rounds - server_round)
        print(round_lines(record, self.settings.rounds, left), flush=True)
        self.scheduler.step(loss)
        # Strategy.start passes this same ConfigRecord to every round's
        # configure_train, so the next round's clients receive the new lr.
        self.train_config["lr"] = self.lr
        return MetricRecord({"accuracy": accuracy, "loss": loss})

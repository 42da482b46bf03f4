"""Whether 1,000 simulated clients fit in this machine's memory, under FedAvg and FedDyn.

    .venv/bin/python benchmarks/scale.py [--rounds 5] [--clients 1000]
        [--data-set mnist] [--data-root ../shared/data] [--alpha 0.1]

`pollen run` simulates one SuperNode per client, so 1,000 clients are 1,000
nodes whose contexts the simulation process keeps for the whole run; FedDyn
adds one model-sized h_k per client that has trained, held in its node's
`context.state`. This runs both strategies on `--clients` clients with 10
sampled per round, and, as the baseline, on 10 clients all sampled every
round: the same rounds, model, data set and number of trainings per round,
so the difference in peak memory and start-up is the cost of the extra nodes
(the baseline's shards are 100x larger, so its rounds are slower and its
accuracy is not comparable). Peak RSS is `measure.run_pollen`'s: the whole
process tree, shared library pages counted once per process.

Below the table: the bytes of one client's h_k (the ArrayRecord the
ClientApp stores, built with pollen's own model and sharing code), how many
clients hold one after the run (from its history) and what all `--clients`
would hold once each has trained.

Partitions are niid-client (each client's label mix drawn from Dirichlet
`--alpha`, default 0.1; equal shards, so min-size 10 always holds). The
per-class `niid` cannot serve 1,000 clients on MNIST at alpha 0.1: every
draw leaves ~30 clients empty. Decoded data and shards are computed once,
before the runs, into a temporary POLLEN_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord
from measure import PROJECT, run_pollen, settings_of

from pollen.settings import Scalar, Settings
from pollen.strategies.sharing import Sharing
from pollen.task.data import CACHE_ENV
from pollen.task.inputs import settings_model
from pollen.task.shards import federated_data

SAMPLED = 10  # clients trained per round, in every run
STRATEGIES = ("fedavg", "feddyn")
GIB, MIB = 2**30, 2**20


@dataclass(frozen=True)
class Row:
    """One measured `pollen run`."""

    strategy: str
    clients: int
    rounds: int
    wall: float
    start_up: float
    mean_round: float
    peak_rss: int
    accuracy: float
    trained: int  # distinct clients that trained, i.e. hold client state


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--data-set", default="mnist")
    parser.add_argument(
        "--data-root", type=Path, default=PROJECT.parent / "shared" / "data"
    )
    parser.add_argument("--alpha", type=float, default=0.1)
    args = parser.parse_args()
    if args.clients <= SAMPLED:
        parser.error(f"--clients must exceed the baseline's {SAMPLED}")
    return args


def run_config(
    args: argparse.Namespace, strategy: str, clients: int
) -> dict[str, Scalar]:
    """One run's overrides: `clients` clients, SAMPLED of them per round."""
    return {
        "strategy": strategy,
        "data-set": args.data_set,
        "data-root": str(args.data_root.resolve()),
        "num-clients": clients,
        "client-frac": SAMPLED / clients,
        "min-train-nodes": SAMPLED,
        "partition": "niid-client",
        "alpha": args.alpha,
        "min-size": 10,
        "local-epochs": 1,
        "batch-size": 32,
        "rounds": args.rounds,
        "model": "mlp",
    }


def as_text(config: dict[str, Scalar]) -> str:
    """The overrides as one `-c` value."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())


def h_k_size(settings: Settings) -> tuple[int, int]:
    """(parameters, stored bytes) of one client's FedDyn h_k: zeros shaped as
    the entries `client_app._regularizer` keeps, as the ArrayRecord it stores."""
    dataset, _ = federated_data(settings)
    model = settings_model(settings, dataset)
    names = Sharing.of(settings.sharing_policy, model).trained_shared(
        exclude_bn=settings.feddyn_exclude_bn
    )
    params = dict(model.named_parameters())
    h = ArrayRecord({n: torch.zeros_like(params[n].detach()) for n in names})
    return sum(params[n].numel() for n in names), h.count_bytes()


def clients_trained(run_dir: Path) -> int:
    """Distinct clients that trained in the run (its history's `clients`)."""
    history = json.loads((run_dir / "history.json").read_text())
    return len({c for record in history for c in record["clients"]})


def measure_run(config: dict[str, Scalar], out: Path) -> Row:
    name = f"{config['strategy']}-{config['num-clients']}"
    result = run_pollen([as_text(config)], out, name)
    rounds = result["rounds"]
    return Row(
        strategy=str(config["strategy"]),
        clients=int(config["num-clients"]),
        rounds=len(rounds),
        wall=result["wall"],
        start_up=result["start-up"],
        mean_round=sum(rounds) / len(rounds),
        peak_rss=int(result["peak-rss"]),
        accuracy=result["accuracy"],
        trained=clients_trained(out / name),
    )


def print_table(rows: list[Row]) -> None:
    print(
        "| strategy | num-clients | sampled/round | rounds | wall s | start-up s "
        "| mean round s | peak RSS GiB | final accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.strategy} | {r.clients} | {SAMPLED} | {r.rounds} | {r.wall:.1f} "
            f"| {r.start_up:.1f} | {r.mean_round:.2f} | {r.peak_rss / GIB:.2f} "
            f"| {100 * r.accuracy:.2f}% |"
        )


def print_state_cost(rows: list[Row], params: int, h_bytes: int) -> None:
    """FedDyn's per-client state, and the peak-RSS growth from SAMPLED nodes."""
    many = max(r.clients for r in rows)
    dyn = next(r for r in rows if r.strategy == "feddyn" and r.clients == many)
    print(
        f"\nFedDyn h_k per client: {params:,} float32 parameters, "
        f"{h_bytes:,} bytes ({h_bytes / MIB:.2f} MiB) in its node's context.state"
    )
    print(
        f"clients holding h_k after {dyn.rounds} rounds: {dyn.trained} (at most "
        f"{SAMPLED} x {dyn.rounds}): {dyn.trained * h_bytes / MIB:.1f} MiB"
    )
    print(
        f"all {many:,} clients, once each has trained: "
        f"{many * h_bytes / GIB:.2f} GiB in the simulation process"
    )
    print(f"server h (float64): {params * 8 / MIB:.2f} MiB, one for the run")
    for strategy in STRATEGIES:
        peak = {r.clients: r.peak_rss for r in rows if r.strategy == strategy}
        print(
            f"{strategy} peak RSS, {many:,} vs {SAMPLED} clients: "
            f"{(peak[many] - peak[SAMPLED]) / GIB:+.2f} GiB"
        )


def main() -> None:
    started = time.monotonic()
    args = parse_args()
    configs = [
        run_config(args, strategy, clients)
        for clients in (args.clients, SAMPLED)
        for strategy in STRATEGIES
    ]
    with tempfile.TemporaryDirectory(prefix="pollen-scale-") as tmp:
        os.environ[CACHE_ENV] = str(Path(tmp) / "cache")  # inherited by the runs
        params, h_bytes = h_k_size(settings_of(as_text(configs[1])))
        federated_data(
            settings_of(as_text(configs[-1]))
        )  # the baseline's shards, cached
        rows = [measure_run(config, Path(tmp)) for config in configs]
    print_table(rows)
    print_state_cost(rows, params, h_bytes)
    print(f"\nbenchmark total: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

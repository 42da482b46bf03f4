"""Cross-device scale: start-up, round time and memory as the clients grow.

    .venv/bin/python benchmarks/scale.py [--clients 1000,10000,100000]
        [--sampled 100] [--rounds 20] [--data-set synthetic]
        [--data-root ../shared/data] [--state-memory-mib 16]

Each size runs FedAvg and FedDyn with `--sampled` clients per round, on
FedProx's Synthetic(1, 1) by default (`logreg`, the data set's defaults:
plain SGD at 0.01, batch 10, one epoch), or on an image data set split iid
(`mlp`; MNIST's 60,000 images give up to 60,000 clients). A simulation
starts at most 100 SuperNodes (`launch.SIMULATED_NODES`) that serve every
client between them and are asked nothing at start-up, and a generated
client's examples are made only where it trains, so the clients that are
not sampled should cost nothing but a few bytes each: the round time and
peak memory at the largest size should be those of the smallest. FedDyn's
per-client h_k stays in its node's context up to `state-memory-mib` per
node, beyond that on disk ("state spilled": the clients whose state went
there, as the server says at the run's end).

Synthetic's client sizes are power-law (lognormal), so a round's time
depends on which clients it samples; the table also gives the examples
trained per round and the seconds per 10,000 of them, the cost to compare
across sizes. Round 1 (actors starting) is left out of the means. Peak RSS
is `measure.run_pollen`'s: the whole process tree, shared library pages
counted once per process. Image data and shards are decoded and computed
once, before the runs, into a temporary POLLEN_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord
from measure import PROJECT, run_pollen, settings_of

from pollen.catalog import DATA_SETS
from pollen.settings import Scalar, Settings
from pollen.task.client_state import SPILLED_LINE
from pollen.task.data import CACHE_ENV
from pollen.task.inputs import settings_model
from pollen.task.shards import server_data
from pollen.task.sharing import Sharing

STRATEGIES = ("fedavg", "feddyn")
GIB = 2**30


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
    spilled: int  # clients whose state went to disk at least once
    examples: float  # trained per round, rounds 2.. (mean)

    @property
    def per_10k(self) -> float:
        """Seconds of a round per 10,000 examples trained."""
        return self.mean_round / self.examples * 1e4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--clients", default="1000,10000,100000",
        type=lambda text: [int(n) for n in text.split(",")],
    )  # fmt: skip
    parser.add_argument("--sampled", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--data-set", default="synthetic", choices=sorted(DATA_SETS))
    parser.add_argument(
        "--data-root", type=Path, default=PROJECT.parent / "shared" / "data"
    )
    parser.add_argument("--state-memory-mib", type=float, default=16.0)
    args = parser.parse_args()
    if min(args.clients) < args.sampled:
        parser.error(f"every --clients must be at least --sampled {args.sampled}")
    return args


def run_config(
    args: argparse.Namespace, strategy: str, clients: int
) -> dict[str, Scalar]:
    """One run's overrides: `clients` clients, `--sampled` of them per round."""
    return {
        "strategy": strategy,
        "data-set": args.data_set,
        "data-root": str(args.data_root.resolve()),
        "num-clients": clients,
        "client-frac": args.sampled / clients,
        "min-train-nodes": args.sampled,
        "rounds": args.rounds,
        "model": "logreg" if DATA_SETS[args.data_set].generated else "mlp",
        "state-memory-mib": args.state_memory_mib,
    }


def as_text(config: dict[str, Scalar]) -> str:
    """The overrides as one `-c` value."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())


def h_k_size(settings: Settings) -> tuple[int, int]:
    """(parameters, stored bytes) of one client's FedDyn h_k: zeros shaped as
    the entries `client_app._regularizer` keeps, as the ArrayRecord it stores."""
    model = settings_model(settings, server_data(settings).dataset)
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


def clients_spilled(run_dir: Path) -> int:
    """Clients whose state went to disk, as the server says at the run's end
    (when it removes their spill files)."""
    said = re.search(
        SPILLED_LINE.replace("%d", r"(\d+)"), (run_dir / "flower.log").read_text()
    )
    return int(said[1]) if said else 0


def examples_per_round(run_dir: Path, sizes: list[int]) -> list[int]:
    """The training examples of each round's clients."""
    history = json.loads((run_dir / "history.json").read_text())
    return [sum(sizes[c] for c in record["clients"]) for record in history]


def measure_run(config: dict[str, Scalar], out: Path) -> Row:
    name = f"{config['strategy']}-{config['num-clients']}"
    result = run_pollen([as_text(config)], out, name)
    rounds = result["rounds"]
    later = rounds[1:] or rounds  # round 1 also waits for the actors to start
    examples = examples_per_round(
        out / name, server_data(settings_of(as_text(config))).sizes
    )
    examples = examples[1:] or examples
    return Row(
        strategy=str(config["strategy"]),
        clients=int(config["num-clients"]),
        rounds=len(rounds),
        wall=result["wall"],
        start_up=result["start-up"],
        mean_round=sum(later) / len(later),
        peak_rss=int(result["peak-rss"]),
        accuracy=result["accuracy"],
        trained=clients_trained(out / name),
        spilled=clients_spilled(out / name),
        examples=sum(examples) / len(examples),
    )


def print_table(rows: list[Row], sampled: int) -> None:
    print(
        "| strategy | num-clients | sampled/round | rounds | wall s | start-up s "
        "| mean round s | examples/round | s per 10k examples | peak RSS GiB "
        "| final accuracy | clients trained | state spilled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.strategy} | {r.clients} | {sampled} | {r.rounds} | {r.wall:.1f} "
            f"| {r.start_up:.1f} | {r.mean_round:.2f} | {r.examples:,.0f} "
            f"| {r.per_10k:.2f} | {r.peak_rss / GIB:.2f} | {100 * r.accuracy:.2f}% "
            f"| {r.trained} | {r.spilled} |"
        )


def print_ratios(rows: list[Row]) -> None:
    """Each strategy's largest size against its smallest."""
    for strategy in STRATEGIES:
        mine = sorted(
            (r for r in rows if r.strategy == strategy), key=lambda r: r.clients
        )
        small, large = mine[0], mine[-1]
        print(
            f"{strategy}, {large.clients:,} vs {small.clients:,} clients: round "
            f"{large.mean_round / small.mean_round:.2f}x, per example "
            f"{large.per_10k / small.per_10k:.2f}x, start-up "
            f"{large.start_up - small.start_up:+.1f} s, peak RSS "
            f"{(large.peak_rss - small.peak_rss) / GIB:+.2f} GiB"
        )


def main() -> None:
    started = time.monotonic()
    args = parse_args()
    configs = [
        run_config(args, strategy, clients)
        for clients in args.clients
        for strategy in STRATEGIES
    ]
    with tempfile.TemporaryDirectory(prefix="pollen-scale-") as tmp:
        os.environ[CACHE_ENV] = str(Path(tmp) / "cache")  # inherited by the runs
        params, h_bytes = h_k_size(settings_of(as_text(configs[1])))
        for config in configs[::2]:  # every size's data, decoded and split once
            server_data(settings_of(as_text(config)))
        rows = []
        for config in configs:
            rows.append(measure_run(config, Path(tmp)))
            print(f"measured {config['strategy']} with {config['num-clients']} "
                  "clients", flush=True)  # fmt: skip
    print()
    print_table(rows, args.sampled)
    print()
    print_ratios(rows)
    print(
        f"FedDyn h_k per client: {params:,} float32 parameters, {h_bytes:,} bytes; "
        f"up to {args.state_memory_mib:g} MiB of them in each node's context"
    )
    print(f"\nbenchmark total: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

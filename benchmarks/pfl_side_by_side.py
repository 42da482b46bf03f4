"""pollen and Apple's pfl-research side by side, on one cross-device workload.

    .venv/bin/python benchmarks/pfl_side_by_side.py [--clients 1000]
        [--sampled 100] [--rounds 20] [--pfl-venv ~/.cache/pollen-bench/pfl-venv]
        [--pfl-threads 1] [--cohort]

The workload is FedProx's Synthetic(1, 1) as pollen generates it
(`pollen/task/synthetic.py`, seed 845): `--clients` clients with their
power-law sizes, `--sampled` of them per round for `--rounds` rounds,
multinomial logistic regression (one linear layer, 60 -> 10, pollen's
`logreg`), plain SGD at 0.01 with weight decay 5e-4, local gradients clipped
to norm 10 (pollen's `max-grad-norm`), batch 10, one local epoch, FedAvg
weighted by examples, and the global model evaluated after every round on
pollen's global test set (the test splits of the first 1,000 clients). The
training settings are read from pollen's resolved run config and handed to
pfl, so both run what `pollen run` would.

With `--cohort` pollen runs twice, one client after another (its default)
and with `client-execution = "cohort"` (docs/cohorts.md), the second
sampling the same clients; the table then has three rows.

pollen runs first (`pollen run` through `measure.run_pollen`). Then this
script writes every client's training examples, the global test set,
pollen's initial model, the clients each of pollen's rounds sampled and the
order each of them took its examples in (pollen's seeded `randperm`) to an
.npz, and runs `pfl_synthetic.py` on it with the pfl environment's Python:
both frameworks train the same model from the same weights on the same
clients' same batches each round, so their rounds do the same work
(Synthetic's sizes are power-law, so a round's time depends on whom it
samples) and their accuracies should differ by float rounding only. The
examples are made here, before pfl starts, and their time is printed apart
(pollen makes a client's examples where it trains, inside its rounds).

pfl is installed into a virtual environment of its own, `--pfl-venv`, never
into pollen's: made on first use with `uv venv` and `uv pip install
'pfl[pytorch]==0.6.0'` (pfl 0.6.0 is the version this was written and
measured with) and torch pinned to pollen's version, so uv takes both from
its cache; `--compile-bytecode`, as pollen's environment is compiled. pfl
runs in one process on the CPU with `--pfl-threads` torch threads, one by
default, as each of pollen's ClientApp actors has (pollen runs two, one per
core). Idle, torch's default of one thread per core made pfl's rounds 7%
slower here; while another benchmark kept the cores busy, 20 to 60 times
slower (26 to 84 s a round, not 1.4 s), its threads waiting on each other
over a 60 x 10 layer.

Both frameworks' times are wall-clock: start-up is the command's wall time
(launch to exit) less the sum of its rounds, a round is the time from one
round's end to the next's, evaluation included (pollen's ServerApp times
them; pfl's by the callback that evaluates after each central iteration). Round 1 is left out
of the mean: pollen's starts its actors, and pfl's also evaluates every
client before and after training (pfl does that in the rounds its
`evaluation_frequency` divides, always the first; set so that it is only
the first). Peak RSS is `measure.measure`'s: the whole process tree.

Measured, with the command and the machine: docs/performance.md, "pollen
and pfl-research side by side".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from measure import PROJECT, measure, run_pollen, settings_of

from pollen.settings import Settings
from pollen.task.models import build_model
from pollen.task.synthetic import (
    CLASSES,
    FEATURES,
    SyntheticKey,
    client_examples,
    client_sizes,
    global_test,
    split_size,
)
from pollen.task.train import client_seed

PFL = "pfl[pytorch]==0.6.0"
PFL_SCRIPT = Path(__file__).with_name("pfl_synthetic.py")
DEFAULT_VENV = Path.home() / ".cache" / "pollen-bench" / "pfl-venv"
GIB = 2**30


@dataclass(frozen=True)
class Row:
    """One framework's measured run."""

    framework: str
    wall: float
    start_up: float
    rounds: list[float]
    accuracy: list[float]
    peak_rss: int

    @property
    def mean_round(self) -> float:
        """Mean seconds of rounds 2.. (round 1 alone if there is one)."""
        later = self.rounds[1:] or self.rounds
        return sum(later) / len(later)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--sampled", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--pfl-venv", type=Path, default=DEFAULT_VENV,
        help="pfl's own virtual environment, made here if it lacks pfl",
    )  # fmt: skip
    parser.add_argument(
        "--pfl-threads", type=int, default=1,
        help="torch's CPU threads in pfl's process (pollen: one per actor)",
    )  # fmt: skip
    parser.add_argument(
        "--cohort", action="store_true",
        help="also run pollen with client-execution='cohort', after its default",
    )  # fmt: skip
    args = parser.parse_args()
    if args.clients < args.sampled:
        parser.error(f"--clients must be at least --sampled {args.sampled}")
    return args


def pollen_config(args: argparse.Namespace) -> str:
    """The `pollen run` overrides, as one `-c` value."""
    return (
        f"data-set='synthetic' model='logreg' num-clients={args.clients} "
        f"client-frac={args.sampled / args.clients} "
        f"min-train-nodes={args.sampled} rounds={args.rounds}"
    )


def find_uv() -> str:
    """uv on PATH, else the one beside this Python (pollen's venv has it)."""
    found = shutil.which("uv") or Path(sys.executable).with_name("uv")
    if not Path(found).is_file():
        raise SystemExit("pfl_side_by_side: uv is needed to make pfl's environment")
    return str(found)


def pfl_python(venv: Path) -> Path:
    """The Python of pfl's environment `venv`, made (or completed) with uv
    if it lacks pfl: pfl's PyTorch extra with torch pinned to pollen's,
    compiled to bytecode as pollen's environment is (where
    PYTHONDONTWRITEBYTECODE is set, an uncompiled one would compile torch's
    modules again at every start: 9 s of pfl's start-up here)."""
    python = venv / "bin" / "python"
    has_pfl = python.is_file() and (
        subprocess.run([str(python), "-c", "import pfl.model.pytorch"],
                       capture_output=True).returncode == 0
    )  # fmt: skip
    if not has_pfl:
        uv = find_uv()
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        torch_pin = f"torch=={importlib.metadata.version('torch')}"
        print(f"making pfl's environment {venv}: {PFL}, {torch_pin}", flush=True)
        subprocess.run([uv, "venv", "--python", version, str(venv)], check=True)
        subprocess.run(
            [uv, "pip", "install", "--compile-bytecode", "--python", str(python),
             PFL, torch_pin],
            check=True,
        )  # fmt: skip
    return python


def batch_orders(
    settings: Settings, cohorts: list[list[int]], sizes: list[int]
) -> np.ndarray:
    """Each round's clients' batch orders, one after another (a client's
    positions 0..n-1 in the order it visits them): the permutations pollen's
    `ShuffledBatches` draws from `client_seed(seed, round, client)`, so pfl's
    clients take the same batches as pollen's (one epoch)."""
    orders = [
        torch.randperm(
            sizes[client],
            generator=torch.Generator().manual_seed(
                client_seed(settings.seed, server_round, client)
            ),
        ).numpy()
        for server_round, cohort in enumerate(cohorts, start=1)
        for client in cohort
    ]
    return np.concatenate(orders).astype(np.int32)


def write_workload(settings: Settings, cohorts: list[list[int]], path: Path) -> float:
    """Write what `pfl_synthetic.py` reads (see its docstring) to `path`:
    the clients' training examples, the global test set, pollen's initial
    model, each round's clients and their batch orders. Returns the seconds
    it took."""
    started = time.monotonic()
    key = SyntheticKey(settings.synthetic_alpha, settings.synthetic_beta, settings.seed)
    sizes = [
        split_size(int(size), "train")
        for size in client_sizes(settings.num_clients, settings.seed)
    ]
    parts = [
        client_examples(key, client, "train", size) for client, size in enumerate(sizes)
    ]
    x_test, y_test = global_test(key, settings.num_clients)
    model = build_model(settings.model, (FEATURES, 1, 1), CLASSES, settings.seed)
    linear = model[-1]  # logreg: Flatten, Linear
    np.savez(
        path,
        x=np.concatenate([x for x, _ in parts]),
        y=np.concatenate([y for _, y in parts]),
        offsets=np.cumsum([0, *sizes]),
        x_test=x_test.reshape(-1, FEATURES).numpy(),
        y_test=y_test.numpy(),
        weight=linear.weight.detach().numpy(),
        bias=linear.bias.detach().numpy(),
        cohorts=np.array(cohorts, dtype=np.int64),
        orders=batch_orders(settings, cohorts, sizes),
    )
    return time.monotonic() - started


def run_pfl(
    python: Path, data: Path, settings: Settings, threads: int
) -> tuple[Row, dict]:
    """Run `pfl_synthetic.py` on `data` with pollen's training settings and
    `threads` torch threads: its row and its JSON result, with
    `launch-to-first-round` seconds added."""
    args = [
        str(python), str(PFL_SCRIPT), str(data),
        "--rounds", str(settings.rounds),
        "--lr", str(settings.lr),
        "--batch-size", str(settings.batch_size),
        "--epochs", str(settings.local_epochs),
        "--weight-decay", str(settings.weight_decay),
        "--max-grad-norm", str(settings.max_grad_norm),
        "--test-batch-size", str(settings.test_batch_size),
        "--seed", str(settings.seed),
        "--threads", str(threads),
    ]  # fmt: skip
    # pfl's environment alone: nothing of pollen's on its module path
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    launched = time.time()
    wall, peak, result = measure(args, cwd=PROJECT, env=env)
    # the last JSON line: pfl or torch may have logged on the same stream
    line = [t for t in result.stdout.splitlines() if t.startswith("{")][-1]
    out = json.loads(line)
    out["launch-to-first-round"] = out["started"] - launched
    row = Row(
        "pfl", wall, wall - sum(out["rounds"]), out["rounds"], out["accuracy"], peak
    )
    return row, out


def run_pollen_side(
    config: str, out: Path, name: str = "pollen"
) -> tuple[Row, list[list[int]]]:
    """One `pollen run`: its row (named `name`) and the clients each of its
    rounds trained."""
    result = run_pollen([config], out, name)
    history = json.loads((out / name / "history.json").read_text())
    row = Row(
        name, result["wall"], result["start-up"], result["rounds"],
        [r["accuracy"] for r in history], result["peak-rss"],
    )  # fmt: skip
    return row, [r["clients"] for r in history]


def check_settings(settings: Settings) -> None:
    """Refuse what pfl's side does not build: another optimiser or momentum."""
    if settings.client_optimizer != "sgd" or settings.momentum != 0.0:
        raise SystemExit("pfl_side_by_side: pfl's side trains plain SGD, momentum 0")


def print_table(rows: list[Row], versions: dict[str, str]) -> None:
    print(
        "| framework | version | wall s | start-up s | mean round s (2..N) "
        "| final accuracy | peak RSS GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.framework} | {versions[r.framework]} | {r.wall:.1f} "
            f"| {r.start_up:.1f} | {r.mean_round:.2f} "
            f"| {100 * r.accuracy[-1]:.2f}% | {r.peak_rss / GIB:.2f} |"
        )


def main() -> None:
    args = parse_args()
    config = pollen_config(args)
    settings = settings_of(config)
    check_settings(settings)
    python = pfl_python(args.pfl_venv.expanduser())
    with tempfile.TemporaryDirectory(prefix="pollen-pfl-") as tmp:
        pollen_rows = [run_pollen_side(config, Path(tmp))]
        if args.cohort:
            pollen_rows.append(
                run_pollen_side(
                    f"{config} client-execution='cohort'", Path(tmp), "pollen-cohort"
                )
            )
        (_, cohorts), *others = pollen_rows
        if any(sampled != cohorts for _, sampled in others):
            raise SystemExit(
                "pfl_side_by_side: pollen's two runs sampled other clients"
            )
        data = Path(tmp) / "synthetic.npz"
        prepared = write_workload(settings, cohorts, data)
        pfl, out = run_pfl(python, data, settings, args.pfl_threads)
    pollen_version = (
        f"{importlib.metadata.version('pollen-fl')} "
        f"(flwr {importlib.metadata.version('flwr')}), torch {torch.__version__}"
    )
    versions = {
        "pollen": pollen_version,
        "pollen-cohort": pollen_version,
        "pfl": f"{out['pfl']}, torch {out['torch']}",
    }
    print(f'`pollen run -c "{config}"`; pfl\'s examples made in {prepared:.1f} s')
    print(f"pfl: launch to first round {out['launch-to-first-round']:.1f} s")
    rows = [row for row, _ in pollen_rows] + [pfl]
    print_table(rows, versions)
    for r in rows[:-1]:
        print(
            f"{r.framework}: {pfl.mean_round / r.mean_round:.2f}x pfl's round throughput"
        )
    for r in rows:
        curve = " ".join(f"{100 * a:.1f}" for a in r.accuracy)
        print(f"{r.framework} accuracy by round (%): {curve}")


if __name__ == "__main__":
    main()

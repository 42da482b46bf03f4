"""Deployed rounds against simulated ones for the same work, with Flower's idle
waits and with pollen's SuperNode poll interval, side by side in one
invocation.

    .venv/bin/python benchmarks/deployed_rounds.py [--rounds 10] [--cnn-rounds 6]
        [--subset 60000] [--cnn-subset 12000] [--idle 20] [--workloads NAME ...]
        [--ways sim flower pollen memory] [--repeat 1]
        [--data-root ../shared/data] [--out bench-out/deployed-rounds]

Workloads (seed 845, one local epoch, batch 32, every client in every round,
one shard per node): `mlp` on MNIST (all 60,000 training images) with 2 and
with 8 SuperNodes, and `cnn` on the first 12,000 Fashion-MNIST training
images with 4; the server evaluates on 2,000 test images. Each runs four
ways, one after the other: simulated (`pollen run`); deployed with Flower's
SuperNode and SuperLink as they ship (`pollen deploy up --poll-interval 0
--pull-hold 0`: 3 s idle sleep, every pull answered at once,
0.5 s reply checks, 1 s first object-pull retry); deployed with `pollen
supernode` and `pollen superlink` (the default); and the same with the SuperLink's state in memory
(`--superlink-state memory`) instead of its SQLite file. Deployments are
`pollen deploy up` on this machine (TLS, SuperNode authentication, warm
executors). `--ways` keeps some of the four (by the names above: sim,
flower, pollen, memory); `--repeat N` plays the ways of a workload N times
in turn (A B A B ...), each compared with the simulation of its own turn:
this machine's speed drifts over minutes, and alternating shows how much.

Per way: the mean round of rounds 2..R (round 1 holds the start-up query and
the warm-up); the time per round outside every ClientApp task (from round
2's first train message pulled to round R's: wall time minus the union of
the tasks' launch-to-exit spans, the warm executors' log); per task, its
launch-to-exit time minus the ClientApp handler's own work; the CPU-s the
whole machine spent busy per round over rounds 2..R (every process: the
SuperLink, nodes, executors, tasks, ServerApp, Ray, this script's own
watchers), and that divided by the cores: no round can be shorter while
the processes do that work, so where a deployed round's bound exceeds 1.5x
the simulated round, removing waits cannot reach it; and, for the 8-node
deployments, the CPU the SuperLink and a SuperNode use while the
deployment stands idle for `--idle` seconds before the run.

Writes `<out>/deployed-rounds.md` (the table) and `<out>/deployed-rounds.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from executors import COMMON, PROJECT, Sampling, deployed, median, pollen_run
from measure import busy_cpu_seconds
from poll_cost import cpu_seconds

CORES = os.cpu_count() or 1
# (label, name in file names, poll interval: None simulates, 0 is Flower's;
# where the SuperLink keeps its state)
WAYS = (
    ("simulated", "sim", None, ""),
    ("Flower's waits", "flower", 0.0, "file"),
    ("pollen supernode", "pollen", 0.1, "file"),
    ("pollen supernode, SuperLink in memory", "memory", 0.1, "memory"),
)


def subset(source: Path, target: Path, name: str, train: int) -> Path:
    """`target/name.npz`: the first `train` training and 2,000 test images."""
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{name}.npz"
    if not path.exists():
        with np.load(source / f"{name}.npz") as full:
            np.savez(path, x_train=full["x_train"][:train], y_train=full["y_train"][:train],
                     x_test=full["x_test"][:2000], y_test=full["y_test"][:2000])  # fmt: skip
    return target


def union_within(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one of `spans`."""
    covered, reach = 0.0, start
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered


def outside_tasks(result: dict) -> float:
    """Mean seconds per round, rounds 2..R-1, when no ClientApp task ran."""
    starts = [min(node[r][0] for node in result["train_spans"])
              for r in range(min(len(n) for n in result["train_spans"]))]  # fmt: skip
    start, end = starts[1], starts[-1]
    busy = union_within([tuple(s) for s in result["task_spans"]], start, end)
    return (end - start - busy) / (len(starts) - 2)


# the deployment's processes by what their command line holds, in groups
# (a warm executor's reaped tasks count in its CPU: /proc's cutime)
GROUPS = {
    "SuperLink and ServerApp": ("flower-superlink", "superlink-home", "flwr-serverapp"),
    "SuperNodes": ("pollen supernode",),
    "executors and tasks": ("pollen superexec", "flower_superexec"),
}


class RoundCpu(Sampling):
    """The machine's busy CPU (all processes, from /proc/stat) while a run
    plays its rounds, and that of each group of a deployment's processes:
    sampled every 0.05 s beside the number of rounds the run's history.json
    holds, so rounds 2..R are timed the same way for a simulation and a
    deployment (round 1 holds the start-up)."""

    def __init__(self, history: Path) -> None:
        self.history = history
        # (rounds recorded, busy CPU-s of the machine, of each group)
        self.samples: list[tuple[int, float, dict[str, float]]] = []
        self.pids: dict[str, list[int]] | None = None  # found once round 1 is in
        self.rounds = 0

    def sample(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # not written yet
            self.rounds = len(json.loads(self.history.read_text()))
        if self.rounds and self.pids is None:
            self.pids = _grouped_pids()
        groups = {name: sum(cpu_seconds(pid) for pid in pids)
                  for name, pids in (self.pids or {}).items()}  # fmt: skip
        self.samples.append((self.rounds, busy_cpu_seconds(), groups))

    def per_round(self) -> dict[str, float]:
        """CPU-s per round, rounds 2..R: the machine's ("all") and each
        group's."""
        last = next(s for s in self.samples if s[0] == self.samples[-1][0])
        first = next(
            s for s in self.samples if s[0] >= 1 and s[2].keys() == last[2].keys()
        )
        rounds = last[0] - first[0]
        if rounds < 1:
            raise ValueError(f"{self.history}: rounds 2..R need 2 rounds or more")
        return {"all": (last[1] - first[1]) / rounds,
                **{g: (last[2][g] - first[2][g]) / rounds for g in first[2]}}  # fmt: skip


def _grouped_pids() -> dict[str, list[int]]:
    """The running processes of each of `GROUPS` (none in a simulation). A
    warm task running at this scan counts its own CPU until it ends, then in
    its parent's (reaped children's time): each CPU-s counts once."""
    found: dict[str, list[int]] = {name: [] for name in GROUPS}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (
                (entry / "cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue  # ended since the listing
        for name, marks in GROUPS.items():
            if any(mark in command for mark in marks):
                found[name].append(int(entry.name))
                break
    return found if any(found.values()) else {}


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # deployments come down
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="MNIST rounds")
    parser.add_argument(
        "--cnn-rounds", type=int, default=6, help="Fashion-MNIST rounds"
    )
    parser.add_argument(
        "--subset", type=int, default=60000, help="MNIST training images"
    )
    parser.add_argument(
        "--cnn-subset", type=int, default=12000, help="Fashion-MNIST training images"
    )
    parser.add_argument("--idle", type=float, default=20.0, help="idle CPU window (s)")
    parser.add_argument(
        "--workloads", nargs="+", default=None, metavar="NAME",
        help="only these (mnist-mlp-2 mnist-mlp-8 fmnist-cnn-4)",
    )  # fmt: skip
    parser.add_argument(
        "--ways", nargs="+", default=[w[1] for w in WAYS], metavar="WAY",
        choices=[w[1] for w in WAYS], help="only these ways (sim is always kept)",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=1, help="turns through the ways, alternated"
    )
    parser.add_argument(
        "--data-root", type=Path, default=PROJECT.parent / "shared" / "data"
    )
    parser.add_argument(
        "--out", type=Path, default=PROJECT / "bench-out" / "deployed-rounds"
    )
    args = parser.parse_args()
    if min(args.rounds, args.cnn_rounds) < 4:
        parser.error("--rounds and --cnn-rounds: at least 4 (rounds 2..R-1 are timed)")
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    ways = [w for w in WAYS if w[1] in {"sim", *args.ways}]
    # (label in the table, suffix of the run's name) of each turn
    turns = [(f" (turn {t})", f"-{t}") if args.repeat > 1 else ("", "")
             for t in range(1, args.repeat + 1)]  # fmt: skip
    out = args.out.resolve()
    data = subset(args.data_root, out / "data", "mnist", args.subset)
    subset(args.data_root, out / "data", "fashion_mnist", args.cnn_subset)
    workloads = [
        ("mnist-mlp-2", 2, f"data-set='mnist' model='mlp' rounds={args.rounds}"),
        ("mnist-mlp-8", 8, f"data-set='mnist' model='mlp' rounds={args.rounds}"),
        ("fmnist-cnn-4", 4, f"data-set='fashion-mnist' model='cnn' rounds={args.cnn_rounds}"),
    ]  # fmt: skip
    if args.workloads:
        workloads = [w for w in workloads if w[0] in args.workloads]
    results: dict[str, dict] = {}
    for (workload, nodes, config), (turn, suffix) in itertools.product(
        workloads, turns
    ):
        config = f"{config} data-root='{data}' num-clients={nodes} {COMMON}"
        for way, slug, poll, state in ways:
            name = f"{workload}-{slug}{suffix}"
            with RoundCpu(out / name / "history.json") as cpu:
                if poll is None:
                    rows = pollen_run(config, out, name, None)
                    result = {"rounds": [r["seconds"] for r in rows],
                              "accuracy": rows[-1]["accuracy"]}  # fmt: skip
                else:
                    idle = args.idle if nodes == 8 else 0.0
                    result = deployed(out, name, nodes, "warm", config, node_poll=poll,
                                      idle_seconds=idle, superlink_state=state)  # fmt: skip
                    result["outside"] = outside_tasks(result)
            result["cpu_per_round"] = cpu.per_round()
            results[f"{workload}/{way}{turn}"] = result
            print(name, f"{statistics.mean(result['rounds'][1:]):.2f} s/round",
                  flush=True)  # fmt: skip
            (out / "deployed-rounds.json").write_text(json.dumps(results, indent=1))
    table = render(results, workloads, ways, [label for label, _ in turns])
    (out / "deployed-rounds.md").write_text(table)
    print(table)


def render(
    results: dict[str, dict],
    workloads: list[tuple[str, int, str]],
    ways: list[tuple[str, str, float | None, str]],
    turns: list[str],
) -> str:
    lines = [
        "| workload | SuperNodes | way | mean round 2.. (s) | / simulated | outside tasks per round (s) | per task: launch -> exit minus work (s, median) | machine CPU-s a round | its lower bound on the round (s) | of the CPU-s: " + " / ".join(GROUPS) + " | idle CPU: SuperLink / a SuperNode | final accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for (workload, nodes, _), turn in itertools.product(workloads, turns):
        simulated = statistics.mean(
            results[f"{workload}/simulated{turn}"]["rounds"][1:]
        )
        for way, _, poll, _ in ways:
            r = results[f"{workload}/{way}{turn}"]
            mean = statistics.mean(r["rounds"][1:])
            outside = task = idle = "-"
            if poll is not None:
                outside = f"{r['outside']:.2f}"
                task = f"{median([w - a for w, a in r['tasks']]):.2f}"
                if "superlink_idle_cpu" in r:
                    idle = (f"{r['superlink_idle_cpu']:.1%} / "
                            f"{r['supernode_idle_cpu']:.1%}")  # fmt: skip
            cpu = r["cpu_per_round"]
            parts = (
                " / ".join(f"{cpu[g]:.2f}" for g in GROUPS) if poll is not None else "-"
            )
            lines.append(
                f"| {workload} | {nodes} | {way}{turn} | {mean:.2f} | {mean / simulated:.2f}x | "
                f"{outside} | {task} | {cpu['all']:.2f} | {cpu['all'] / CORES:.2f} | "
                f"{parts} | {idle} | {r['accuracy']:.2%} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

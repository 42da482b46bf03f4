"""A round's local training on one node, cohort against sequential, side by side.

    .venv/bin/python benchmarks/cohort.py [--data-root ../shared/data]
        [--repeat 3] [--workloads synthetic-logreg,fmnist-mlp,...]
        [--memory-mib 0,64,16]

Each workload is one node serving every client sampled in a round. Both
arms call the ClientApp's own handlers on the same messages, from the same
global model: `sequential` is `client_app.train` once per client (what a
node does today, one message after another), `cohort` is
`client_app.train_cohort` once on the node's packed message (every client
trained as one vectorised computation, `pollen/task/cohort.py`). So both
include what a node does around the training (assembling each client's
model, keeping its state, building its reply); `training` is the part of
it spent training (the replies' `train-seconds`, summed). The arms
alternate, `--repeat` times each, after one untimed call of each (data
loading, first-use imports); the table shows the arms' medians, and the
median (and range) of the ratios of each sequential call to the cohort
call right after it: on a shared VM whose speed drifts within minutes, a
ratio of calls seconds apart is steadier than one of medians.

`--end-to-end` runs whole `pollen run`s instead, each both ways and
alternated: the 100,000-client Synthetic(1, 1) example (100 clients a round,
20 rounds) and NIID-Bench's Fashion-MNIST protocol
(configs/niid-bench-fmnist.toml, 3 of its rounds: each is 10 local epochs);
it prints each run's wall time, its mean round after the first and its
final accuracy.

`--memory-mib` repeats the cohort arm of the first workload under those
`cohort-memory-mib` bounds (0: no memory bound, the CPU's chunk bound
still applies; `sequential`: the sequential arm
instead), each in a fresh process, and
prints how far the process's resident memory rose during that round
(above what it held before, sampled every 2 ms) beside its time: what the
chunk setting trades.

The workloads are issue 49's: Synthetic(1, 1) `logreg` with 100 clients a
round, Fashion-MNIST `mlp` at batch 10 with 100 Dirichlet(0.3) clients,
`cnn-gn` and `cnn` (BatchNorm) at batch 32 with 50 clients. Measured
numbers, with the command, the date and the machine's load:
docs/performance.md, "Cohorts".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(PROJECT), str(PROJECT / "benchmarks")]

WORKLOADS = {
    "synthetic-logreg": {
        "data-set": "synthetic", "model": "logreg", "num-clients": 100,
        "batch-size": 10, "lr": 0.01, "local-epochs": 1,
    },
    "fmnist-mlp": {
        "data-set": "fashion-mnist", "model": "mlp", "num-clients": 100,
        "partition": "niid", "alpha": 0.3, "batch-size": 10, "lr": 0.01,
        "local-epochs": 1,
    },
    "fmnist-cnn-gn": {
        "data-set": "fashion-mnist", "model": "cnn-gn", "num-clients": 50,
        "partition": "niid", "alpha": 0.3, "batch-size": 32, "lr": 0.01,
        "local-epochs": 1,
    },
    "fmnist-cnn": {
        "data-set": "fashion-mnist", "model": "cnn", "num-clients": 50,
        "partition": "niid", "alpha": 0.3, "batch-size": 32, "lr": 0.01,
        "local-epochs": 1,
    },
}  # fmt: skip


def workload_config(workload: str, data_root: str, memory_mib: float = 1024) -> dict:
    """The run config of `workload`: every client on one node, in a cohort."""
    return {
        **WORKLOADS[workload], "client-frac": 1.0, "device": "cpu",
        "data-root": data_root, "download": False, "client-execution": "cohort",
        "cohort-memory-mib": memory_mib,
    }  # fmt: skip


def run_config(config: dict) -> dict:
    """`config` resolved as `pollen run` resolves it."""
    from pollen.settings import Settings

    return Settings.from_run_config(config).to_run_config()


class Node:
    """One simulated node serving every client of `config`, and its round's
    messages (from the global model, as the server sends them)."""

    def __init__(self, config: dict) -> None:
        from flwr.app import ArrayRecord, Context, MessageType, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        from pollen.common.cohorts import pack
        from pollen.protocol import LR
        from pollen.settings import Settings
        from pollen.strategies.strategy import addressed
        from pollen.task.inputs import settings_model
        from pollen.task.shards import server_data

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        settings = Settings.from_run_config(config)
        model = settings_model(settings, server_data(settings).dataset)
        clients = list(range(settings.num_clients))
        owner = dict.fromkeys(clients, 1)
        arrays = ArrayRecord(model.state_dict())
        self.messages = addressed(
            MessageType.TRAIN, clients, arrays, {LR: settings.lr}, 1, owner
        )
        self.packed = pack(self.messages)[0]
        self.config = config
        self.new_context = lambda: Context(1, 1, {}, RecordDict(), config)

    def sequential(self) -> tuple[float, float]:
        from pollen import client_app

        context = self.new_context()
        started = time.perf_counter()
        replies = [client_app.train(m, context) for m in self.messages]
        wall = time.perf_counter() - started
        return wall, sum(r.content["metrics"]["train-seconds"] for r in replies)

    def cohort(self) -> tuple[float, float]:
        from pollen import client_app

        context = self.new_context()
        started = time.perf_counter()
        reply = client_app.train_cohort(self.packed, context)
        wall = time.perf_counter() - started
        seconds = [v["train-seconds"] for k, v in reply.content.items()
                   if k.endswith("/metrics")]  # fmt: skip
        return wall, sum(seconds)


def refused(config: dict) -> str | None:
    from pollen.settings import Settings, SettingsError

    try:
        Settings.from_run_config(config)
    except SettingsError as err:
        return str(err)
    return None


def compare(workload: str, data_root: str, repeat: int) -> str:
    config = workload_config(workload, data_root)
    if why := refused(config):
        return f"| {workload} | refused: {why} | | | | |"
    node = Node(run_config(config))
    node.sequential(), node.cohort()  # untimed: loads data, imports
    times: dict[str, list[tuple[float, float]]] = {"sequential": [], "cohort": []}
    for _ in range(repeat):
        times["sequential"].append(node.sequential())
        times["cohort"].append(node.cohort())
    seq_wall = statistics.median(w for w, _ in times["sequential"])
    coh_wall = statistics.median(w for w, _ in times["cohort"])
    seq_train = statistics.median(t for _, t in times["sequential"])
    coh_train = statistics.median(t for _, t in times["cohort"])
    pairs = list(zip(times["sequential"], times["cohort"], strict=True))
    walls = sorted(s[0] / c[0] for s, c in pairs)
    training = statistics.median(s[1] / c[1] for s, c in pairs)
    clients, batch = config["num-clients"], config["batch-size"]
    return (
        f"| {workload} | {clients} x batch {batch} | {seq_wall:.2f} ({seq_train:.2f}) "
        f"| {coh_wall:.2f} ({coh_train:.2f}) | **{statistics.median(walls):.1f}x** "
        f"({walls[0]:.1f}-{walls[-1]:.1f}) | {training:.1f}x |"
    )


END_TO_END = {
    "synthetic-100k": [
        "data-set='synthetic' model='logreg' num-clients=100000 client-frac=0.001 "
        "rounds=20"
    ],
    "niid-bench-fmnist": [str(PROJECT / "configs" / "niid-bench-fmnist.toml"), "rounds=3"],
}  # fmt: skip


def end_to_end(data_root: str, out: Path) -> None:
    """Each END_TO_END run with and without cohorts, alternated; a table row each."""
    from measure import run_pollen

    print("| run | execution | wall s | mean round s (2nd on) | final accuracy |")
    print("|---|---|---|---|---|")
    for name, config in END_TO_END.items():
        for execution in ("sequential", "cohort"):
            args = [*config, f"data-root='{data_root}' client-execution='{execution}'"]
            r = run_pollen(args, out, f"{name}-{execution}")
            later = statistics.mean(r["rounds"][1:])
            print(f"| {name} | {execution} | {r['wall']:.1f} | {later:.2f} "
                  f"| {r['accuracy']:.2%} |", flush=True)  # fmt: skip


def rss_mib() -> float:
    """This process's resident memory now, in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_arm(workload: str, data_root: str, memory_mib: str) -> None:
    """One cohort round under `memory_mib` in this process, after an untimed
    one: prints JSON with its seconds and how far its resident memory rose
    above what the process held before it (sampled every 2 ms; glibc's
    freed heap is handed back first, so the rise is this round's own)."""
    sequential = memory_mib == "sequential"
    bound = 0.0 if sequential else float(memory_mib)
    node = Node(run_config(workload_config(workload, data_root, bound)))
    arm = node.sequential if sequential else node.cohort
    arm()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back: a true baseline
    before, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    wall, _ = arm()
    done.set()
    sampler.join()
    rise = max(peak[0], rss_mib()) - before
    print(json.dumps({"memory-mib": memory_mib, "seconds": wall, "rise-mib": rise}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(PROJECT.parent / "shared" / "data"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--memory-mib", default="")
    parser.add_argument("--end-to-end", action="store_true")
    parser.add_argument("--memory-arm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.memory_arm is not None:
        memory_arm(workloads[0], args.data_root, args.memory_arm)
        return
    load = os.getloadavg()[0]
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load {load:.2f}"
    )
    if args.end_to_end:
        with tempfile.TemporaryDirectory() as out:
            end_to_end(args.data_root, Path(out))
        return
    print("| workload | clients | sequential s (training) | cohort s (training) "
          "| ratio | training ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for workload in workloads:
        print(compare(workload, args.data_root, args.repeat), flush=True)
    if args.memory_mib:
        print("\n| cohort-memory-mib | round s | RSS rise MiB |\n|---|---|---|")
        for mib in args.memory_mib.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--workloads", workloads[0],
                 "--data-root", args.data_root, "--memory-arm", mib],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]  # fmt: skip
            r = json.loads(out)
            print(f"| {r['memory-mib']} | {r['seconds']:.2f} | {r['rise-mib']:.0f} |")


if __name__ == "__main__":
    main()

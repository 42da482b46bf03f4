"""Warm against cold ClientApp executors, and deployed rounds against the
simulation's, side by side in one invocation.

    .venv/bin/python benchmarks/executors.py [--nodes 2 4] [--rounds 10]
        [--cifar-rounds 3] [--cifar-train 2500] [--data-root ../shared/data]
        [--out bench-out/executors]

Every deployment is `pollen deploy up` on this machine (TLS and SuperNode
authentication), once with warm executors (`pollen superexec`) and once with
Flower's own (`--executor cold`); the same settings also run in simulation.

- Per message: a thread reads each SuperNode's log as it grows (every 10 ms)
  and stamps its lines; "Received successfully" of a train message to the
  next "Sending:" is the time from the SuperNode holding the message to the
  reply ready to push (it includes the SuperNode's own 0.5 s poll for
  replies, for both executors alike). The app's own work is what pollen's
  ClientApp handler took (the warm executor logs it per task); overhead =
  receive-to-send minus that work. Workloads: `mlp` on MNIST (a 6,000-image
  subset, one shard per node) and `cnn` on CIFAR-10 (each node trains on a
  data file of its own with `--cifar-train` images; the server evaluates
  on the 10,000 test images).
- Per round: the run's own round times (history.json), median over rounds
  2..R (round 1 includes the start-up query and the warm-up), for MNIST
  `mlp` with 2 and 4 SuperNodes against the simulation with as many clients.
  The SuperNode's idle poll is shown apart: the gap from a node's "Sent
  successfully" to its next "Receiving:" holds the server's work between
  rounds plus up to 3 s of the SuperNode's fixed sleep.
- Memory: the warm executor's parent RSS, and the PSS of parent + children
  (shared pages counted once) at its peak, sampled every 0.2 s.

Writes `<out>/executors.md` (the tables) and `<out>/executors.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from pollen.deployment import cluster, processes  # noqa: E402
from pollen.deployment.long_poll import PULL_HOLD_SECONDS  # noqa: E402

COMMON = "client-frac=1.0 local-epochs=1 batch-size=32 lr=0.05 seed=845 download=false"
TASK_LINE = re.compile(
    r"task (\d+) exited (-?\d+) after ([\d.]+) s \(app ([\d.na]+) s\)"
)


class Sampling:
    """A daemon thread that calls `sample` every `INTERVAL` seconds while
    inside `with`."""

    INTERVAL = 0.05

    def __enter__(self) -> Sampling:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


@dataclass
class Watch(Sampling):
    """Log lines of a deployment's nodes with the time each was first seen,
    and the peak memory of its warm executors."""

    INTERVAL = 0.01

    deployment: cluster.Deployment
    lines: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    tasks: list[tuple[float, float]] = field(default_factory=list)  # (start, end)
    parent_rss: int = 0
    tree_pss: int = 0
    last_memory: float = 0.0

    def __enter__(self) -> Watch:
        logs = [n.log for n in self.deployment.nodes]
        logs += [n.executor_log for n in self.deployment.nodes if n.executor_pid]
        self._offsets = {log: Path(log).stat().st_size for log in logs}
        super().__enter__()
        return self

    def sample(self) -> None:
        now = time.monotonic()
        for log, offset in self._offsets.items():
            with open(log, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[log] = offset + end
            for line in data[:end].decode(errors="replace").splitlines():
                if log.endswith("-superexec.log"):
                    if task := TASK_LINE.search(line):
                        self.tasks.append((now - float(task.group(3)), now))
                else:
                    self.lines.setdefault(log, []).append((now, line))
        if now - self.last_memory > 0.2:
            self.last_memory = now
            self._sample_memory()

    def _sample_memory(self) -> None:
        for node in self.deployment.nodes:
            if not node.executor_pid:
                continue
            self.parent_rss = max(
                self.parent_rss, _proc_kb(node.executor_pid, "status", "VmRSS")
            )
            pids = [node.executor_pid, *processes.descendants(node.executor_pid)]
            tasks = [p for p in pids if b"flower-superexec" not in _cmdline(p)]
            self.tree_pss = max(
                self.tree_pss, sum(_proc_kb(p, "smaps_rollup", "Pss") for p in tasks)
            )

    def train_spans(self) -> list[list[tuple[float, float]]]:
        """Per node, (Receiving:, Sent successfully) of each train message, in
        order: the node's part of each round, from pulling the message to
        its reply delivered."""
        spans = []
        for lines in self.lines.values():
            node, receiving = [], None
            for at, line in lines:
                if "Receiving: train message" in line:
                    receiving = at
                elif "Sent successfully" in line and receiving is not None:
                    node.append((receiving, at))
                    receiving = None
            spans.append(node)
        return spans

    def message_seconds(self) -> list[float]:
        """Received successfully (train) -> Sending: per message, all nodes."""
        spans = []
        for lines in self.lines.values():
            received, kind = None, ""
            for at, line in lines:
                if "Receiving:" in line:
                    kind = "train" if "train message" in line else "other"
                elif "Received successfully" in line and kind == "train":
                    received = at
                elif "Sending:" in line and received is not None:
                    spans.append(at - received)
                    received = None
        return spans

    def idle_gaps(self) -> list[float]:
        """Sent successfully -> next Receiving:, per node and round."""
        gaps = []
        for lines in self.lines.values():
            sent = None
            for at, line in lines:
                if "Sent successfully" in line:
                    sent = at
                elif "Receiving:" in line and sent is not None:
                    gaps.append(at - sent)
                    sent = None
        return gaps


def idle_cpu(site: cluster.Deployment, seconds: float) -> dict[str, float]:
    """CPU seconds per second of wall time that the SuperLink and the
    SuperNodes (each alone, the mean) used over `seconds` of idleness."""

    def cpu(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    pids = [site.superlink_pid, *(n.pid for n in site.nodes)]
    before = [cpu(p) for p in pids]
    time.sleep(seconds)
    used = [(cpu(p) - b) / seconds for p, b in zip(pids, before, strict=True)]
    return {"superlink_idle_cpu": used[0],
            "supernode_idle_cpu": statistics.mean(used[1:])}  # fmt: skip


def _proc_kb(pid: int, file: str, key: str) -> int:
    """The kB value of `key` in /proc/PID/`file` (status, smaps_rollup); 0
    for a process that is gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def node_rounds(spans: list[list[tuple[float, float]]]) -> list[float]:
    """Per round, the first node's pull of its message to the last node's
    reply delivered: the round without the time its messages waited on the
    SuperLink for a SuperNode to ask (the SuperNode's 3 s idle sleep)."""
    rounds = min(len(node) for node in spans) if spans else 0
    return [
        max(node[r][1] for node in spans) - min(node[r][0] for node in spans)
        for r in range(rounds)
    ]


def task_seconds(deployment: cluster.Deployment) -> list[tuple[float, float]]:
    """(wall, app) seconds per task from the warm executors' logs: launch to
    exit, and the ClientApp handler alone (tasks after each node's first,
    which warms the parent)."""
    seconds = []
    for node in deployment.nodes:
        found = TASK_LINE.findall(Path(node.executor_log).read_text())
        seconds += [(float(wall), float(app)) for *_, wall, app in found[1:]
                    if app != "nan"]  # fmt: skip
    return seconds


def pollen_run(
    config: str, out: Path, name: str, deployment: Path | None
) -> list[dict]:
    command = [str(Path(sys.executable).parent / "pollen"), "run", str(PROJECT),
               "-c", f"{config} output-dir='{out}' run-name='{name}'"]  # fmt: skip
    if deployment is not None:
        command[3:3] = ["--deployment", str(deployment)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{name} failed:\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
        )
    return json.loads((out / name / "history.json").read_text())


def deployed(
    out: Path, name: str, nodes: int, executor: str, config: str,
    node_extra: dict[int, dict[str, str]] | None = None, node_poll: float = 0.0,
    idle_seconds: float = 0.0, superlink_state: str = "file",
) -> dict:  # fmt: skip
    """One deployment, one run; its round times, message spans and memory.
    `node_poll` as `pollen deploy up --poll-interval` (0: Flower's own waits,
    and Flower's SuperLink, answering every pull at once: `--pull-hold 0`);
    with `idle_seconds`, the CPU the SuperLink and the SuperNodes used while
    the deployment stood idle that long before the run."""
    site = cluster.up(
        out / f"site-{name}", nodes, port=processes.free_port(), executor=executor,
        node_extra=node_extra, node_poll=node_poll, superlink_state=superlink_state,
        pull_hold=PULL_HOLD_SECONDS if node_poll else 0.0,
    )  # fmt: skip
    try:
        idle = idle_cpu(site, idle_seconds) if idle_seconds else {}
        with Watch(site) as watch:
            rows = pollen_run(config, out, name, site.root)
        return {
            "rounds": [r["seconds"] for r in rows],
            "accuracy": rows[-1]["accuracy"],
            "messages": watch.message_seconds(),
            "gaps": watch.idle_gaps(),
            "node_rounds": node_rounds(watch.train_spans()),
            "tasks": task_seconds(site) if executor == "warm" else [],
            "task_spans": watch.tasks,
            "train_spans": watch.train_spans(),
            **idle,
            "parent_rss_mb": watch.parent_rss / 1024,
            "tree_pss_mb": watch.tree_pss / 1024,
        }
    finally:
        cluster.down(site.root)


def mnist_subset(source: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    if not (target / "mnist.npz").exists():
        with np.load(source / "mnist.npz") as full:
            np.savez(target / "mnist.npz",
                     x_train=full["x_train"][:6000], y_train=full["y_train"][:6000],
                     x_test=full["x_test"][:2000], y_test=full["y_test"][:2000])  # fmt: skip
    return target


def cifar_node_files(
    data_root: Path, target: Path, nodes: int, train: int
) -> list[Path]:
    """Each node's own CIFAR-10 examples: disjoint `train`-image slices."""
    from pollen.task.data import load_dataset

    dataset = load_dataset("cifar10", data_root, download=False)
    x, y = dataset.x_train.numpy(), dataset.y_train.numpy()
    files = []
    for k in range(nodes):
        path = target / f"cifar-node-{k}.npz"
        if not path.exists():
            part = slice(k * train, (k + 1) * train)
            np.savez(path, x_train=x[part], y_train=y[part])
        files.append(path)
    return files


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # deployments come down
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cifar-rounds", type=int, default=3)
    parser.add_argument("--cifar-train", type=int, default=2500)
    parser.add_argument(
        "--data-root", type=Path, default=PROJECT.parent / "shared" / "data"
    )
    parser.add_argument("--out", type=Path, default=PROJECT / "bench-out" / "executors")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    mnist = mnist_subset(args.data_root, out / "mnist")
    results: dict[str, dict] = {}

    def mnist_config(nodes: int) -> str:
        return (f"data-set='mnist' data-root='{mnist}' model='mlp' num-clients={nodes} "
                f"rounds={args.rounds} {COMMON}")  # fmt: skip

    for nodes in args.nodes:
        config = mnist_config(nodes)
        for executor in ("warm", "cold"):
            name = f"mnist-{nodes}-{executor}"
            results[name] = deployed(out, name, nodes, executor, config)
            print(name, json.dumps(results[name])[:300], flush=True)
        rows = pollen_run(config, out, f"mnist-{nodes}-sim", None)
        results[f"mnist-{nodes}-sim"] = {"rounds": [r["seconds"] for r in rows],
                                         "accuracy": rows[-1]["accuracy"]}  # fmt: skip
    files = cifar_node_files(args.data_root.resolve(), out, 2, args.cifar_train)
    cifar = (f"data-set='cifar10' data-root='{args.data_root.resolve()}' model='cnn' "
             f"num-clients=2 rounds={args.cifar_rounds} {COMMON}")  # fmt: skip
    extra = {k: {"data-file": str(f)} for k, f in enumerate(files)}
    for executor in ("warm", "cold"):
        name = f"cifar-2-{executor}"
        results[name] = deployed(out, name, 2, executor, cifar, extra)
        print(name, json.dumps(results[name])[:300], flush=True)
    (out / "executors.json").write_text(json.dumps(results, indent=1))
    table = render(results, args)
    (out / "executors.md").write_text(table)
    print(table)


def render(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [
        "Per message (2 SuperNodes; seconds, median over train messages)", "",
        "| workload | executor | receive -> send | app work | overhead | child: launch -> exit minus app | parent RSS MB | parent + child PSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for workload, label in (
        ("mnist-2", "`mlp`, MNIST"),
        ("cifar-2", "`cnn`, CIFAR-10"),
    ):
        tasks = results[f"{workload}-warm"]["tasks"]
        work = median([app for _, app in tasks])
        for executor in ("warm", "cold"):
            r = results[f"{workload}-{executor}"]
            span = median(r["messages"])
            child, memory = (
                (f"{median([w - a for w, a in tasks]):.2f}",
                 f"{r['parent_rss_mb']:.0f} | {r['tree_pss_mb']:.0f}")
                if executor == "warm" else ("-", "- | -")
            )  # fmt: skip
            lines.append(f"| {label} | {executor} | {span:.2f} | {work:.2f} | "
                         f"{span - work:.2f} | {child} | {memory} |")  # fmt: skip
    lines += [
        "", f"Per round (MNIST `mlp`, {args.rounds} rounds; seconds, median of rounds 2..)", "",
        "| nodes | simulation | warm | cold | warm / simulation | warm without the pickup wait | that / simulation | cold without it | accuracy sim / warm / cold |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for nodes in args.nodes:
        sim, warm, cold = (
            results[f"mnist-{nodes}-{k}"] for k in ("sim", "warm", "cold")
        )
        s, w, c = (median(r["rounds"][1:]) for r in (sim, warm, cold))
        wn, cn = (median(r["node_rounds"][1:]) for r in (warm, cold))
        lines.append(
            f"| {nodes} | {s:.2f} | {w:.2f} | {c:.2f} | {w / s:.1f}x | {wn:.2f} | "
            f"{wn / s:.1f}x | {cn:.2f} | {sim['accuracy']:.2%} / "
            f"{warm['accuracy']:.2%} / {cold['accuracy']:.2%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""What polling costs a deployment: rounds and CPU per process, checkouts side by side.

    .venv/bin/python benchmarks/poll_cost.py --trees before=DIR this=. [--nodes 2 8]
        [--repeat 2] [--rounds 6] [--data-root ../shared/data] [--out DIR]

Each run is one `pollen deploy up` on this machine (TLS, SuperNode
authentication, warm executors, SuperLink state in memory) and one `pollen
run` on it: `mlp` on the first 6,000 MNIST training images, one shard per
node, seed 845, one local epoch at batch 32, every client in every round.
The runs alternate between the checkouts (`git worktree add DIR <commit>`,
run with this environment and that checkout first on PYTHONPATH), `--repeat`
times per node count. Per run: the mean round from round 2 on, and the CPU
seconds (user + system, from /proc) that the SuperLink, the SuperNodes and
the warm executors with their tasks used from the run's submission to its
end. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its reaped children, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def one_run(nodes: int, rounds: int, data_root: Path, out: Path) -> dict:
    """One deployment and run with the pollen on sys.path (a child's job)."""
    sys.path.insert(0, str(HERE))
    from executors import COMMON, mnist_subset, pollen_run

    from pollen.deployment import cluster, processes

    mnist = mnist_subset(data_root, out.parent / "mnist")
    site = cluster.up(out / "site", nodes, port=processes.free_port(),
                      executor="warm", superlink_state="memory")  # fmt: skip
    try:
        pids = {
            "superlink": [site.superlink_pid],
            "supernodes": [n.pid for n in site.nodes],
            "executors": [n.executor_pid for n in site.nodes],
        }
        before = {k: sum(map(cpu_seconds, v)) for k, v in pids.items()}
        config = (f"data-set='mnist' data-root='{mnist}' model='mlp' "
                  f"num-clients={nodes} rounds={rounds} {COMMON}")  # fmt: skip
        rows = pollen_run(config, out, "run", site.root)
        used = {k: sum(map(cpu_seconds, v)) - before[k] for k, v in pids.items()}
    finally:
        cluster.down(site.root)
    later = [r["seconds"] for r in rows[1:]]
    return {"round": sum(later) / len(later), **used, "accuracy": rows[-1]["accuracy"]}


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # deployments come down
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, metavar="LABEL=DIR")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--data-root", type=Path, default=HERE.parent.parent / "shared" / "data"
    )
    parser.add_argument(
        "--out", type=Path, default=HERE.parent / "bench-out" / "poll-cost"
    )
    parser.add_argument(
        "--one", type=int, help=argparse.SUPPRESS
    )  # a child's node count
    args = parser.parse_args()
    if args.one:
        result = one_run(args.one, args.rounds, args.data_root.resolve(), args.out)
        print(json.dumps(result))
        return
    trees = dict(t.split("=", 1) for t in args.trees)
    print("| nodes | checkout | run | mean round 2.. (s) | CPU s: SuperLink | "
          "SuperNodes | executors and tasks | accuracy |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for nodes in args.nodes:
        for i in range(args.repeat):
            for label, tree in trees.items():
                out = args.out.resolve() / f"{nodes}-{label}-{i}"
                command = [sys.executable, __file__, "--one", str(nodes), "--rounds",
                           str(args.rounds), "--data-root", str(args.data_root.resolve()),
                           "--out", str(out), "--trees", "-"]  # fmt: skip
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                done = subprocess.run(
                    command, env=env, capture_output=True, text=True, check=True
                )
                r = json.loads(done.stdout.splitlines()[-1])
                print(f"| {nodes} | {label} | {i + 1} | {r['round']:.2f} | {r['superlink']:.1f} | "
                      f"{r['supernodes']:.1f} | {r['executors']:.1f} | {r['accuracy']:.2%} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

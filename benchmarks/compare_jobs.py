"""A grid's cells one after another against several at once: `pollen compare --jobs`.

    .venv/bin/python benchmarks/compare_jobs.py [--jobs 2] [--repeat 2]
        [--rounds 10] [--ray-cluster] [--out bench-out/compare-jobs]

Runs one grid of 8 cells (FedAvg, FedProx, SCAFFOLD and FedDyn, seeds 1
and 2, on `digits`, `--rounds` rounds each) with `pollen compare --jobs 1`
and with `--jobs N`, alternated `--repeat` times, each time into a fresh
directory, so every cell runs and every invocation starts its warm
federations. Prints one row per invocation: its wall time (start to exit,
the federations' start-up and the report included), the machine's CPU use
over it (busy CPU-seconds, `measure.busy_cpu_seconds`, over the wall time
times the cores: what else runs on the machine counts too), and whether every cell's history equals the first
`--jobs 1` invocation's in every column but the wall times (`seconds`,
`sim-seconds`: `same_histories.comparable`). Then each arm's median wall time and their ratio.

With `--ray-cluster` the grid runs on a two-node Ray cluster started on this
machine as tests/test_ray_cluster.py starts one (a head and a worker on
loopback, one CPU each), named by `RAY_ADDRESS`: no warm federation starts,
each cell joins the cluster with 1/N of its ClientApp actors. A column then
says how many ClientApp actors the invocation started on each node.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from measure import POLLEN, PROJECT, busy_cpu_seconds, measure
from same_histories import run_histories

sys.path.insert(0, str(PROJECT))

from tests.test_ray_cluster import (
    CLUSTER_START_SECONDS,
    Cluster,
    query,
    ray_cluster,
)

GRID = """
[base]
data-set = "digits"
rounds = {rounds}
[grid]
strategy = ["fedavg", "fedprox", "scaffold", "feddyn"]
seed = [1, 2]
"""


@contextlib.contextmanager
def two_node_cluster(logs: Path) -> Iterator[Cluster]:
    """tests/test_ray_cluster.py's head and worker, once both are up."""
    logs.mkdir(parents=True, exist_ok=True)
    with ray_cluster(logs) as cluster:
        nodes = query(cluster, want=2, seconds=CLUSTER_START_SECONDS)["nodes"]
        if len(nodes) != 2:
            raise RuntimeError(f"the Ray cluster did not come up: {nodes}")
        yield cluster


def actors_per_node(cluster: Cluster) -> Counter[str]:
    """The ClientApp actors the cluster has started so far, by node."""
    actors = query(cluster)["actors"]
    return Counter(node for name, _, node in actors if name == "ClientAppActor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ray-cluster", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=PROJECT / "bench-out" / "compare-jobs"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    grid = args.out / "grid.toml"
    grid.write_text(GRID.format(rounds=args.rounds))
    walls: dict[int, list[float]] = {1: [], args.jobs: []}
    reference: dict[str, list[dict]] | None = None
    print(f"{'jobs':>4} {'repeat':>6} | {'wall s':>7} {'CPU use':>7} | same histories"
          + (" | actors per node" if args.ray_cluster else ""))  # fmt: skip
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.ray_cluster:
            cluster = stack.enter_context(two_node_cluster(args.out / "ray-logs"))
        started: Counter[str] = Counter()
        for repeat in range(1, args.repeat + 1):
            for jobs in walls:
                out = args.out / f"jobs-{jobs}-{repeat}"
                shutil.rmtree(out, ignore_errors=True)
                busy = busy_cpu_seconds()
                wall, _, _ = measure(
                    [POLLEN, "compare", str(grid), str(PROJECT), "--out", str(out),
                     "--jobs", str(jobs)],
                    env=cluster.env if cluster else None,
                )  # fmt: skip
                use = (busy_cpu_seconds() - busy) / (wall * (os.cpu_count() or 1))
                walls[jobs].append(wall)
                cells = run_histories(out)
                reference = reference or cells
                same = "yes" if cells == reference else "NO"
                row = (f"{jobs:>4} {repeat:>6} | {wall:7.1f} {use:7.0%} | {same} "
                       f"({len(cells)} cells)")  # fmt: skip
                if cluster is not None:
                    now = actors_per_node(cluster)
                    row += f" | {sorted((now - started).values(), reverse=True)}"
                    started = now
                print(row, flush=True)
    sequential, parallel = (statistics.median(walls[j]) for j in walls)
    print(
        f"median wall: --jobs 1 {sequential:.1f} s, --jobs {args.jobs} "
        f"{parallel:.1f} s; ratio {parallel / sequential:.2f}"
    )


if __name__ == "__main__":
    main()

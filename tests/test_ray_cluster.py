"""`pollen run` on a real two-node Ray cluster: ClientApps run on both nodes.

Flower's Ray backend calls `ray.init()` without an address, so Ray's own
`RAY_ADDRESS` makes a simulation join an existing cluster instead of starting
a private one. This test starts a head and a worker node on this machine
(loopback only, one CPU each, free ports, a private temp dir), runs a short
simulation with one CPU per ClientApp, and reads from the cluster's GCS that
ClientAppActor actors lived on both nodes: the simulation really spread over
the cluster. It stops only the Ray processes it started (by process group,
never `ray stop`, which would stop every Ray on the machine) and checks that
none is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pollen.deployment.processes import distinct_free_ports, start, stop
from tests.conftest import PROJECT

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"
CLUSTER_START_SECONDS = 180

# Run in a subprocess so that pytest itself never holds a Ray driver. The
# state API needs the dashboard, which is off; the GCS-backed private API
# does not. Prints the alive node IDs (once `want` are alive, or at the
# deadline) and every actor as [class, state, node ID].
QUERY = """
import json, sys, time
import ray
import ray._private.state as state

address, want, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + seconds
while True:
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)
actors = [
    [a["ActorClassName"], a["State"], a["Address"]["NodeID"]]
    for a in state.actors().values()
]
print(json.dumps({"nodes": alive, "actors": actors}))
"""


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    strays: list[int] = field(default_factory=list)


def marked(temp_dir: str) -> list[int]:
    """PIDs of processes whose environment or command line names `temp_dir`."""
    mark, found = temp_dir.encode(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            seen = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
            if mark in seen:
                found.append(int(proc.name))
    return found


def query(cluster: Cluster, want: int = 0, seconds: float = 0) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", QUERY, cluster.address, str(want), str(seconds)],
        env=cluster.env, capture_output=True, text=True, timeout=seconds + 120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@contextlib.contextmanager
def ray_cluster(logs: Path) -> Iterator[Cluster]:
    """A head and a worker node, one CPU each, until the block ends; then
    their process groups are stopped, and any of their processes that
    escaped the groups is killed and listed in `strays`."""
    # Ray's socket paths must stay under ~107 characters: a short temp dir.
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    gcs, client, head_agent, worker_agent = distinct_free_ports(4)
    env = {
        **os.environ,
        "RAY_TMPDIR": temp_dir,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ADDRESS": f"{LOOPBACK}:{gcs}",
    }
    cluster = Cluster(f"{LOOPBACK}:{gcs}", env)
    common = [str(BIN / "ray"), "start", "--block", "--num-cpus=1",
              f"--node-ip-address={LOOPBACK}", "--disable-usage-stats"]  # fmt: skip
    nodes = {
        "head": [*common, "--head", f"--port={gcs}", "--include-dashboard=false",
                 f"--ray-client-server-port={client}",
                 f"--dashboard-agent-listen-port={head_agent}"],
        "worker": [*common, f"--address={cluster.address}",
                   f"--dashboard-agent-listen-port={worker_agent}"],
    }  # fmt: skip
    started: list[subprocess.Popen[bytes]] = []
    try:
        for name, command in nodes.items():
            started.append(start(command, env=env, log=logs / f"ray-{name}.log"))
        yield cluster
    finally:
        for process in reversed(started):  # the worker first, then the head
            stop(process.pid)
        cluster.strays = marked(temp_dir)
        for pid in cluster.strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_simulation_spreads_client_apps_over_a_two_node_cluster(
    tmp_path: Path,
) -> None:
    with ray_cluster(tmp_path) as cluster:
        started = time.monotonic()
        nodes = query(cluster, want=2, seconds=CLUSTER_START_SECONDS)["nodes"]
        logs = "".join(p.read_text()[-2000:] for p in tmp_path.glob("ray-*.log"))
        assert len(nodes) == 2, f"cluster did not come up: {nodes}\n{logs}"
        print(f"cluster up in {time.monotonic() - started:.1f} s")
        run = subprocess.run(
            [str(BIN / "pollen"), "run", str(PROJECT),
             "-c", f"rounds=2 output-dir='{tmp_path}' run-name='cluster'",
             "--federation-config", "client-resources-num-cpus=1"],
            env=cluster.env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        after = query(cluster)
    rows = json.loads((tmp_path / "cluster" / "history.json").read_text())
    assert [r["round"] for r in rows] == [1, 2]
    assert all(len(r["clients"]) == 5 and not r["failures"] for r in rows)
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    actors = after["actors"]
    client_nodes = {node for name, _, node in actors if name == "ClientAppActor"}
    assert client_nodes == set(after["nodes"]) == set(nodes), after
    assert not cluster.strays, f"Ray processes outside node groups: {cluster.strays}"


def compare_on(cluster: Cluster, grid: Path, out: Path, jobs: int) -> str:
    """`pollen compare` of `grid` into `out` with `RAY_ADDRESS` naming
    `cluster`; what it printed."""
    done = subprocess.run(
        [str(BIN / "pollen"), "compare", str(grid), str(PROJECT), "--out", str(out),
         "--jobs", str(jobs)],
        env=cluster.env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_grid_runs_two_cells_at_once_on_the_cluster_as_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pollen compare --jobs 2` with `RAY_ADDRESS`: each cell a SuperLink of
    its own joining the cluster with half its actors (Flower gives each run
    an actor per CPU of the cluster: without the share the two cells started
    four actors on two CPUs, the rest pending), so the two cells' actors are
    one on each node (4 rounds: the cells' actors live at the same time), and
    no warm federation starts; the histories are those of the cells run one
    after another on the cluster."""
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[base]\ndata-set = "digits"\nrounds = 4\nnum-clients = 3\n'
        'client-frac = 1.0\n[grid]\nstrategy = ["fedavg", "scaffold"]\n'
    )
    with ray_cluster(tmp_path) as cluster:
        nodes = query(cluster, want=2, seconds=CLUSTER_START_SECONDS)["nodes"]
        assert len(nodes) == 2, f"cluster did not come up: {nodes}"
        printed = compare_on(cluster, grid, tmp_path / "at-once", jobs=2)
        after = query(cluster)
        compare_on(cluster, grid, tmp_path / "one-by-one", jobs=1)
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    from same_histories import run_histories as histories

    assert "2 at once, each with 1/2 of the ClientApp actors" in printed
    actors = [node for name, _, node in after["actors"] if name == "ClientAppActor"]
    assert sorted(actors) == sorted(nodes), after
    assert not [p for p in (tmp_path / "at-once").iterdir() if "warm" in p.name]
    at_once = histories(tmp_path / "at-once")
    assert sorted(at_once) == ["strategy-fedavg", "strategy-scaffold"]
    assert all(len(rows) == 4 for rows in at_once.values())
    assert at_once == histories(tmp_path / "one-by-one")
    assert not cluster.strays, f"Ray processes outside node groups: {cluster.strays}"

"""`pollen compare --network`: grid cells as real deployments over shaped links.

The deployment tests build namespaces (root and the `ip` command needed) and
skip with `netns_available()`'s reason where they cannot. A comparison names
its networks after its PID (`network_cells.own_names`), so these never meet
another test's network. The rest (the network.json bookkeeping, the checks
made before anything starts) runs anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from pollen.cli import main
from pollen.deployment import cluster, processes
from pollen.deployment.network import netns_available
from pollen.experiments import network_cells
from pollen.network_profile import NetworkProfile
from tests.conftest import PROJECT
from tests.deployed import BIN

# Datacenter-like links, and one slow node: a longer, thinner link and a
# device twice as slow.
PROFILE = """
description = "datacenter links, node 1 slow"
[default]
delay-ms = 1
up-mbit = 1000
down-mbit = 1000
[[group]]
name = "slow"
nodes = [1]
delay-ms = 20
jitter-ms = 2
up-mbit = 20
down-mbit = 50
slowdown = 2
"""
GRID = """
[base]
data-set = "digits"
model = "mlp"
rounds = 1
num-clients = 2
client-frac = 1.0
checkpoint-every = 1
[grid]
strategy = ["fedavg", "fedprox"]
"""
needs_netns = pytest.mark.skipif(
    netns_available() is not None, reason=f"no namespaces: {netns_available()}"
)


def files(tmp_path: Path, grid: str = GRID) -> tuple[Path, Path]:
    (tmp_path / "grid.toml").write_text(grid)
    (tmp_path / "profile.toml").write_text(PROFILE)
    return tmp_path / "grid.toml", tmp_path / "profile.toml"


def namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def deployment_processes(pid: int, besides: Collection[int] = ()) -> list[int]:
    """Descendants of `pid` that belong to a deployment or a network: Flower's
    processes, pollen's executors and runs, the links' relays; `besides`
    those running before (a warm federation this test worker started for
    other tests)."""
    found = []
    for child in processes.descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ours = any(word in argv for word in (b"flower", b"pollen", b"network.py"))
        if ours and child not in besides:
            found.append(child)
    return found


@needs_netns
@pytest.mark.integration
def test_cells_run_as_deployments_record_the_wire_and_leave_nothing(
    tmp_path: Path, capsys
) -> None:
    """One cell deployed over the profile: network.json per node and
    direction, nothing left behind; a second compare keeps the finished cell."""
    grid, profile = files(tmp_path)
    out = tmp_path / "cmp"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out),
            "--network", str(profile)]  # fmt: skip
    before = deployment_processes(os.getpid())
    assert main([*argv, "--only", "strategy=fedavg"]) == 0
    assert "[1/1] strategy-fedavg: final" in capsys.readouterr().out
    run_dir = out / "runs" / "strategy-fedavg"
    recorded = json.loads((run_dir / "network.json").read_text())
    assert recorded["profile"] == NetworkProfile.load(profile).as_dict(2)
    assert recorded["profile-file"] == str(profile.resolve())
    assert [n["node"] for n in recorded["nodes"]] == [0, 1]
    assert all(n["bytes-up"] > 10_000 and n["bytes-down"] > 10_000
               for n in recorded["nodes"])  # fmt: skip
    assert recorded["wall-seconds"] > 0 and recorded["sessions"] == 1
    assert len(recorded["round-seconds"]) == 1
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["network-profile"] == str(profile.resolve())
    prefix, _ = network_cells.own_names(os.getpid())
    assert namespaces(prefix) == []
    site = out / network_cells.DEPLOYMENTS / "strategy-fedavg"
    assert not cluster.Deployment.load(site).running()
    assert deployment_processes(os.getpid(), besides=before) == []

    # a second compare in the same directory keeps the finished cell
    assert main([*argv, "--only", "strategy=fedavg"]) == 0
    assert "[1/1] strategy-fedavg: done before, kept" in capsys.readouterr().out


@needs_netns
@pytest.mark.integration
def test_ctrl_c_in_a_deployed_cell_leaves_nothing_behind(tmp_path: Path) -> None:
    """Ctrl-C while a cell's run is under way: the comparison stops, and its
    processes, relays and namespaces are gone. The cell runs 50 rounds, so
    that it is still under way when Ctrl-C comes (one round of digits can
    end within the test's 3 s wait)."""
    grid, profile = files(tmp_path, GRID.replace("rounds = 1", "rounds = 50"))
    out = tmp_path / "cmp"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out),
            "--network", str(profile), "--only", "strategy=fedprox"]  # fmt: skip
    compare = subprocess.Popen([str(BIN / "pollen"), *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    prefix, _ = network_cells.own_names(compare.pid)
    record = out / network_cells.DEPLOYMENTS / "strategy-fedprox" / cluster.STATE_FILE
    deadline = time.monotonic() + 120
    while not _nodes_up(record) and compare.poll() is None:
        assert time.monotonic() < deadline, "the fedprox deployment did not start"
        time.sleep(0.5)
    time.sleep(3)  # the run is submitted
    running = deployment_processes(compare.pid)
    assert namespaces(prefix) and running
    compare.send_signal(signal.SIGINT)
    output, _ = compare.communicate(timeout=60)
    assert compare.returncode == 130, output
    assert "compare interrupted" in output and "Traceback" not in output
    assert namespaces(prefix) == []
    assert [pid for pid in running if processes.alive(pid)] == []
    assert not cluster.Deployment.load(record.parent).running()


def _nodes_up(record: Path) -> bool:
    try:
        return len(json.loads(record.read_text())["nodes"]) == 2
    except (OSError, ValueError, KeyError):
        return False


def test_a_resumed_cell_adds_its_session_to_network_json(tmp_path: Path) -> None:
    _, profile_file = files(tmp_path)
    profile = NetworkProfile.load(profile_file)
    (tmp_path / "history.json").write_text(json.dumps([{"seconds": 1.5}]))
    session = {
        "wall-seconds": 10.0,
        "nodes": [{"node": 0, "bytes-up": 5, "bytes-down": 7},
                  {"node": 1, "bytes-up": 1, "bytes-down": 2}],
    }  # fmt: skip
    network_cells._record(tmp_path, profile, profile_file, session)
    network_cells._record(tmp_path, profile, profile_file, session)
    recorded = json.loads((tmp_path / "network.json").read_text())
    assert recorded["nodes"] == [
        {"node": 0, "bytes-up": 10, "bytes-down": 14},
        {"node": 1, "bytes-up": 2, "bytes-down": 4},
    ]
    assert recorded["wall-seconds"] == 20.0 and recorded["sessions"] == 2
    assert recorded["round-seconds"] == [1.5]
    network_cells._record(tmp_path / "never-ran", profile, profile_file, session)
    assert not (tmp_path / "never-ran").exists()


def test_names_differ_per_process_and_stay_short() -> None:
    prefix, subnet = network_cells.own_names(4_194_303)  # Linux's largest PID
    assert len(f"{prefix}-h{network_cells.MAX_NODES - 1}") <= 15
    assert network_cells.own_names(1234) != network_cells.own_names(1235)
    assert subnet.startswith("10.") and subnet.endswith(".0/24")


def test_too_many_clients_is_refused_before_anything_starts(
    tmp_path: Path, capsys
) -> None:
    grid, profile = files(tmp_path, GRID.replace("num-clients = 2", "num-clients = 40"))
    out = tmp_path / "cmp"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out),
            "--network", str(profile)]  # fmt: skip
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1
    assert "num-clients=40" in error and "at most 32" in error
    assert not out.exists()
    assert main([*argv, "--simulate", "--dry-run"]) == 0  # simulations may


def test_dry_run_with_a_network_lists_the_cells(tmp_path: Path, capsys) -> None:
    grid, profile = files(tmp_path)
    argv = ["compare", str(grid), str(PROJECT), "--out", str(tmp_path / "cmp"),
            "--network", str(profile), "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"pollen: each cell runs as a deployment over {profile}"
    assert [line.split(":")[0] for line in printed[1:]] == [
        "strategy-fedavg", "strategy-fedprox",
    ]  # fmt: skip
    assert not (tmp_path / "cmp").exists()


# FedBuff over 3 shaped links: node 2's device is 20x slower, so its update
# comes in after versions made of the fast nodes' (real time, Flower's 3 s
# polling included); a node that dies has its message counted as a failure
# after round-timeout, and every accepted update still makes a version.
ASYNC_GRID = """
[base]
data-set = "digits"
model = "mlp"
partition = "iid"
num-clients = 3
local-epochs = 5
strategy = "fedbuff"
concurrency = 3
buffer-size = 2
# enough versions for the slow node's one update: node 0 alone fills a version
# every 2-3 s, node 2's first update took about 15 s (CI, 2026-11-28: with 4
# versions it once came after the last)
rounds = 12
# generous: a node that misses round-timeout once is sent nothing more, and a
# loaded machine stretched the slow node's first reply (20x the training) past
# 25 s, after which it never contributed (CI, stop 39)
round-timeout = 60
[grid]
seed = [1]
"""
ASYNC_PROFILE = """
[default]
delay-ms = 1
up-mbit = 1000
down-mbit = 1000
[[group]]
nodes = [2]
delay-ms = 20
up-mbit = 20
down-mbit = 50
slowdown = 12
"""


@needs_netns
@pytest.mark.integration
def test_fedbuff_deployed_over_shaped_links_survives_a_killed_node(
    tmp_path: Path,
) -> None:
    """Three SuperNodes in namespaces, FedBuff: node 1 is killed (SuperNode
    and executor, SIGKILL) once version 1 is recorded. The run completes
    all 12 versions, each of exactly buffer-size accepted updates (none is
    lost), the slow node's update comes in stale, and the killed node's
    message is recorded as a failure: Flower's "Node Unavailable" once the
    node's heartbeat expires, round-timeout's if that comes first, or unused
    when the run ends before either."""
    (tmp_path / "grid.toml").write_text(ASYNC_GRID)
    (tmp_path / "profile.toml").write_text(ASYNC_PROFILE)
    out = tmp_path / "cmp"
    before = deployment_processes(os.getpid())
    compare = subprocess.Popen(
        [str(BIN / "pollen"), "compare", str(tmp_path / "grid.toml"), str(PROJECT),
         "--out", str(out), "--network", str(tmp_path / "profile.toml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    run_dir = out / "runs" / "seed-1"
    deadline = time.monotonic() + 240
    while not _versions(run_dir):
        assert compare.poll() is None, compare.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no version recorded"
        time.sleep(0.2)
    site = cluster.Deployment.load(out / network_cells.DEPLOYMENTS / "seed-1")
    killed = site.node(1)
    for pid in (killed.pid, killed.executor_pid):
        os.kill(pid, signal.SIGKILL)
    output, _ = compare.communicate(timeout=300)
    assert compare.returncode == 0, output[-3000:]
    rows = json.loads((run_dir / "history.json").read_text())
    assert [r["round"] for r in rows] == list(range(1, 13))
    assert all(len(r["clients"]) == len(r["staleness"]) == 2 for r in rows)
    slow = [s for r in rows for c, s in zip(r["clients"], r["staleness"], strict=True)
            if c == 2]  # fmt: skip
    # version 1 is nodes 0 and 1 while node 2 still trains (12x slower: at 6x,
    # node 1's first reply on a loaded machine once came after node 2's), so
    # node 2's first update is stale; later versions wait for it
    assert slow and max(slow) > 0
    failures = [f for r in rows for f in r["failures"]]
    # "client 1: no reply within round-timeout ..." or "client 1: training ended
    # before its reply was used", or Flower's error for the node ("node N: no
    # reply for 1 of clients [1]: Error: Node Unavailable ...", which came first
    # on a slow machine: CI, 2026-11-29)
    assert any("client 1: " in f or "clients [1]:" in f for f in failures)
    assert deployment_processes(os.getpid(), besides=before) == []


def _versions(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "history.json").read_text()))
    except (OSError, ValueError):
        return 0

"""SecAgg+ on real Flower processes: four SuperNodes started by `pollen
deploy up` (TLS, SuperNode authentication, the warm executor), one killed
in a round after it shared its keys (set up ahead, in the round before):
the round completes from the three survivors, unmasked, the next round sets
itself up without it, and the run completes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pollen.deployment import cluster, processes
from tests.conftest import SHARED_DATA, write_mnist_slices
from tests.deployed import finish, history, submit

NODES = 4
# round 2's shares ride on round 1's unmask reply (set up ahead)
SHARED = "Sending: query.secagg_unmask message"
SENT = "Sent successfully"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (SHARED_DATA / "mnist.npz").exists(),
        reason=f"real MNIST not at {SHARED_DATA}",
    ),
]


def wait_until_sent(
    log: Path, line: str, count: int, run: subprocess.Popen, timeout: float = 300
) -> None:
    """Until the SuperNode's `log` holds `line` `count` times and the last
    of them was sent (Flower logs the sending, then its success); fails at
    once when the run has ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.poll() is None:
        text = log.read_text(errors="replace")
        if text.count(line) >= count and SENT in text.rsplit(line, 1)[1]:
            return
        time.sleep(0.02)
    output = run.stdout.read() if run.poll() is not None and run.stdout else ""
    raise AssertionError(f"{log} never sent {line!r} {count} times\n{output[-3000:]}")


@pytest.mark.xdist_group("deployment")  # not beside the timed shaped-link round
def test_a_node_killed_after_sharing_keys_leaves_a_complete_secure_round(
    tmp_path: Path,
) -> None:
    write_mnist_slices(tmp_path / "data", tmp_path / "unused.npz")
    site = tmp_path / "site"
    deployment = cluster.up(
        site, NODES, port=processes.free_port(), data_root=str(tmp_path / "data")
    )
    try:
        run = submit(
            deployment, tmp_path / "out",
            "secure-aggregation='secagg+' rounds=3 round-timeout=60 "
            "min-available-nodes=3 run-name='secure'", NODES,
        )  # fmt: skip
        victim = deployment.node(1)
        wait_until_sent(Path(victim.log), SHARED, 1, run)  # round 2's shares are out
        os.killpg(victim.pid, signal.SIGKILL)  # the node and its ClientApp
        output = finish(run)
    finally:
        cluster.down(site)
    rows = history(tmp_path / "out" / "secure")
    assert len(rows) == 3 and not any(r["skipped"] for r in rows), output[-3000:]
    first, killed = rows[0]["aggregation"], rows[1]["aggregation"]
    assert first["secagg-survivors"] == NODES and not rows[0]["failures"]
    # round 2: client 1 shared its secrets, then never sent its vector; its
    # masks were removed with the survivors' shares of its mask key
    assert killed["secagg-survivors"] == NODES - 1, rows[1]
    assert killed["secagg-dropped-after-sharing"] == 1, rows[1]
    assert any("no reply for 1 of clients [1]" in f for f in rows[1]["failures"])
    assert rows[1]["accuracy"] > rows[0]["accuracy"] - 0.02
    assert killed["secagg-set-up-ahead"] == 1
    # round 3 could not be set up in round 2 (client 1 sent no keys for it)
    assert rows[2]["aggregation"]["secagg-set-up-ahead"] == 0
    assert rows[2]["aggregation"]["secagg-survivors"] >= NODES - 1
    assert rows[-1]["accuracy"] > 0.8

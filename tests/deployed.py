"""Helpers for tests of real deployments: submit a run to a deployment, wait
for it, read its history."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pollen.deployment import cluster
from pollen.deployment.processes import stop_child
from tests.conftest import PROJECT

BIN = Path(sys.executable).parent


def submit(
    deployment: cluster.Deployment,
    out: Path,
    config: str,
    nodes: int,
    app: Path = PROJECT,
) -> subprocess.Popen:
    """`pollen run APP --deployment` on the deployment's MNIST subset (one
    client per node, one local epoch) with `config` on top."""
    args = [
        str(BIN / "pollen"), "run", str(app), "--deployment", deployment.directory,
        "-c", f"data-set='mnist' data-root='{deployment.root.parent / 'data'}' "
        f"download=false num-clients={nodes} client-frac=1.0 local-epochs=1 "
        f"batch-size=32 lr=0.05 output-dir='{out}'", "-c", config,
    ]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def finish(run: subprocess.Popen, timeout: float = 400) -> str:
    """The run's output once it exited 0; a run that takes longer than
    `timeout` is stopped."""
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_child(run, grace=10)
        raise
    assert run.returncode == 0, output[-4000:]
    return output


def history(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "history.json").read_text())


def wait_for_rounds(run_dir: Path, count: int, run: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        try:
            if len(history(run_dir)) >= count:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"round {count} did not finish")

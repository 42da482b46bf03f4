"""`pollen run`: the defaults of the simulation it starts, and its `flwr` process."""

from __future__ import annotations

import subprocess
import sys

from pollen.cli import CLIENT_CPUS, FLWR_WHEN_TOLD, simulation_federation


def test_simulation_defaults_fill_only_the_keys_not_given() -> None:
    assert simulation_federation([], 7) == [
        "num-supernodes=7",
        f"client-resources-num-cpus={CLIENT_CPUS}",
    ]
    given = ["num-supernodes=3 client-resources-num-gpus=0.5"]
    assert simulation_federation(given, 7) == [
        *given,
        f"client-resources-num-cpus={CLIENT_CPUS}",
    ]
    given = ["client-resources-num-cpus=2", "num-supernodes=10"]
    assert simulation_federation(given, 7) == given


def _flwr_when_told(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", FLWR_WHEN_TOLD, "--version"],
        input=stdin, capture_output=True, timeout=120, check=False,
    )  # fmt: skip


def test_flwr_runs_only_when_told() -> None:
    told = _flwr_when_told(b"run\n")
    assert told.returncode == 0, told.stderr
    assert b"Flower version" in told.stdout
    untold = _flwr_when_told(b"")  # stdin closed: the SuperLink never came up
    assert untold.returncode == 0 and untold.stdout == b""

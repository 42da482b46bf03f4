"""`pollen run`'s defaults for the simulation it starts; the CLI loads without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pollen.cli import CLIENT_CPUS, CliError, simulation_federation


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
    with pytest.raises(CliError, match="invalid --federation-config"):
        simulation_federation(["num-supernodes=three"], 7)


def test_the_cli_loads_without_torch() -> None:
    """`pollen --help`, `run`, `compare` and `deploy` answer without the
    seconds torch's import takes; only `pollen centralized` needs it."""
    probe = "import sys, pollen.cli; print('torch' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"

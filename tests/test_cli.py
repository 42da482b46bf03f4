"""`pollen run`'s defaults for the simulation it starts; the CLI loads without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pollen.deployment.launch import (
    CLIENT_CPUS,
    LaunchError,
    LocalSuperLink,
    simulation_federation,
)


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
    with pytest.raises(LaunchError, match="invalid --federation-config"):
        simulation_federation(["num-supernodes=three"], 7)


@pytest.mark.parametrize("user_value", [None, "1"])
def test_ray_prestarts_no_idle_workers_unless_the_user_says(
    user_value: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulation's environment (the SuperLink's, inherited by Ray) turns
    off Ray's idle workers for a first driver; a value the user set wins."""
    if user_value is None:
        monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    else:
        monkeypatch.setenv("RAY_prestart_worker_first_driver", user_value)
    link = LocalSuperLink()
    try:
        env = link.env
    finally:
        shutil.rmtree(link.home)
    assert env["RAY_prestart_worker_first_driver"] == (user_value or "0")
    assert env["FLWR_HOME"] == str(link.home)


def test_the_cli_loads_without_torch() -> None:
    """`pollen --help`, `run`, `compare` and `deploy` answer without the
    seconds torch's import takes; only `pollen centralized` needs it."""
    probe = "import sys, pollen.cli; print('torch' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"

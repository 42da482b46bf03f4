"""`flwr-simulation` as pollen starts it (`deployment.flower_simulation`):
Flower's actor pool shared out among the runs that use one Ray cluster at
once, computed by Flower's own sizing on a cluster's nodes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pollen.deployment import flower_simulation
from pollen.deployment.flower_simulation import requested_share, share_actor_pool

# two nodes of 3 and 2 CPUs, a third that left (Ray lists it, empty)
NODES = [{"Resources": {"CPU": 3.0}}, {"Resources": {"CPU": 2.0}}, {"Resources": {}}]


@pytest.fixture
def ray_actor(monkeypatch):
    """Flower's actor module on the cluster `NODES`; its sizing restored after."""
    import ray
    from flwr.simulation.ray_transport import ray_actor

    monkeypatch.setattr(ray, "nodes", lambda: NODES)
    monkeypatch.setattr(
        ray_actor, "pool_size_from_resources", ray_actor.pool_size_from_resources
    )
    return ray_actor


def pool_capacity(ray_actor, num_cpus: float) -> int:
    """The actors Flower's pool for a run would start (`actors_capacity`)."""
    pool = ray_actor.BasicActorPool(
        ray_actor.ClientAppActor, {"num_cpus": num_cpus, "num_gpus": 0.0}, {}
    )
    return pool.actors_capacity


@pytest.mark.parametrize(
    ("share", "num_cpus", "flowers", "shared"),
    [(2, 1, 5, 2), (3, 1, 5, 1), (8, 1, 5, 1), (2, 0.5, 10, 5), (2, 2, 2, 1)],
)
def test_a_run_starts_its_share_of_the_actors_flower_would(
    ray_actor, share: int, num_cpus: float, flowers: int, shared: int
) -> None:
    """Flower counts the actors each node holds (3 // c + 2 // c); a run's
    share is that count // share, and never no actor."""
    assert pool_capacity(ray_actor, num_cpus) == flowers
    assert share_actor_pool(share)
    assert pool_capacity(ray_actor, num_cpus) == shared


def test_one_run_on_the_cluster_keeps_flowers_pool(ray_actor) -> None:
    assert not share_actor_pool(1)
    assert pool_capacity(ray_actor, 1) == 5


@pytest.mark.parametrize(
    ("value", "share"),
    [("3", 3), ("1", 1), ("0", 1), ("", 1), ("-2", 1), ("2.5", 1), ("two", 1)],
)
def test_the_share_is_read_from_the_environment(value: str, share: int) -> None:
    """Only a whole number above 1 shares the pool: anything else (set by
    hand) leaves Flower's sizing as it is."""
    assert requested_share({flower_simulation.SHARE_ENV: value}) == share
    assert requested_share({}) == 1


FORGETS = """
import sys
from flwr.simulation import app
from flwr.simulation.ray_transport import ray_actor
def loaded_app():  # what Flower's entry point finds when it loads the ServerApp
    pollen = sorted(m for m in sys.modules if m.split(".")[0] == "pollen")
    shared = hasattr(ray_actor.pool_size_from_resources, "__wrapped__")
    print(pollen, shared)
app.flwr_simulation = loaded_app
from pollen.deployment.flower_simulation import main
main()
"""


@pytest.mark.parametrize("share", ["2", ""])
def test_flower_loads_the_serverapp_with_no_pollen_module_loaded(share: str) -> None:
    """The shim's pollen is the one installed beside Flower; the ServerApp
    must come from the run's FAB (another checkout, an edited copy), as the
    ClientApps do: no `pollen` module is left when Flower starts, and the
    pool's share stays applied."""
    env = {**os.environ, flower_simulation.SHARE_ENV: share}
    done = subprocess.run(
        [sys.executable, "-c", FORGETS], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == f"[] {share == '2'}"
    assert done.stderr == ""

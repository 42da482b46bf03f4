"""`flwr-simulation` as pollen starts it: Flower's own entry point, its
ClientApp actor pool shared out where several runs use one Ray cluster at
once (`share_actor_pool`).

Flower's Ray backend gives a run an actor per CPU (and GPU) of the whole
cluster (`pool_size_from_resources`, from each node's total resources). Two
runs at once on one cluster (`pollen compare --jobs 2` with `RAY_ADDRESS`)
each ask for every CPU: Ray starts the actors it has room for and keeps the
rest pending, and a message given to a pending actor waits until the other
run ends and frees its CPUs. The runs take turns, or, where each holds some
of its actors, wait on each other (tests/test_ray_cluster.py: two cells on
a two-CPU cluster started four actors without this, two with it). With
`POLLEN_RAY_SHARE=k` in its environment a run's pool is Flower's size
divided by k (at least one actor), so k runs at once never ask for more
actors than the cluster holds, and Ray places each where there is room.

A simulation SuperLink's SuperExec starts `flwr-simulation` by name: where
`POLLEN_RAY_SHARE` asks for a share (a comparison's cells on a cluster;
every other simulation runs Flower's own entry point), pollen puts a shim by
that name first on the PATH of the Flower processes it starts
(`flower.flower_env`, `entry_shims`). Where the installed Flower is not a
release the change was verified on, runs size their pools as Flower does
and one warning line says so. Either way the `pollen` modules the shim
imported are dropped before Flower's code runs (`forget_pollen`): the
ServerApp is loaded from the run's FAB, as the ClientApps are.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping

from ..flower_patches import RAY_ACTOR_SHARE, guard

COMMAND = "flwr-simulation"
FLOWER_ENTRY = "flwr.simulation.app:flwr_simulation"
SHARE_ENV = "POLLEN_RAY_SHARE"  # the runs sharing the Ray cluster at once


def requested_share(environ: Mapping[str, str]) -> int:
    """The runs at once that `environ` says share the cluster (1: none
    said, or not a whole number above 1)."""
    text = environ.get(SHARE_ENV, "")
    return int(text) if text.isdigit() and int(text) > 1 else 1


def share_actor_pool(share: int | None = None) -> bool:
    """Make this process's Ray backend start 1/`share` of the actors
    Flower would (at least one; default: the share `POLLEN_RAY_SHARE`
    asks for); whether it does (no change for a share of 1, or on a
    Flower the change was not verified on)."""
    if share is None:
        share = requested_share(os.environ)
    if share <= 1 or not guard(RAY_ACTOR_SHARE):
        return False
    from flwr.simulation.ray_transport import ray_actor

    whole_cluster = ray_actor.pool_size_from_resources

    @functools.wraps(whole_cluster)
    def shared(client_resources: dict[str, int | float]) -> int:
        return max(1, whole_cluster(client_resources) // share)

    ray_actor.pool_size_from_resources = shared
    return True


def forget_pollen() -> None:
    """Drop every `pollen` module this process imported: Flower then loads
    the run's ServerApp from the run's FAB (`importlib`, through
    `sys.path`), not from the `pollen` installed beside Flower, which can be
    another version (another checkout, an edited copy). The actor pool's
    change keeps working: it holds what it needs."""
    for name in [m for m in sys.modules if m == "pollen" or m.startswith("pollen.")]:
        del sys.modules[name]


def main() -> None:
    share_actor_pool()
    forget_pollen()
    from flwr.simulation.app import flwr_simulation

    flwr_simulation()


if __name__ == "__main__":
    main()

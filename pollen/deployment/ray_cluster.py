"""The Ray cluster that `RAY_ADDRESS` names: what it offers, asked before
anything runs on it.

Flower's Ray backend calls `ray.init()` without an address, so a simulation
started with `RAY_ADDRESS` in its environment joins that cluster instead of
starting one (docs/performance.md, "Beyond one machine"). `pollen compare`
runs its cells there and shares the cluster's CPUs out among the cells it
runs at once (`flower_simulation`), so it asks the cluster first: a Ray
driver in a child process (this process never holds one: Ray's driver
state would outlive the question), after a plain TCP connection shows
that something listens at the address (Ray's own client retries an address
where nothing answers for minutes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

ADDRESS_ENV = "RAY_ADDRESS"
CONNECT_SECONDS = 5.0  # for the TCP connection to the cluster's GCS
ASK_SECONDS = 120.0  # for the driver to join and read the cluster's resources
# what Ray says where the driver's machine runs no node of the cluster
# (`ray._private.services.get_node_to_connect_for_driver`)
NOT_A_NODE = "No node info found matching attributes"
_ASK = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
total = ray.cluster_resources()
alive = sum(1 for node in ray.nodes() if node["Alive"])
print(json.dumps({"cpus": total.get("CPU", 0), "nodes": alive}))
"""


class RayClusterError(ValueError):
    """No usable Ray cluster at the address `RAY_ADDRESS` names."""


@dataclass(frozen=True)
class RayCluster:
    """A running Ray cluster: its address and what it offers."""

    address: str
    cpus: int
    nodes: int


def named_cluster(environ: Mapping[str, str]) -> str | None:
    """The cluster address `environ` names (`RAY_ADDRESS`), if any."""
    return environ.get(ADDRESS_ENV) or None


def ask_cluster(address: str) -> RayCluster:
    """The resources of the running cluster at `address` ("host:port", or
    Ray's "auto": the cluster started on this machine); RayClusterError,
    saying what was tried, where none answers."""
    where = f"{ADDRESS_ENV}={address}"
    if address != "auto":
        host, _, port = address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address
        if not host or not port.isdigit() or "/" in address:
            raise RayClusterError(
                f"{where}: not a Ray cluster's address; allowed: HOST:PORT (its "
                "head's GCS port, 6379 by default) or auto"
            )
        try:
            socket.create_connection((host, int(port)), CONNECT_SECONDS).close()
        except OSError as err:
            raise RayClusterError(
                f"{where}: nothing answers there ({err}); start the cluster "
                "(`ray start --head`) or unset RAY_ADDRESS"
            ) from None
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        asked = subprocess.run(
            [sys.executable, "-c", _ASK, address], env=env,
            capture_output=True, text=True, timeout=ASK_SECONDS,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RayClusterError(
            f"{where}: no Ray cluster answered within {ASK_SECONDS:.0f} s"
        ) from None
    if asked.returncode != 0:
        said = (asked.stderr.strip().splitlines() or ["(nothing)"])[-1]
        if NOT_A_NODE in said:
            said = (
                "this machine is not a node of that cluster (a Ray driver joins "
                "through its own machine's node): run this on one of its nodes, "
                "the head say"
            )
        raise RayClusterError(f"{where}: Ray could not join a cluster there: {said}")
    try:
        found = json.loads(asked.stdout.strip().splitlines()[-1])
        return RayCluster(address, int(found["cpus"]), int(found["nodes"]))
    except (IndexError, ValueError, KeyError, TypeError):
        raise RayClusterError(
            f"{where}: the cluster's resources could not be read from what Ray "
            f"printed: {asked.stdout.strip()[-300:]!r}"
        ) from None

"""Grid cells run as real deployments over a shaped network.

`pollen compare GRID --out DIR --network PROFILE` runs each cell as a
deployment on this machine: a `ShapedNetwork` with one network namespace per
client (node k serves partition k), each behind the link the profile gives
node k, a TLS + authenticated SuperLink on the bridge address, SuperNodes
behind `ip netns exec` with the warm executor and the profile's compute
`slowdown` in their node config, and the cell submitted with `pollen run
--deployment`. Everything is torn down after the cell, also after Ctrl-C,
SIGTERM or an error: the processes (`cluster.down`), then the relays,
interfaces and namespaces (the network's exit).

Each cell's run directory gets `network.json`: the profile as applied
(`profile`, `profile-file`), the bytes on the wire per node and direction
(`nodes`, counted on the server's end of each link: headers, TLS and
Flower's own traffic included), the seconds the `pollen run` took
(`wall-seconds`) and the measured seconds of every round (`round-seconds`,
from the run's history), beside the history's predicted `sim-seconds`. A
cell that resumes from a checkpoint adds its session's bytes and seconds to
the ones recorded before (`sessions` counts them); `round-seconds` is
rewritten from the history, which holds every round of the run.

The deployment of a cell (certificates, keys, node state, logs) is kept in
`DIR/deployments/<cell>/`, so a resumed cell's clients find their state.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..deployment import cluster, processes
from ..deployment.network import NetworkError, ShapedNetwork, netns_available
from ..files import write_json
from ..network_profile import NetworkProfile
from ..protocol import SLOWDOWN
from .report import CompareError

MAX_NODES = 32  # one namespace, relay, SuperNode and executor per node
NETWORK_FILE = "network.json"
DEPLOYMENTS = "deployments"


def check_cells(run_configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse, before anything starts, a cell this machine cannot deploy:
    more clients than `MAX_NODES` (one SuperNode per client)."""
    for name, run_config in run_configs.items():
        clients = int(run_config["num-clients"])
        if clients > MAX_NODES:
            raise CompareError(
                f"cell {name}: num-clients={clients} needs {clients} SuperNodes; "
                f"--network deploys at most {MAX_NODES} on one machine "
                "(use --simulate for more)"
            )


def check_host() -> None:
    """Raise (one line) where this machine cannot build namespaces."""
    reason = netns_available()
    if reason is not None:
        raise cluster.DeployError(
            f"--network needs network namespaces, unavailable here: {reason} "
            "(use --simulate to predict with the simulated clock instead)"
        )


def own_names(pid: int) -> tuple[str, str]:
    """(prefix, subnet) of this comparison's networks, derived from `pid`, so
    that concurrent comparisons (and tests, which use 10.9.x and 10.231.x)
    do not share names or addresses: 10.160.0.0-10.223.255.0/24."""
    slot = pid % (64 * 256)
    return f"pc{pid}", f"10.{160 + slot // 256}.{slot % 256}.0/24"


def network_run_cell(
    command: Callable[[str, str, Path], list[str]],
    out: Path,
    profile_file: Path,
    run_configs: Mapping[str, Mapping[str, Any]],
) -> Callable[[str, str, Path], int]:
    """`run_cell` for `run_grid`: each cell a deployment over the profile in
    `profile_file`. `command(config, name, deployment_dir)` is the cell's
    `pollen run --deployment` argv; `run_configs[name]` its complete run
    config (for num-clients and data-root)."""
    profile = NetworkProfile.load(profile_file)
    prefix, subnet = own_names(os.getpid())

    def run_cell(config: str, name: str, log: Path) -> int:
        run_config = run_configs[name]
        nodes = profile.nodes(int(run_config["num-clients"]))
        site = (out / DEPLOYMENTS / name).resolve()
        run_dir = (out / "runs" / name).resolve()
        shapes = [node.link for node in nodes]
        try:
            network = ShapedNetwork(len(nodes), shapes, prefix=prefix, subnet=subnet)
            with network as net:
                return _deployed(
                    net, [node.slowdown for node in nodes],
                    command(config, name, site), site, log, run_config,
                    lambda wire: _record(run_dir, profile, profile_file, wire),
                )  # fmt: skip
        except NetworkError as err:
            raise cluster.DeployError(f"cell {name}: {err}") from None

    return run_cell


def _deployed(
    net: ShapedNetwork,
    slowdowns: Sequence[float],
    argv: list[str],
    site: Path,
    log: Path,
    run_config: Mapping[str, Any],
    record: Callable[[Mapping[str, Any]], None],
) -> int:
    """Bring up a deployment on `net` in `site` (node k slowed down by
    `slowdowns[k]`), run `argv` (a `pollen run`) on it with output to `log`,
    `record` what crossed the wire, and tear the deployment down."""
    count = net.num_nodes
    run: Any = None
    before: list[tuple[int, int]] | None = None
    started = time.monotonic()
    try:
        cluster.up(
            site, count, host=net.server_address, port=processes.free_port(),
            data_root=str(run_config.get("data-root") or ""),
            node_extra={k: {SLOWDOWN: slowdowns[k]} for k in range(count)},
            node_prefix={k: net.exec_prefix(k) for k in range(count)},
        )  # fmt: skip
        before = [net.counters(i) for i in range(count)]
        started = time.monotonic()
        run = processes.start(argv, log=log)
        return run.wait()
    finally:
        try:
            if run is not None and run.poll() is None:
                processes.stop(run.pid)
            if before is not None:
                after = [net.counters(i) for i in range(count)]
                record({
                    "wall-seconds": time.monotonic() - started,
                    "nodes": [
                        {"node": i, "bytes-up": a[0] - b[0], "bytes-down": a[1] - b[1]}
                        for i, (a, b) in enumerate(zip(after, before, strict=True))
                    ],
                })  # fmt: skip
        finally:
            if (site / cluster.STATE_FILE).exists():
                cluster.down(site)


def _record(
    run_dir: Path,
    profile: NetworkProfile,
    profile_file: Path,
    session: Mapping[str, Any],
) -> None:
    """Write (or, for a resumed cell, add to) `run_dir/network.json`; nothing
    when the run never created its directory (it failed before starting)."""
    if not run_dir.is_dir():
        return
    path = run_dir / NETWORK_FILE
    nodes = [dict(node) for node in session["nodes"]]
    wall, sessions = float(session["wall-seconds"]), 1
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        earlier = json.loads(path.read_text())
        if len(earlier["nodes"]) == len(nodes):
            for node, old in zip(nodes, earlier["nodes"], strict=True):
                node["bytes-up"] += int(old["bytes-up"])
                node["bytes-down"] += int(old["bytes-down"])
            wall += float(earlier["wall-seconds"])
            sessions += int(earlier.get("sessions", 1))
    write_json(path, {
        "profile": profile.as_dict(len(nodes)),
        "profile-file": str(profile_file),
        "nodes": nodes,
        "wall-seconds": wall,
        "sessions": sessions,
        "round-seconds": _round_seconds(run_dir),
    })  # fmt: skip


def _round_seconds(run_dir: Path) -> list[float]:
    """The measured seconds of every round in the run's history (none yet: [])."""
    try:
        rows: Sequence[Mapping[str, Any]] = json.loads(
            (run_dir / "history.json").read_text()
        )
        return [float(row["seconds"]) for row in rows]
    except (OSError, ValueError, KeyError, TypeError):
        return []

"""What each `pollen deploy` action does and says on the console.

The deployment itself (its processes and record) is `cluster`'s, its
certificates and keys are `certificates`'; this module turns one action's
arguments into calls to them and prints the outcome. Every problem the user
can fix is a `cluster.DeployError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..protocol import CLIENT, DATA_FILE, NODE_CONFIG_KEYS, NUM_PARTITIONS
from . import certificates, cluster, processes, run_config


def up(
    directory: Path,
    num_nodes: int,
    *,
    host: str,
    port: int,
    san: Sequence[str],
    insecure: bool,
    data_root: str,
    node_config: Sequence[str],
    executor: str,
    node_poll: float,
    superlink_state: str,
    pull_hold: float,
) -> bool:
    """Start a SuperLink and `num_nodes` SuperNodes; print their status.
    Ctrl-C, SIGTERM and SIGHUP stop it: what it started is stopped, said in
    one line, and False returned."""
    extra = node_extra(node_config, num_nodes)
    certificates.check_hosts(san)  # before the directory is made
    if insecure:
        print("pollen: warning: insecure deployment: no TLS, any SuperNode "
              "may join; use it on a trusted network only", file=sys.stderr)  # fmt: skip
    try:
        with processes.stop_signals_interrupt():
            cluster.up(
                directory, num_nodes, host=host, port=port, san=san,
                insecure=insecure, data_root=data_root, node_extra=extra,
                executor=executor, node_poll=node_poll,
                superlink_state=superlink_state, pull_hold=pull_hold,
            )  # fmt: skip
    except KeyboardInterrupt:
        print("pollen: deploy up interrupted; what it had started is stopped",
              file=sys.stderr)  # fmt: skip
        return False
    print(cluster.status(directory))
    return True


def down(directory: Path) -> None:
    stopped = cluster.down(directory)
    print(f"pollen: stopped {len(stopped)} processes; files kept in {directory}")


def status(directory: Path) -> None:
    print(cluster.status(directory))


def restart(directory: Path, target: str) -> None:
    """Restart the SuperLink (`target` "superlink") or a node by partition-id."""
    if target == "superlink":
        pid = cluster.restart_superlink(directory)
        print(f"pollen: SuperLink restarted (pid {pid}); the SuperNodes "
              "reconnect by themselves; resume an interrupted run with "
              "resume='<its run directory>'")  # fmt: skip
        return
    if not (target.isascii() and target.isdigit()):
        raise cluster.DeployError(
            f"restart {target!r}: expected `superlink` or a node's "
            "partition-id (0, 1, ...)"
        )
    node = cluster.restart_node(directory, int(target))
    print(f"pollen: node {node.partition_id} restarted (pid {node.pid})")


def certs(directory: Path, hosts: Sequence[str], force: bool) -> None:
    """A CA and a SuperLink certificate; never replaces nodes' trust silently."""
    existing = [p.name for p in certificates.certificate_files(directory) if p.exists()]
    if existing and not force:
        raise cluster.DeployError(
            f"{directory} already has {', '.join(existing)}; nodes may trust "
            "them: keep them, or replace them with --force"
        )
    certificates.make_certificates(directory, hosts)
    print(f"pollen: CA and SuperLink certificate for {', '.join(hosts)} "
          f"in {directory}")  # fmt: skip


def register(paths: Sequence[Path], connection: str) -> None:
    """Register every public key named (directories: their *.pub files)."""
    keys = public_keys(paths)
    if not keys:
        raise cluster.DeployError(
            f"no public key (*.pub) in {', '.join(map(str, paths))}: nothing to register"
        )
    for public in keys:
        new = cluster.register_key(public, connection, dict(os.environ))
        print(f"pollen: {public.stem} " + ("registered" if new else "was registered"))


def key(path: Path) -> None:
    """A SuperNode key pair at `path`; never replaces one a SuperLink may
    have registered (the node would be locked out)."""
    for existing in (path, path.with_name(path.name + ".pub")):
        if existing.exists():
            raise cluster.DeployError(
                f"{existing} exists; a SuperLink may have its public key "
                "registered, and a new pair would lock that node out: keep it, "
                "or delete both files to make another"
            )
    public = certificates.make_node_key(path)
    print(f"pollen: SuperNode key {path}; register {public} with "
          "`flwr supernode register`")  # fmt: skip


def public_keys(paths: Sequence[Path]) -> list[Path]:
    """The public key files named, directories expanded to their *.pub files."""
    keys = []
    for path in paths:
        if path.is_dir():
            keys += sorted(path.glob("*.pub"))
        elif path.is_file():
            keys.append(path)
        else:
            raise cluster.DeployError(f"no public key at {path}")
    return keys


class NodeConfigError(ValueError):
    """A `--node-config` that cannot work; nothing was started."""


def node_extra(values: Sequence[str], num_nodes: int) -> dict[int, dict[str, str]]:
    """`K:key=value` flags -> {K: {key: value}} (values parsed as TOML): only
    keys a node reads, each with a value, and a `data-file` that exists
    (the nodes run on this machine)."""
    extra: dict[int, dict[str, str]] = {}
    for value in values:
        node, sep, pairs = value.partition(":")
        if not (sep and node.isascii() and node.isdigit() and int(node) < num_nodes):
            raise NodeConfigError(
                f"--node-config {value!r}: expected K:key=value with K a node "
                f"index 0..{num_nodes - 1}"
            )
        extra.setdefault(int(node), {}).update(_pairs(value, pairs))
    for node, config in extra.items():
        data_file = config.get(DATA_FILE)
        if (
            isinstance(data_file, str)
            and data_file
            and not Path(data_file).expanduser().is_file()
        ):
            raise NodeConfigError(
                f"--node-config {node}:data-file={data_file!r}: no such file"
            )
    check_partitions(extra, num_nodes)
    return extra


def _pairs(value: str, pairs: str) -> dict[str, object]:
    """`pairs` as a node reads them: key=value words only (Flower's parser
    drops a word without '=' and a key without a value), keys a node reads."""
    from click import ClickException
    from flwr.common.config import parse_config_args

    if problem := run_config.pairs_problem(pairs):
        raise NodeConfigError(f"--node-config {value!r}: {problem}")
    try:
        parsed = parse_config_args([pairs])
    except (ValueError, ClickException) as err:
        raise NodeConfigError(f"--node-config {value!r}: {err}") from None
    for key in parsed:
        if key not in NODE_CONFIG_KEYS:
            raise NodeConfigError(
                f"--node-config {value!r}: unknown node-config key {key!r}; "
                f"allowed: {', '.join(NODE_CONFIG_KEYS)}"
            )
    return parsed


def check_partitions(extra: dict[int, dict[str, object]], num_nodes: int) -> None:
    """Refuse node configs whose partitions cannot all exist: a
    `num-partitions` below 1, a `partition-id` outside 0..num-partitions-1,
    two nodes given one partition (one client would be served twice and
    another never; each node would train alone at client-frac 1), or nodes
    that disagree on `num-partitions`."""
    served: dict[int, int] = {}
    for node in range(num_nodes):
        config = extra.get(node, {})
        count = config.get(NUM_PARTITIONS, num_nodes)
        partition = config.get(CLIENT, node)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise NodeConfigError(
                f"--node-config {node}:num-partitions={count!r}; allowed: an "
                "integer >= 1"
            )
        if (
            isinstance(partition, bool)
            or not isinstance(partition, int)
            or not (0 <= partition < count)
        ):
            raise NodeConfigError(
                f"--node-config {node}:partition-id={partition!r} with "
                f"num-partitions={count}; allowed: 0 to {count - 1}"
            )
        if partition in served:
            raise NodeConfigError(
                f"--node-config {node}:partition-id={partition}: node "
                f"{served[partition]} serves partition {partition} already; each "
                "node serves its own partition"
            )
        served[partition] = node
    counts = [extra.get(n, {}).get(NUM_PARTITIONS, num_nodes) for n in range(num_nodes)]
    if len(set(map(repr, counts))) > 1:
        raise NodeConfigError(
            f"--node-config: the nodes disagree on num-partitions (node by node: "
            f"{', '.join(map(repr, counts))}); give every node the same one"
        )

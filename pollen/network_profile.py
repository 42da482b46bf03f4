"""Network profiles: how each node's link and device behave, in one TOML file.

A profile gives every node a link (one-way latency, jitter, up and down
rate, loss: `deployment.network.LinkShape`) and a compute slowdown factor
(a straggler's local work takes `slowdown` times as long). The same profile
shapes real links in `pollen compare --network` (each SuperNode in its own
network namespace) and drives the simulated clock of a simulation
(`pollen.strategies.clock`), so a comparison can be predicted before it is
deployed. Presets live in `configs/networks/`; docs/network.md gives the
measurements their numbers come from.

    description = "a quarter of the nodes on a slow link and device"
    source = "where the numbers come from"

    [default]            # every node no group names
    delay-ms = 10        # one-way
    jitter-ms = 1
    up-mbit = 100        # 0 = unlimited
    down-mbit = 100
    loss-pct = 0
    slowdown = 1         # local work takes this many times as long

    [[group]]            # keys it leaves out are the default's
    name = "slow"
    fraction = 0.25      # the last round(0.25 x nodes) nodes (at least one),
    # or: nodes = [0, 3] # these node (client) indices
    up-mbit = 2
    slowdown = 10

Node i of a deployment serves client i, and a simulated client takes the
profile of the node index equal to its partition id. Groups are applied in
order; a node two groups name takes the later one's values. Validation is
done on load: every error is one line naming the file, the key and what is
allowed, before anything starts.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from .common.links import LinkShape

# profile key -> LinkShape field (the node keys besides `slowdown`)
LINK_KEYS = {
    "delay-ms": "delay_ms",
    "jitter-ms": "jitter_ms",
    "up-mbit": "up_mbit",
    "down-mbit": "down_mbit",
    "loss-pct": "loss_pct",
}
NODE_KEYS = (*LINK_KEYS, "slowdown")
GROUP_KEYS = ("name", "fraction", "nodes", *NODE_KEYS)
TOP_KEYS = ("description", "source", "message-overhead", "default", "group")
PRESETS_DIR = Path("configs") / "networks"


class ProfileError(ValueError):
    """An invalid network profile; the message is one line a user can act on."""


@dataclass(frozen=True)
class NodeProfile:
    """One node's link and compute slowdown (1: as fast as this machine)."""

    link: LinkShape = field(default_factory=LinkShape)
    slowdown: float = 1.0


@dataclass(frozen=True)
class Group:
    """Nodes that differ from the default: chosen by index or by fraction."""

    name: str
    profile: NodeProfile
    nodes: tuple[int, ...] = ()
    fraction: float = 0.0

    def members(self, num_nodes: int) -> list[int]:
        """The node indices of this group in a federation of `num_nodes`."""
        if not self.fraction:
            return [i for i in self.nodes if i < num_nodes]
        # the fraction as written (0.35, not 0.34999...): halves round to even
        count = max(1, round(Fraction(repr(self.fraction)) * num_nodes))
        return list(range(num_nodes - count, num_nodes))


@dataclass(frozen=True)
class NetworkProfile:
    """A named profile: the default node and the groups that differ."""

    name: str
    description: str = ""
    source: str = ""
    default: NodeProfile = field(default_factory=NodeProfile)
    groups: tuple[Group, ...] = ()
    # seconds a deployed message costs beyond its link and its work (the
    # node's pulls and pushes through the SuperLink, the ClientApp's start)
    message_overhead: float = 0.0

    def nodes(self, num_nodes: int) -> list[NodeProfile]:
        """The profile of every node 0..num_nodes-1."""
        return [profile for profile, _ in self._assigned(num_nodes)]

    def _assigned(self, num_nodes: int) -> list[tuple[NodeProfile, str | None]]:
        """Every node's profile and group name (None: the default); a later
        group wins a node two groups name."""
        assigned: list[tuple[NodeProfile, str | None]] = [
            (self.default, None)
        ] * num_nodes
        for group in self.groups:
            for i in group.members(num_nodes):
                assigned[i] = (group.profile, group.name)
        return assigned

    def as_dict(self, num_nodes: int) -> dict[str, Any]:
        """What a run records: the profile's text fields and every node's
        values, with the group it is in (null: the default)."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "message-overhead": self.message_overhead,
            "nodes": [
                {"link": str(p.link), "slowdown": p.slowdown, "group": group}
                for p, group in self._assigned(num_nodes)
            ],
        }

    @classmethod
    def load(cls, path: Path) -> NetworkProfile:
        """Read and validate the profile in `path`."""
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise ProfileError(f"cannot read network profile {path}: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ProfileError(f"network profile {path} is not TOML: {err}") from None
        return cls.from_document(document, Path(path).stem, str(path))

    @classmethod
    def from_document(
        cls, document: dict[str, Any], name: str, where: str = "network profile"
    ) -> NetworkProfile:
        """Validate a parsed profile; `where` prefixes every error."""
        _no_unknown(document, TOP_KEYS, where, "key")
        texts = {}
        for key in ("description", "source"):
            value = document.get(key, "")
            if not isinstance(value, str):
                raise ProfileError(f"{where}: {key} must be a string, got {value!r}")
            texts[key] = value
        default_table = document.get("default", {})
        if not isinstance(default_table, dict):
            raise ProfileError(f"{where}: [default] must be a table")
        _no_unknown(default_table, NODE_KEYS, f"{where}: [default]", "key")
        default = _node(default_table, NodeProfile(), f"{where}: [default]")
        group_tables = document.get("group", [])
        if not isinstance(group_tables, list):
            raise ProfileError(f"{where}: group must be an array of tables ([[group]])")
        groups = tuple(
            _group(table, default, f"{where}: group {i + 1}")
            for i, table in enumerate(group_tables)
        )
        overhead = (
            _number(document, "message-overhead", where)
            if "message-overhead" in document
            else 0.0
        )
        return cls(name, texts["description"], texts["source"], default, groups,
                   overhead)  # fmt: skip


def resolve(spec: str, app: Path) -> Path:
    """The profile file `spec` names: a path, or a preset's name (the stem of
    a file in the app's configs/networks/)."""
    path = Path(spec).expanduser()
    if path.suffix == ".toml" or path.exists() or path.name != spec:
        # a .toml name, an existing path, or one with a directory: not a preset
        if not path.is_file():
            raise ProfileError(f"--network {spec}: no such file")
        return path.resolve()
    preset = app / PRESETS_DIR / f"{spec}.toml"
    if preset.is_file():
        return preset.resolve()
    names = sorted(p.stem for p in (app / PRESETS_DIR).glob("*.toml"))
    raise ProfileError(
        f"--network {spec!r}: not a file and not a preset; presets: "
        f"{', '.join(names) or '(none found)'}"
    )


def _no_unknown(table: dict[str, Any], allowed: tuple[str, ...], where: str,
                what: str) -> None:  # fmt: skip
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ProfileError(
            f"{where}: unknown {what} {unknown[0]!r}; allowed: {', '.join(allowed)}"
        )


def _number(
    table: dict[str, Any],
    key: str,
    where: str,
    allowed: str = "a finite number >= 0",
    valid: Callable[[float], bool] = lambda value: value >= 0,
) -> float:
    """`table[key]` as a float, if it is a finite number that is `valid`
    (else `ProfileError` saying what is `allowed`); an integer too large for
    a float is not finite."""
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{where}: {key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and valid(number)):
        raise ProfileError(f"{where}: {key} must be {allowed}, got {value!r}")
    return number


def _node(table: dict[str, Any], base: NodeProfile, where: str) -> NodeProfile:
    """`base` with the node keys `table` sets."""
    link = {f: getattr(base.link, f) for f in LINK_KEYS.values()}
    for key, name in LINK_KEYS.items():
        if key in table:
            link[name] = _number(table, key, where)
    slowdown = base.slowdown
    if "slowdown" in table:
        slowdown = _number(
            table, "slowdown", where, ">= 1 (1: this machine's speed)",
            lambda value: value >= 1,
        )  # fmt: skip
    try:
        shape = LinkShape(**link)
    except ValueError as err:  # jitter above delay, loss of 100 % or more
        message = str(err).replace("LinkShape.", "")
        for key, name in LINK_KEYS.items():
            message = message.replace(name, key)
        raise ProfileError(f"{where}: {message}") from None
    return replace(base, link=shape, slowdown=slowdown)


def _group(table: Any, default: NodeProfile, where: str) -> Group:
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: a group must be a table ([[group]])")
    _no_unknown(table, GROUP_KEYS, where, "key")
    name = table.get("name", where.rsplit(": ", 1)[-1])
    if not isinstance(name, str):
        raise ProfileError(f"{where}: name must be a string, got {name!r}")
    if ("fraction" in table) == ("nodes" in table):
        raise ProfileError(
            f"{where}: give exactly one of fraction (0 < f <= 1) and nodes (a list "
            "of node indices)"
        )
    profile = _node(table, default, where)
    if "fraction" in table:
        fraction = _number(
            table, "fraction", where, "in (0, 1]", lambda value: 0 < value <= 1
        )
        return Group(name, profile, fraction=fraction)
    nodes = table["nodes"]
    if (
        not isinstance(nodes, list)
        or not nodes
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                   for i in nodes)
    ):  # fmt: skip
        raise ProfileError(
            f"{where}: nodes must be a non-empty list of node indices >= 0, got {nodes!r}"
        )
    return Group(name, profile, nodes=tuple(nodes))

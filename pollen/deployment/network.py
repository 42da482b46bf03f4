"""A shaped test network on one Linux machine: SuperNodes in namespaces.

`ShapedNetwork` gives each node its own network namespace, connected to the
root namespace (where the SuperLink runs) through a link with a configured
one-way delay, jitter, rate limit and packet loss, and removes everything it
made when it exits. Start a process inside node i's namespace with
`exec_prefix(i) + argv`; it reaches the server (a process in the root
namespace listening on `server_address` or 0.0.0.0) and nothing else: the
bridge keeps nodes apart, and there is no NAT and no default route. Traffic to
the server is local delivery to the bridge's address, so IP forwarding stays
off and no sysctl is changed; a host firewall that drops input from the
subnet would block it (this sandbox has no iptables rules).

Topology, for prefix "pollen" and the default subnet 10.231.0.0/24::

    root namespace                                     namespace pollen-n<i>
    pollen-br 10.231.0.1 -- pollen-h<i> =relay= pollen-v<i> 10.231.0.<i+2>

The shaping is done in user space, not by the kernel's netem qdisc, so that it
works on kernels built without netem (such as this project's sandbox, where
`tc qdisc add ... netem` answers "Specified qdisc kind is unknown"). Both ends
of a node's link are TAP devices; `pollen-h<i>` is a port of the bridge and
`pollen-v<i>` lives in the node's namespace. One small relay process per node
(this file run as a script, standard library only) reads every Ethernet frame
from one end and writes it to the other after applying the node's `LinkShape`
for that direction. The TAP devices are tied to the relay's open file
descriptors, so they disappear with the relay, even if it is killed; the relay
exits when its parent does. A relay moves about 400 Mbit/s of unshaped traffic
and adds about 0.1 ms of round trip time; on a busy CPU its timing is only as
good as the scheduler lets it be.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import json
import math
import os
import random
import re
import secrets
import select
import shlex
import shutil
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Self

# absolute: this file also runs as the relay script
from pollen.common.links import Direction, LinkShape

_IFNAMSIZ = 15  # Linux interface names have at most 15 characters
_NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` names namespaces
_SYS_NET = Path("/sys/class/net")
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_MAX_QUEUE_S = 0.5  # a frame that would wait longer for a rate-limited link is dropped


class NetworkError(RuntimeError):
    """A command that builds or removes the network failed, or a relay died."""


@functools.cache
def netns_available() -> str | None:
    """None if this machine can build a `ShapedNetwork`, else the reason why not.

    Tries the real operations on throwaway names: a TAP device, a network
    namespace and a bridge. Cached: the answer does not change within a process.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"pprobe{secrets.token_hex(4)}"
    try:
        os.close(_open_tap(name))
    except OSError as err:
        return f"cannot create a TAP device: {err}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "netns", "del", name)
        _run("ip", "link", "add", name, "type", "bridge")
        _run("ip", "link", "del", name)
    except NetworkError as err:
        return str(err)
    return None


def overlapping_routes(subnet: ipaddress.IPv4Network) -> list[str]:
    """The destinations of this machine's routes, in any table, that overlap
    `subnet` (sorted, each once): a network on `subnet` would shadow them."""
    routes = json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all") or "[]")
    return sorted(
        {
            route["dst"]
            for route in routes
            if route["dst"] != "default"
            and ipaddress.IPv4Network(route["dst"], strict=False).overlaps(subnet)
        }
    )


class ShapedNetwork:
    """`num_nodes` network namespaces linked to the root namespace by shaped links.

    Use as a context manager: entering builds the network and exiting removes
    it, also after an error and after a build that failed half way. It refuses
    to start when one of its names (which all start with `prefix`) already
    exists or when `subnet` overlaps a route of this machine, so it never
    changes or removes anything it did not create. Give concurrent networks
    different prefixes and subnets.
    """

    def __init__(
        self,
        num_nodes: int,
        shape: LinkShape | list[LinkShape],
        prefix: str = "pollen",
        subnet: str = "10.231.0.0/24",
    ) -> None:
        if (
            isinstance(num_nodes, bool)
            or not isinstance(num_nodes, int)
            or num_nodes < 1
        ):
            raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
        shapes = [shape] * num_nodes if isinstance(shape, LinkShape) else list(shape)
        if len(shapes) != num_nodes or not all(
            isinstance(s, LinkShape) for s in shapes
        ):
            raise ValueError(
                f"shape must be a LinkShape or a list of {num_nodes} LinkShapes, got {shape!r}"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", prefix):
            raise ValueError(
                f"prefix must be letters, digits, '_' and '-', got {prefix!r}"
            )
        longest = f"{prefix}-h{num_nodes - 1}"
        if len(longest) > _IFNAMSIZ:
            raise ValueError(
                f"prefix {prefix!r} is too long for {num_nodes} nodes: interface "
                f"name {longest!r} exceeds Linux's {_IFNAMSIZ} characters"
            )
        try:
            network = ipaddress.IPv4Network(subnet)
        except ValueError as err:
            raise ValueError(
                f"subnet must be an IPv4 network such as 10.231.0.0/24: {err}"
            ) from None
        if network.num_addresses < num_nodes + 3:  # network, server, nodes, broadcast
            raise ValueError(
                f"subnet {subnet} has room for {max(network.num_addresses - 3, 0)} "
                f"nodes, not {num_nodes}"
            )
        self.num_nodes = num_nodes
        self.shapes = shapes
        self.prefix = prefix
        self.subnet = network
        self.server_address = str(network[1])
        self._bridge = f"{prefix}-br"
        self._stack = contextlib.ExitStack()

    def namespace(self, i: int) -> str:
        """Name of node i's network namespace."""
        return f"{self.prefix}-n{self._index(i)}"

    def node_address(self, i: int) -> str:
        """Node i's IPv4 address, inside its namespace."""
        return str(self.subnet[2 + self._index(i)])

    def exec_prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command inside node i's namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes up, bytes down) of node i's link so far, Ethernet headers included.

        Read on the server's end of the link: up counts what arrived from the
        node (after shaping and loss), down what the server side sent towards
        it (before shaping and loss).
        """
        stats = _SYS_NET / self._host_end(i) / "statistics"
        return (
            int((stats / "rx_bytes").read_text()),
            int((stats / "tx_bytes").read_text()),
        )

    def __enter__(self) -> Self:
        self._refuse_conflicts()
        with self._stack as stack:
            _run("ip", "link", "add", self._bridge, "type", "bridge")
            stack.callback(_run, "ip", "link", "del", self._bridge)
            _run(
                "ip",
                "addr",
                "add",
                f"{self.server_address}/{self.subnet.prefixlen}",
                "dev",
                self._bridge,
            )
            _run("ip", "link", "set", self._bridge, "up")
            for i in range(self.num_nodes):
                self._add_node(i)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _add_node(self, i: int) -> None:
        """Node i's namespace and link; each step's undo goes on the stack."""
        ns, host, node = self.namespace(i), self._host_end(i), self._node_end(i)
        stack = self._stack
        _run("ip", "netns", "add", ns)
        stack.callback(_run, "ip", "netns", "del", ns)
        with contextlib.ExitStack() as fds:  # the relay holds the TAPs from here on
            host_fd, node_fd = _open_tap(host), _open_tap(node)
            fds.callback(os.close, host_fd)
            fds.callback(os.close, node_fd)
            relay = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    __file__,
                    str(host_fd),
                    str(node_fd),
                    json.dumps(asdict(self.shapes[i])),
                ],
                stdin=subprocess.PIPE,  # closed by _stop_relay, or when we die
                pass_fds=(host_fd, node_fd),
                start_new_session=True,  # Ctrl-C reaches us, and we stop the relay
            )
        stack.callback(_stop_relay, relay, i)
        _run("ip", "link", "set", host, "master", self._bridge)
        _run("ip", "link", "set", host, "type", "bridge_slave", "isolated", "on")
        _run("ip", "link", "set", host, "up")
        _run("ip", "link", "set", node, "netns", ns)
        _run(
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            f"{self.node_address(i)}/{self.subnet.prefixlen}",
            "dev",
            node,
        )
        _run("ip", "-n", ns, "link", "set", node, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _refuse_conflicts(self) -> None:
        """Raise if a name this network uses exists, or its subnet is routed."""
        names = [self._bridge] + [
            end(i)
            for i in range(self.num_nodes)
            for end in (self._host_end, self._node_end)
        ]
        namespaces = [self.namespace(i) for i in range(self.num_nodes)]
        leftovers = [f"ip link del {n}" for n in names if (_SYS_NET / n).exists()] + [
            f"ip netns del {n}" for n in namespaces if (_NETNS_DIR / n).exists()
        ]
        if leftovers:
            raise NetworkError(
                f"names of network {self.prefix!r} are taken: another network with this "
                "prefix is running, or a run was killed. Use another prefix; after a "
                f"killed run, remove what it left with: {'; '.join(leftovers)}"
            )
        if clashes := overlapping_routes(self.subnet):
            raise NetworkError(
                f"subnet {self.subnet} overlaps routes of this machine "
                f"({', '.join(clashes)}); choose another subnet"
            )

    def _host_end(self, i: int) -> str:
        return f"{self.prefix}-h{self._index(i)}"

    def _node_end(self, i: int) -> str:
        return f"{self.prefix}-v{self._index(i)}"

    def _index(self, i: int) -> int:
        if not 0 <= i < self.num_nodes:
            raise IndexError(f"node index {i} out of range for {self.num_nodes} nodes")
        return i


def _run(*cmd: str) -> str:
    """Run a command; its stdout, or a NetworkError naming it and its stderr."""
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkError(
            f"`{shlex.join(cmd)}` failed with exit code {result.returncode}: "
            f"{result.stderr.strip() or '(no error output)'}"
        )
    return result.stdout


def _open_tap(name: str) -> int:
    """Create TAP device `name` in this namespace; it lives while the fd is open."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(
            fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI)
        )
    except OSError:
        os.close(fd)
        raise
    return fd


def _stop_relay(relay: subprocess.Popen[bytes], i: int) -> None:
    """End node i's relay (closing its stdin); raise if it had died by itself."""
    died = relay.poll()
    assert relay.stdin is not None
    relay.stdin.close()
    try:
        relay.wait(timeout=5)
    except subprocess.TimeoutExpired:
        relay.kill()
        relay.wait()
    if died is not None:
        raise NetworkError(
            f"the relay of node {i} exited early with code {died}: its link was down "
            "from then on (see its error output, if any)"
        )


class _Pipe:
    """One direction of a link: frames wait their delay, then go to `dst`.

    A frame first waits for the link to be free at the rate limit (frames that
    would wait longer than _MAX_QUEUE_S are dropped), then travels for the delay
    plus jitter. Frames leave in arrival order.
    """

    def __init__(self, dst: int, shape: LinkShape, direction: Direction) -> None:
        self.dst = dst
        self.delay, self.jitter, self.rate, self.loss = shape.direction(direction)
        self.frames: deque[tuple[float, bytes]] = deque()  # (due time, frame)
        self.link_free = self.last_due = 0.0
        self.rng = random.Random()

    def take(self, src: int, now: float) -> None:
        """Read up to 64 waiting frames from `src` and schedule them."""
        for _ in range(64):
            try:
                frame = os.read(src, 65536)
            except BlockingIOError:
                return
            if self.loss and self.rng.random() < self.loss:
                continue
            sent = now
            if self.rate:
                start = max(now, self.link_free)
                if start - now > _MAX_QUEUE_S:
                    continue
                sent = self.link_free = start + len(frame) * 8 / self.rate
            jitter = self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
            self.last_due = max(sent + self.delay + jitter, self.last_due)
            self.frames.append((self.last_due, frame))

    def release(self, now: float) -> None:
        """Write every frame that is due to `dst`."""
        while self.frames and self.frames[0][0] <= now:
            frame = self.frames.popleft()[1]
            with contextlib.suppress(OSError):  # the receiving end is down: lost
                os.write(self.dst, frame)

    def next_due(self) -> float:
        return self.frames[0][0] if self.frames else math.inf


def _relay(host_fd: int, node_fd: int, shape: LinkShape) -> None:
    """Move frames both ways between the TAP ends until stdin closes."""
    pipes = {
        node_fd: _Pipe(host_fd, shape, "up"),
        host_fd: _Pipe(node_fd, shape, "down"),
    }
    for fd in pipes:
        os.set_blocking(fd, False)
    while True:
        due = min(pipe.next_due() for pipe in pipes.values())
        timeout = None if due == math.inf else max(0.0, due - time.monotonic())
        ready, _, _ = select.select([0, *pipes], [], [], timeout)
        if 0 in ready and not os.read(0, 1):
            return  # the parent closed the pipe or died
        now = time.monotonic()
        for fd in ready:
            if fd in pipes:
                pipes[fd].take(fd, now)
        for pipe in pipes.values():
            pipe.release(time.monotonic())


if __name__ == "__main__":  # the relay: network.py HOST_FD NODE_FD SHAPE_JSON
    _relay(int(sys.argv[1]), int(sys.argv[2]), LinkShape(**json.loads(sys.argv[3])))

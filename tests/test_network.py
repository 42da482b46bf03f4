"""The shaped test network: link shapes, and real namespaces with real TCP.

The network tests build small networks (root and the `ip` command needed) and
skip with `netns_available()`'s reason where they cannot. Each test uses its
own prefix and subnet, so they never collide with a benchmark's "pollen"
network or with each other.
"""

from __future__ import annotations

import json
import math
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from pollen.deployment import network
from pollen.deployment.network import (
    LinkShape,
    NetworkError,
    ShapedNetwork,
    netns_available,
)
from tests.conftest import WORKER, free_network_names

MB = 2_000_000

# Run inside a node's namespace: argv host port action n; prints the seconds taken.
CLIENT = """
import json, socket, sys, time
host, port, action, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.create_connection((host, port), timeout=30)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
f = s.makefile("rb")
def timed(request, answer):
    start = time.perf_counter()
    s.sendall(request)
    assert len(f.read(answer)) == answer
    return time.perf_counter() - start
if action == "ping":
    print(json.dumps([timed(b"ping 0\\n", 1) for _ in range(n)]))
elif action == "up":
    print(json.dumps(timed(b"up %d\\n" % n + bytes(n), 1)))
else:
    print(json.dumps(timed(b"down %d\\n" % n, n)))
"""


# --- link shapes -------------------------------------------------------------


def test_parse_reads_every_key_with_or_without_units() -> None:
    shape = LinkShape.parse("delay=50ms, jitter=5, up=10mbit,DOWN=50,loss=0.1%")
    assert shape == LinkShape(
        delay_ms=50, jitter_ms=5, up_mbit=10, down_mbit=50, loss_pct=0.1
    )
    assert str(shape) == "delay=50ms,jitter=5ms,up=10mbit,down=50mbit,loss=0.1%"
    assert LinkShape.parse(str(shape)) == shape
    assert LinkShape.parse("up=8Mbit") == LinkShape(up_mbit=8)
    assert LinkShape.parse("") == LinkShape.parse("none") == LinkShape()
    assert str(LinkShape()) == "none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("latency=5ms", "'latency=5ms'.*one of delay, jitter, up, down, loss"),
        ("delay", "expected key=value"),
        ("delay=fast", "bad value 'fast' for 'delay'.*'ms'"),
        ("up=10kbit", "bad value '10kbit' for 'up'.*'mbit'"),
        ("delay=5,delay=6", "gives 'delay' twice"),
        ("delay=-5ms", "delay_ms must be a finite number >= 0, got -5"),
        ("loss=100%", "loss_pct must be below 100.*got 100"),
        ("up=inf", "up_mbit must be a finite number >= 0, got inf"),
        ("delay=5,jitter=10", "jitter_ms must be at most delay_ms"),
    ],
)
def test_parse_rejects_bad_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkShape.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delay_ms": -1}, "delay_ms must be a finite number >= 0, got -1"),
        ({"loss_pct": 150}, "loss_pct must be below 100"),
        ({"down_mbit": math.nan}, "down_mbit must be a finite number >= 0, got nan"),
        ({"up_mbit": "8"}, "up_mbit must be a number, got '8'"),
        ({"loss_pct": True}, "loss_pct must be a number, got True"),
    ],
)
def test_link_shape_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkShape(**kwargs)


def test_directions_split_rate_and_share_delay_and_loss() -> None:
    shape = LinkShape(delay_ms=40, jitter_ms=4, up_mbit=8, down_mbit=32, loss_pct=1)
    assert shape.direction("up") == (0.04, 0.004, 8e6, 0.01)
    assert shape.direction("down") == (0.04, 0.004, 32e6, 0.01)


def test_network_names_and_addresses_without_building_it() -> None:
    net = ShapedNetwork(3, LinkShape(), prefix="pt", subnet="10.9.8.0/24")
    assert net.server_address == "10.9.8.1"
    assert [net.node_address(i) for i in range(3)] == [
        "10.9.8.2",
        "10.9.8.3",
        "10.9.8.4",
    ]
    assert net.exec_prefix(2) == ["ip", "netns", "exec", "pt-n2"]
    with pytest.raises(IndexError, match="node index 3 out of range for 3 nodes"):
        net.namespace(3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, LinkShape()), "num_nodes must be an integer >= 1, got 0"),
        ((2, [LinkShape()]), "a list of 2 LinkShapes"),
        ((2, LinkShape(), "longerprefix1"), "'longerprefix1-h1' exceeds Linux's 15"),
        ((1, LinkShape(), "p t"), "prefix must be letters"),
        ((1, LinkShape(), "pt", "10.1.2.3/24"), "subnet must be an IPv4 network"),
        ((3, LinkShape(), "pt", "10.1.2.0/30"), "has room for 1 nodes, not 3"),
    ],
)
def test_network_rejects_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShapedNetwork(*args)


# --- real networks -----------------------------------------------------------


@pytest.fixture
def names() -> tuple[str, str]:
    """A fresh (prefix, subnet); skips where namespaces cannot be built. Under
    xdist each of up to 8 workers draws its subnets from its own 32 of
    10.233.x, so two tests running side by side never overlap, and only from
    those no route of this machine uses: a CI machine may share its network
    namespace with other jobs, and one of them once held 10.233.61.0/24."""
    if reason := netns_available():
        pytest.skip(reason)
    slot = int(WORKER.removeprefix("gw")) % 8 if WORKER else random.randrange(8)
    return free_network_names(f"10.233.{32 * slot}.0/19")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and interfaces of the root namespace whose names use prefix."""
    listed = subprocess.run(
        "ip netns list; ip -o link", shell=True, capture_output=True, text=True
    ).stdout
    return [word for word in listed.split() if word.startswith(f"{prefix}-")]


@contextmanager
def server(address: str) -> Iterator[int]:
    """A TCP server on address for CLIENT's requests; yields its port."""
    listener = socket.create_server((address, 0))

    def handle(conn: socket.socket) -> None:
        # A reset, or the node's link removed once the test is over
        # (ENETUNREACH): either ends this connection quietly.
        with conn, conn.makefile("rb") as f, suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for line in f:
                action, n = line.split()
                if action == b"up":
                    f.read(int(n))
                conn.sendall(bytes(int(n)) if action == b"down" else b"k")

    def accept() -> None:
        with listener:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # closed: the test is over
                    return
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def client(net: ShapedNetwork, i: int, port: int, action: str, n: int):
    """Run CLIENT in node i's namespace; the seconds it measured."""
    argv = [sys.executable, "-c", CLIENT, net.server_address, str(port), action]
    done = subprocess.run(
        [*net.exec_prefix(i), *argv, str(n)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(("delay_ms", "low_ms", "high_ms"), [(40, 80, 200), (0, 0, 20)])
def test_delay_applies_each_way(
    names: tuple[str, str], delay_ms: float, low_ms: float, high_ms: float
) -> None:
    prefix, subnet = names
    with (
        ShapedNetwork(2, LinkShape(delay_ms=delay_ms), prefix, subnet) as net,
        server(net.server_address) as port,
    ):
        for i in range(2):
            rtts_ms = sorted(1e3 * t for t in client(net, i, port, "ping", 10))
            assert rtts_ms[0] >= low_ms, rtts_ms
            assert rtts_ms[len(rtts_ms) // 2] < high_ms, rtts_ms
        assert leftovers(prefix)
    assert leftovers(prefix) == []


def test_rates_limit_each_direction_and_counters_follow(
    names: tuple[str, str],
) -> None:
    prefix, subnet = names
    shape = LinkShape(up_mbit=8, down_mbit=32)
    with (
        ShapedNetwork(1, shape, prefix, subnet) as net,
        server(net.server_address) as port,
    ):
        up0, down0 = net.counters(0)
        seconds = client(net, 0, port, "up", MB)
        up1, down1 = net.counters(0)
        assert 1.6 <= seconds < 4, seconds  # 2.0 s at 8 Mbit/s
        assert up1 - up0 >= MB
        assert down1 - down0 < MB / 10  # only acknowledgements
        seconds = client(net, 0, port, "down", MB)
        up2, down2 = net.counters(0)
        assert 0.4 <= seconds < 1.5, seconds  # 0.5 s at 32 Mbit/s
        assert down2 - down1 >= MB
        assert up2 - up1 < MB / 10
    assert leftovers(prefix) == []


def test_existing_names_are_refused_and_left_alone(names: tuple[str, str]) -> None:
    prefix, subnet = names
    taken = f"{prefix}-n1"
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with (
            pytest.raises(NetworkError, match=f"ip netns del {taken}"),
            ShapedNetwork(2, LinkShape(), prefix, subnet),
        ):
            pass
        assert leftovers(prefix) == [taken]
    finally:
        subprocess.run(["ip", "netns", "del", taken], check=True)


def test_failure_half_way_removes_what_was_built(
    names: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, subnet = names
    run = network._run

    def failing(*cmd: str) -> str:
        if cmd[:4] == ("ip", "-n", f"{prefix}-n1", "addr"):  # node 0 is complete
            raise NetworkError("simulated failure")
        return run(*cmd)

    monkeypatch.setattr(network, "_run", failing)
    with (
        pytest.raises(NetworkError, match="simulated"),
        ShapedNetwork(3, LinkShape(delay_ms=5), prefix, subnet),
    ):
        pass
    assert leftovers(prefix) == []


def test_error_inside_the_block_still_removes_everything(
    names: tuple[str, str],
) -> None:
    prefix, subnet = names
    with (
        pytest.raises(KeyError),
        ShapedNetwork(2, LinkShape(), prefix, subnet) as net,
    ):
        assert net.counters(1) >= (0, 0)
        raise KeyError
    assert leftovers(prefix) == []


def test_overlapping_subnet_is_refused(names: tuple[str, str]) -> None:
    prefix, subnet = names
    with ShapedNetwork(1, LinkShape(), prefix, subnet):
        other = f"{prefix}x"
        with (
            pytest.raises(NetworkError, match=f"subnet {subnet} overlaps"),
            ShapedNetwork(1, LinkShape(), other, subnet),
        ):
            pass
        assert leftovers(other) == []

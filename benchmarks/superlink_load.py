"""A Flower SuperLink's load and message pickup latency against the number of
SuperNodes, for three node clocks.

    .venv/bin/python benchmarks/superlink_load.py [--nodes 8 32 64 128]
        [--clocks flower pollen long-poll] [--rounds 6] [--idle 30]
        [--out bench-out/superlink-load]

A cell is one clock with N nodes. Its SuperLink starts as pollen starts one
(`--isolation subprocess --disable-runtime-dependency-installation`, TLS
with a CA made here, state in memory, its own FLWR_HOME and a free port, no
telemetry, pollen's `flower-superexec` first on its PATH); it does not take
`--enable-supernode-auth`, so the emulated nodes register their own keys,
but every Fleet request is still signed and its signature checked. The N
SuperNodes are emulated in this process, one thread each, on Flower's own
node code: `fleet_http_connection.http_request_response` (its TLS client,
request signing and heartbeats) and `start_client_internal`'s
`_pull_and_store_message` and `_push_messages` (pull, object pulls, receipt
confirmation, reply push and its object pushes). In place of a ClientApp a
node stores an empty reply at once. The clocks:

- `flower`: `flower-superlink`; after an empty pull a node sleeps 3 s
  (Flower's `start_client_internal` loop);
- `pollen`: `flower-superlink`; the sleep follows `pollen.flower_waits.
  PollClock(0.1)` (0.1 s after a message, then 5 % of the time since, up to
  3 s), and a message's objects not there yet are asked for again after
  0.1 s (doubling up to 1 s; Flower: 1 s), as `pollen supernode` does;
- `long-poll`: `pollen superlink` (Flower's SuperLink whose Fleet pull
  holds a node's request until a message for it exists or ~20 s pass), nodes
  as for `pollen`.

The ServerApp (`benchmarks/superlink_load_app`, submitted with `flwr run`)
waits for the N nodes, then plays `--rounds` rounds of one message with an
empty RecordDict per node, pulling replies every 0.05 s, and records each
round's start, end and its own CPU seconds. Per cell:

- idle: from 2 s after the last node connected, for `--idle` seconds before
  the run: node requests per second per node (every HTTP request the nodes
  send, heartbeats included, counted by wrapping `httpx.Client.send`), and
  the CPU-s per second (utime + stime from /proc) of the SuperLink with
  every process below it (its SuperExec, later the ServerApp);
- rounds 2..R (round 1 is left out of every mean): mean round seconds, node
  requests per node per round, SuperLink CPU-s per round (the SuperLink's
  process tree, ServerApp included; sampled every 0.2 s and interpolated to
  the rounds' start and end), and the pickup latency: the node's time of
  receipt minus the message's `metadata.created_at` (set when the ServerApp
  creates the message, just before it pushes the round's messages), median
  and 90th percentile over every message of those rounds; and the median
  time from the end of the ServerApp's push of the round (messages and
  objects: only then is every message available) to receipt, 0 for a
  node that had its message before the push ended. At large N the push
  itself takes seconds (Flower's grid pushes each message's object in a
  request of its own, queued behind the nodes' requests), and the first
  figure includes it.

The cells run N by N, the clocks alternating within each N. Each finished
cell goes to `<out>/superlink-load.json` at once; a rerun skips the cells
there. Prints and writes `<out>/superlink-load.md`: the table, then the
SuperLink CPU per request (idle CPU-s per node request; and per clock the
slope of idle CPU-s/s against requests/s over N, which leaves out the fixed
cost of the SuperExec's own polls) and, on paper, what 1,000 idle nodes on
each clock would ask of a SuperLink: requests per second and CPU cores.

Caveats: pollen's clock counts the idle time from the node's start, so in
the idle window (2 to 2 + `--idle` s after connecting) its nodes poll
faster than the 3 s they settle at after a minute; its idle rate is an
upper bound. The long-poll's nodes all start their first held pull at
once, so a 30 s window holds exactly one pull and one heartbeat per node
(0.067 requests/s); its steady rate is about 0.1 (a pull per 20 s hold and
a heartbeat per 17.5-22.5 s): `--idle 40` measures it. The emulated nodes
share this process and its GIL: the last column shows this process's CPU-s
per second during the rounds; near the machine's cores (2 here), the
harness, not the SuperLink, would limit the rate (at 128 nodes it used
0.27 CPU-s/s, while the SuperLink, one process, sat at one full core).
Per round the JSON also has the requests per node by Fleet path, the
ServerApp's own CPU and how long its push of the round's messages took.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
sys.path.insert(0, str(PROJECT))
sys.path.insert(1, str(HERE))

from measure import descendants  # noqa: E402
from poll_cost import cpu_seconds  # noqa: E402

from pollen.deployment import processes  # noqa: E402
from pollen.deployment.certificates import make_certificates  # noqa: E402
from pollen.deployment.flower import flower_env  # noqa: E402
from pollen.flower_patches import PULL_OBJECTS, resolve  # noqa: E402
from pollen.flower_waits import (  # noqa: E402
    HELD_PULL_SECONDS,
    PollClock,
    _quicker_pulls,
)

APP = HERE / "superlink_load_app"
CLOCKS = ("flower", "pollen", "long-poll")
CONNECTION = "bench"
SETTLE_SECONDS = 2.0  # after the last node connected, before the idle window
SAMPLE_SECONDS = 0.2  # CPU samples of the SuperLink's tree
JOIN_SECONDS = 30.0  # a held pull ends within ~20 s
RUN_TIMEOUT_SECONDS = 900.0
NODES_TIMEOUT_SECONDS = 120.0
FLOWER_IDLE_SLEEP = 3.0  # start_client_internal's sleep after an empty pull
POLL_SECONDS = 0.1  # pollen supernode's default poll interval
PAPER_NODES = 1000


# -- what the emulated nodes send ---------------------------------------------


@dataclass
class Requests:
    """Every HTTP request sent from this process: (Unix time, URL path)."""

    sent: list[tuple[float, str]] = field(default_factory=list)

    def between(self, start: float, end: float) -> list[str]:
        return [path for t, path in self.sent if start <= t < end]


REQUESTS = Requests()


def count_requests() -> None:
    """Wrap `httpx.Client.send` so that each request is noted in REQUESTS."""
    send = httpx.Client.send

    def counted(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> Any:
        REQUESTS.sent.append((time.time(), request.url.path))  # atomic under the GIL
        return send(self, request, **kwargs)

    httpx.Client.send = counted  # type: ignore[method-assign]


class ConnectionFailed(RuntimeError):
    """A node could not register or activate (Flower would exit the process)."""


def _no_exit(code: int, message: str, *_: Any, **__: Any) -> None:
    raise ConnectionFailed(f"{code}: {message}")


def keep_process_on_failure() -> None:
    """Flower's connection calls `flwr_exit` (which ends the whole process a
    few seconds later) when a node cannot connect; here it raises instead, so
    that the harness cleans up."""
    from flwr.supernode import fleet_http_connection

    fleet_http_connection.flwr_exit = _no_exit  # type: ignore[assignment]


# -- the emulated SuperNodes --------------------------------------------------


@dataclass
class Pickup:
    received: float  # Unix time
    created: float  # the message's metadata.created_at
    replied: float = 0.0  # Unix time the reply and its objects were pushed


class Clock:
    """A node's sleep after an empty pull, and what it is told of messages."""

    def __init__(self, name: str) -> None:
        self.poll = None if name == "flower" else PollClock(POLL_SECONDS)

    def idle(self, stop: threading.Event) -> None:
        if self.poll is None:
            stop.wait(FLOWER_IDLE_SLEEP)  # time.sleep(3), ended early on stop
        else:
            self.poll.sleep(FLOWER_IDLE_SLEEP)

    def message_seen(self) -> None:
        if self.poll is not None:
            self.poll.message_seen()

    def found_nothing(self, took: float) -> None:
        """An empty pull took `took` s: held by a `pollen superlink` when at
        least HELD_PULL_SECONDS (`pollen supernode`'s `NotingMessages`)."""
        if self.poll is not None and took >= HELD_PULL_SECONDS:
            self.poll.pull_held(took)


class Node(threading.Thread):
    """One SuperNode's loop (`start_client_internal`), its ClientApp replaced
    by an empty reply stored at once."""

    def __init__(self, address: str, ca: Path, clock: str, stop: threading.Event,
                 connected: Callable[[], None]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.address, self.ca, self.stop = address, ca, stop
        self.clock = Clock(clock)
        self.connected = connected
        self.pickups: list[Pickup] = []
        self.error = ""

    def run(self) -> None:
        from flwr.supernode.fleet_http_connection import http_request_response

        try:
            with http_request_response(
                self.address, insecure=False, root_certificates=str(self.ca),
                authentication_keys=None,
            ) as connection:  # fmt: skip
                self.serve(*connection)
        except BaseException as err:  # reported with the cell
            self.error = f"{type(err).__name__}: {err}"

    def serve(self, node_id: int, receive: Callable, send: Callable, get_run: Callable,
              get_fab: Callable, pull_object: Callable, push_object: Callable,
              confirm: Callable) -> None:  # fmt: skip
        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.supernode import start_client_internal as flower
        from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

        store = ObjectStoreFactory().store()
        state = InMemoryNodeState(store)
        state.set_node_id(node_id)
        self.connected()
        while not self.stop.is_set():
            try:
                began = time.monotonic()
                run_id = flower._pull_and_store_message(
                    state=state, object_store=store, node_config={},
                    receive=self.timed(receive), get_run=get_run, get_fab=get_fab,
                    pull_object=pull_object, confirm_message_received=confirm,
                    trusted_entities=None,
                )  # fmt: skip
                if run_id is None:
                    self.clock.found_nothing(time.monotonic() - began)
                    self.clock.idle(self.stop)
                    continue
                self.clock.message_seen()
                reply(state, store)
                flower._push_messages(state=state, object_store=store, send=send,
                                      push_object=push_object)  # fmt: skip
                self.pickups[-1].replied = time.time()
                self.clock.message_seen()
            except Exception as err:  # one failed step, noted
                self.error = f"{type(err).__name__}: {err}"
                self.stop.wait(1.0)

    def timed(self, receive: Callable) -> Callable:
        def timed_receive() -> Any:
            got = receive()
            if got is not None:
                self.pickups.append(Pickup(time.time(), got[0].metadata.created_at))
            return got

        return timed_receive


def reply(state: Any, store: Any) -> None:
    """What a ClientApp does through the SuperNode's Runtime API, at once: take
    the instruction and store an empty reply to it."""
    from flwr.app import Message, RecordDict
    from flwr.supernode.start_client_internal import _insert_message

    for message in state.get_messages_legacy(is_reply=False):
        message_id = message.metadata.message_id
        state.record_message_processing_start(message_id)
        answer = Message(RecordDict(), reply_to=message)
        state.record_message_processing_end(message_id)
        _insert_message(answer, state, store)


@dataclass
class Fleet:
    nodes: list[Node]
    stop: threading.Event
    ready: threading.Semaphore


def start_fleet(count: int, address: str, ca: Path, clock: str) -> Fleet:
    stop, ready = threading.Event(), threading.Semaphore(0)
    nodes = [Node(address, ca, clock, stop, ready.release) for _ in range(count)]
    for node in nodes:
        node.start()
    return Fleet(nodes, stop, ready)


def wait_connected(fleet: Fleet) -> None:
    deadline = time.monotonic() + NODES_TIMEOUT_SECONDS
    for _ in fleet.nodes:
        if not fleet.ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            errors = {n.error for n in fleet.nodes if n.error}
            raise RuntimeError(f"not every node connected in time: {errors}")


def stop_fleet(fleet: Fleet) -> None:
    fleet.stop.set()
    deadline = time.monotonic() + JOIN_SECONDS
    for node in fleet.nodes:
        node.join(max(0.0, deadline - time.monotonic()))


@contextmanager
def object_pulls(clock: str) -> Iterator[None]:
    """While inside, the nodes' object pulls retry as `pollen supernode`'s do
    (after 0.1 s, doubling up to 1 s) on the pollen clocks, and as Flower's
    (after 1 s) on Flower's: a node often pulls a message before the
    ServerApp has pushed its objects."""
    defaults = resolve(PULL_OBJECTS).__kwdefaults__
    flowers = dict(defaults)
    if clock != "flower":
        _quicker_pulls(PULL_OBJECTS, POLL_SECONDS)
    try:
        yield
    finally:
        defaults.clear()
        defaults.update(flowers)


# -- the SuperLink ------------------------------------------------------------


def superlink_command(clock: str, port: int, certs: Path) -> list[str]:
    first = (
        [processes.entry_point("pollen"), "superlink"]
        if clock == "long-poll"
        else [processes.entry_point("flower-superlink")]
    )
    return [
        *first, "--isolation", "subprocess", "--disable-runtime-dependency-installation",
        "--host", "127.0.0.1", "--port", str(port), "--database", ":flwr-in-memory:",
        "--ssl-ca-certfile", str(certs / "ca.pem"),
        "--ssl-certfile", str(certs / "server.pem"),
        "--ssl-keyfile", str(certs / "server.key"),
    ]  # fmt: skip


@contextmanager
def superlink(clock: str, work: Path, certs: Path) -> Iterator[tuple[int, str]]:
    """A SuperLink for `clock`, running while inside: (its pid, address)."""
    import ssl

    port = processes.free_port()
    address = f"127.0.0.1:{port}"
    log = work / "superlink.log"
    env = flower_env(work / "superlink-home")
    process = processes.start(superlink_command(clock, port, certs), log=log, env=env)
    try:
        context = ssl.create_default_context(cafile=certs / "ca.pem")
        processes.wait_ready(
            process.pid, lambda: processes.answers_ok(f"https://{address}/health", context),
            name="superlink", log=log, timeout=60,
        )  # fmt: skip
        yield process.pid, address
    finally:
        processes.stop(process.pid)


def tree_cpu(pid: int) -> float:
    """CPU-s of `pid` and every process below it (with their reaped children)."""
    return sum(cpu_seconds(p) for p in descendants(pid))


class CpuSampler(threading.Thread):
    """(Unix time, SuperLink tree CPU-s, this process's CPU-s) every
    SAMPLE_SECONDS, until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []
        self.done = threading.Event()

    def sample(self) -> None:
        self.samples.append((time.time(), tree_cpu(self.pid), time.process_time()))

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            self.sample()

    def at(self, t: float) -> tuple[float, float]:
        """Both CPU counters at Unix time `t`, interpolated."""
        before = max((s for s in self.samples if s[0] <= t), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t), default=self.samples[-1])
        if after[0] == before[0]:
            return before[1], before[2]
        w = (t - before[0]) / (after[0] - before[0])
        link = before[1] + w * (after[1] - before[1])
        return link, before[2] + w * (after[2] - before[2])

    def used(self, start: float, end: float) -> tuple[float, float]:
        (link0, own0), (link1, own1) = self.at(start), self.at(end)
        return link1 - link0, own1 - own0


# -- the run ------------------------------------------------------------------


def write_connection(home: Path, address: str, ca: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\nroot-certificates = "{ca}"\n'
    )


def submit(work: Path, address: str, ca: Path, nodes: int, rounds: int) -> Path:
    """`flwr run` the ServerApp; the path its round records will have."""
    home = work / "flwr-home"
    write_connection(home, address, ca)
    out = work / "rounds.json"
    config = f"nodes={nodes} rounds={rounds} out='{out}'"
    subprocess.run(
        [processes.entry_point("flwr"), "run", str(APP), CONNECTION, "--run-config", config],
        env=flower_env(home), check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out


def wait_for_rounds(path: Path, superlink_pid: int, log: Path) -> list[dict]:
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not path.exists():
        if not processes.alive(superlink_pid):
            raise RuntimeError(f"the SuperLink exited:\n{processes.log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no rounds after {RUN_TIMEOUT_SECONDS:.0f} s:\n"
                               f"{processes.log_tail(log)}")  # fmt: skip
        time.sleep(0.5)
    return json.loads(path.read_text())


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(q * len(ordered)))]
        if ordered
        else float("nan")
    )


def idle_phase(fleet: Fleet, sampler: CpuSampler, seconds: float) -> dict[str, Any]:
    nodes = len(fleet.nodes)
    time.sleep(SETTLE_SECONDS)
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    sampler.sample()
    paths = REQUESTS.between(start, end)
    link, own = sampler.used(start, end)
    return {
        "requests/s/node": len(paths) / seconds / nodes,
        "pulls/s/node": sum(p.endswith("pull-messages") for p in paths)
        / seconds
        / nodes,
        "superlink cpu/s": link / seconds,
        "harness cpu/s": own / seconds,
        "requests": len(paths),
        "cpu/request": link / len(paths) if paths else float("nan"),
    }


def round_phase(
    fleet: Fleet, sampler: CpuSampler, rounds: list[dict]
) -> dict[str, Any]:
    later = rounds[1:]
    start, end = later[0]["start"], later[-1]["end"]
    nodes, count = len(fleet.nodes), len(later)
    link, own = sampler.used(start, end)
    paths = REQUESTS.between(start, end)
    pickups = [p for n in fleet.nodes for p in n.pickups if start <= p.created <= end]
    latencies = [p.received - p.created for p in pickups]
    after_push = [after_the_push(p, later) for p in pickups]
    handling = [p.replied - p.received for p in pickups if p.replied]
    return {
        "round s": statistics.mean(r["seconds"] for r in later),
        "requests/node/round": len(paths) / nodes / count,
        "by path/node/round": {
            path.rsplit("/", 1)[-1]: paths.count(path) / nodes / count
            for path in sorted(set(paths))
        },
        "superlink cpu/round": link / count,
        "serverapp cpu/round": statistics.mean(r["cpu"] for r in later),
        "harness cpu/s": own / (end - start),
        "pickup median": statistics.median(latencies) if latencies else float("nan"),
        "pickup p90": quantile(latencies, 0.9),
        "pickup after push median": statistics.median(after_push)
        if after_push
        else float("nan"),
        "pickups": len(latencies),
        "node handling median": statistics.median(handling) if handling else None,
        "node handling max": max(handling, default=None),
        "replies": [r["replies"] for r in rounds],
        "errors": sum(r["errors"] for r in rounds),
        "rounds": [r["seconds"] for r in rounds],
        "push s": [r.get("push") for r in rounds],
    }


def after_the_push(pickup: Pickup, rounds: list[dict]) -> float:
    """How long after the ServerApp's push of its round's messages (and their
    objects) had returned `pickup`'s node received its message; 0 when it
    did before (the message was available by then)."""
    played = next(r for r in rounds if r["start"] <= pickup.created <= r["end"])
    return max(0.0, pickup.received - (played["start"] + played["push"]))


def run_cell(clock: str, nodes: int, args: argparse.Namespace, certs: Path) -> dict:
    work = args.out / "work" / f"{nodes}-{clock}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "rounds.json").unlink(missing_ok=True)
    with superlink(clock, work, certs) as (pid, address), object_pulls(clock):
        sampler = CpuSampler(pid)
        sampler.sample()
        sampler.start()
        fleet = start_fleet(nodes, address, certs / "ca.pem", clock)
        try:
            wait_connected(fleet)
            idle = idle_phase(fleet, sampler, args.idle)
            path = submit(work, address, certs / "ca.pem", nodes, args.rounds)
            rounds = wait_for_rounds(path, pid, work / "superlink.log")
            sampler.sample()
            played = round_phase(fleet, sampler, rounds)
        finally:
            sampler.done.set()
            stop_fleet(fleet)
    errors = sorted({n.error for n in fleet.nodes if n.error})
    return {"nodes": nodes, "clock": clock, "idle": idle, "rounds": played,
            "node errors": errors[:5]}  # fmt: skip


# -- the report ---------------------------------------------------------------


HEADER = (
    "| N | clock | pickup median s | pickup p90 s | pickup after the push, median s | "
    "idle requests/s per node | "
    "requests per node per round | SuperLink CPU-s per round (with ServerApp) | "
    "SuperLink CPU-s/s idle | mean round s | harness CPU-s/s in rounds |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(cell: dict) -> str:
    i, r = cell["idle"], cell["rounds"]
    return (f"| {cell['nodes']} | {cell['clock']} | {r['pickup median']:.3f} | "
            f"{r['pickup p90']:.3f} | {r['pickup after push median']:.3f} | "
            f"{i['requests/s/node']:.3f} | "
            f"{r['requests/node/round']:.1f} | {r['superlink cpu/round']:.2f} | "
            f"{i['superlink cpu/s']:.3f} | {r['round s']:.2f} | {r['harness cpu/s']:.2f} |")  # fmt: skip


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; with one point, a = 0."""
    if len(points) < 2:
        x, y = points[0]
        return 0.0, y / x if x else float("nan")
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")
    return my - b * mx, b


def per_request(cells: list[dict]) -> str:
    """Idle CPU per request, per cell and per clock (the slope over N), and
    what PAPER_NODES idle nodes would cost."""
    lines = ["", "SuperLink CPU per node request, idle phase (CPU-s / requests):", ""]
    for c in cells:
        lines.append(f"- N={c['nodes']} {c['clock']}: "
                     f"{c['idle']['cpu/request'] * 1000:.1f} ms "
                     f"({c['idle']['requests']} requests)")  # fmt: skip
    lines += ["", f"On paper, {PAPER_NODES:,} idle nodes (rate per node from the largest "
              "N; CPU = intercept + slope x requests/s, fitted over N):", ""]  # fmt: skip
    for clock in dict.fromkeys(c["clock"] for c in cells):
        mine = sorted(
            (c for c in cells if c["clock"] == clock), key=lambda c: c["nodes"]
        )
        points = [(c["idle"]["requests/s/node"] * c["nodes"], c["idle"]["superlink cpu/s"])
                  for c in mine]  # fmt: skip
        a, b = fit(points)
        rate = mine[-1]["idle"]["requests/s/node"] * PAPER_NODES
        lines.append(f"- {clock}: slope {b * 1000:.1f} ms per request, intercept {a:.3f} "
                     f"CPU-s/s; {rate:.0f} requests/s, {a + b * rate:.2f} cores")  # fmt: skip
    return "\n".join(lines)


def report(cells: list[dict]) -> str:
    ordered = sorted(cells, key=lambda c: (c["nodes"], CLOCKS.index(c["clock"])))
    notes = [f"- N={c['nodes']} {c['clock']}: replies per round {c['rounds']['replies']}, "
             f"{c['rounds']['errors']} error replies; node errors {c['node errors']}"
             for c in ordered if c["node errors"] or c["rounds"]["errors"]
             or min(c["rounds"]["replies"]) < c["nodes"]]  # fmt: skip
    text = "\n".join([HEADER, *map(row, ordered)]) + "\n" + per_request(ordered)
    return text + ("\n\nProblems:\n" + "\n".join(notes) if notes else "") + "\n"


# -- main ---------------------------------------------------------------------


def load(path: Path) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, cells: dict[str, dict]) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(cells, indent=1))
    path.with_suffix(".tmp").replace(path)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--clocks", nargs="+", choices=CLOCKS, default=list(CLOCKS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--idle", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument(
        "--out", type=Path, default=PROJECT / "bench-out" / "superlink-load"
    )
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (round 1 is left out)")
    args.out = args.out.resolve()
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SuperLinks come down
    args = parse()
    count_requests()
    keep_process_on_failure()
    from flwr.supernode import start_client_internal  # noqa: F401 - its logger set up

    logging.getLogger("flwr").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    certs = args.out / "certs"
    if not (certs / "server.pem").exists():
        make_certificates(certs, ["127.0.0.1", "localhost"])
    results = args.out / "superlink-load.json"
    cells = load(results)
    for nodes in args.nodes:
        for clock in args.clocks:
            key = f"{nodes}/{clock}"
            if key in cells:
                continue
            print(f"N={nodes} {clock} ...", flush=True)
            cells[key] = run_cell(clock, nodes, args, certs)
            save(results, cells)
            print(row(cells[key]), flush=True)
    text = report([c for c in cells.values()
                   if c["nodes"] in args.nodes and c["clock"] in args.clocks])  # fmt: skip
    (args.out / "superlink-load.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

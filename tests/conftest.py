"""Shared fixtures: paths to the project and to the real benchmark data."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.deployment.flower import without_telemetry

PROJECT = Path(__file__).resolve().parents[1]

# A command started as a background job inherits SIGINT ignored, and so would
# the `pollen` processes tests start: Python installs no KeyboardInterrupt
# handler where SIGINT is ignored, and the tests that send Ctrl-C would see it
# ignored. A handler (unlike "ignore") is reset to the default at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
SHARED_DATA = PROJECT.parent / "shared" / "data"
# Test traffic stays on this machine: the Flower processes tests start
# themselves (`flwr run` directly, Flower's own SuperNode) post no usage
# events to telemetry.flower.ai, as those pollen starts post none.
without_telemetry()


# What the suite starts first: the tests that wait longest on processes,
# builds and heartbeats (docs/performance.md, "The test suite on two
# workers"). Under `pytest -n 2 --dist loadgroup` (`make test`) each worker
# takes the next test, or the next group of tests that share a module's
# deployment, as it frees up, so the long ones go out first and the short
# ones fill the gaps.
FIRST_GROUPS = ("docker", "warm-executor", "deployment", "superlink-restarts")
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1 under xdist
if WORKER is not None:
    # torch's own thread pool in each worker process (not in the processes
    # tests start): two workers with a thread per core each would spin
    # against each other (the quick loop took 200 CPU-s for 71 alone)
    import torch

    torch.set_num_threads(1)


def start_order(item: pytest.Item) -> int:
    """0 for the named groups (in FIRST_GROUPS' order), then the other
    integration tests, then the rest."""
    if group := item.get_closest_marker("xdist_group"):
        name = group.args[0] if group.args else group.kwargs.get("name")
        if name in FIRST_GROUPS:
            return FIRST_GROUPS.index(name)
    return len(FIRST_GROUPS) + (0 if item.get_closest_marker("integration") else 1)


@pytest.hookimpl(trylast=True)  # after xdist has named each test's group
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    items.sort(key=start_order)  # stable: files and tests keep their order
    if config.getoption("dist", default="no") == "loadgroup":
        # xdist marks a grouped test by its node ID; a pytest that ignores the
        # mark (9.2 with xdist 3.8) would split groups across workers, each
        # starting the module's deployment (and dockerd) for itself
        split = [i.nodeid for i in items if i.get_closest_marker("xdist_group")]
        if split and "@" not in split[0]:
            raise pytest.UsageError(f"xdist ignored the group of {split[0]}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Run alone, start building the Docker image as soon as a selected test
    needs it: minutes of downloads, hidden behind the tests that run before
    it (tests/docker_image.py). Under xdist every worker collects every test,
    so the worker that runs the Docker tests builds when they start (they
    start first: FIRST_GROUPS)."""
    if session.config.option.collectonly or os.environ.get("POLLEN_TEST_IMAGE"):
        return
    if WORKER is not None:
        return
    if any("docker_image" in getattr(i, "fixturenames", ()) for i in session.items):
        from tests.docker_image import BUILD

        BUILD.start()


def free_network_names(block: str) -> tuple[str, str]:
    """A fresh prefix and a /24 of `block` that no route of this machine
    overlaps, for a test's ShapedNetwork: a CI machine may share its network
    namespace with other jobs (one of them once held 10.233.61.0/24)."""
    from pollen.deployment.network import overlapping_routes

    network = ipaddress.IPv4Network(block)
    taken = [
        ipaddress.IPv4Network(r, strict=False) for r in overlapping_routes(network)
    ]
    free = [
        s for s in network.subnets(new_prefix=24) if not any(map(s.overlaps, taken))
    ]
    if not free:
        pytest.fail(f"every /24 of {block} is routed on this machine")
    return f"pt{secrets.token_hex(2)}", str(random.choice(free))


def runs_that_trained_nothing(root: Path) -> list[Path]:
    """The run directories under `root` whose summary says "completed" while
    every round was skipped (no reply ever used): a run pollen must not call
    complete (`pollen.runs.loops.check_trained`)."""
    found = []
    # os.walk, not rglob: a folder a process removes meanwhile is skipped
    for folder, _, files in os.walk(root):
        if "summary.json" not in files:
            continue
        path = Path(folder) / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(summary, dict) or summary.get("status") != "completed":
            continue
        if summary.get("rounds") and summary.get("skipped-rounds") == summary["rounds"]:
            found.append(path.parent)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_run_completes_untrained(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Every run the suite starts writes under its base temporary folder:
    none may end "completed" with every round skipped (issue 78's guard, on
    every run the tests, examples and tutorials make)."""
    yield
    untrained = runs_that_trained_nothing(tmp_path_factory.getbasetemp())
    assert not untrained, f"runs completed with every round skipped: {untrained}"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove what the image build made, where the tests that use it did not
    (an interrupted session)."""
    if build := sys.modules.get("tests.docker_image"):
        build.BUILD.close()


def fenced_blocks(page: str, language: str) -> list[str]:
    """The bodies of a Markdown page's ```language blocks, in the page's order
    (the commands and outputs the docs' tests run and compare)."""
    return re.findall(rf"^```{language}\n(.*?)^```", page, re.S | re.M)


def read_through_line(process: subprocess.Popen, text: str) -> str:
    """`process`'s stdout up to the end of the first line holding `text`,
    read from its pipe a byte at a time. Iterating the pipe's file object
    reads ahead: on a loaded machine the run printed several rounds before
    the test read any, and the lines read past `text` were lost to the
    `communicate` that reads the rest from the pipe itself."""
    assert process.stdout is not None
    pipe, read, wanted = process.stdout.fileno(), bytearray(), text.encode()
    line_start = 0
    while byte := os.read(pipe, 1):
        read += byte
        if byte == b"\n":
            if wanted in read[line_start:]:
                break
            line_start = len(read)
    return read.decode(errors="replace")


def write_mnist_slices(data_dir: Path, own_file: Path) -> None:
    """Real MNIST for deployment tests: 6,000 training and 2,000 test images
    as `data_dir/mnist.npz` (the shared data set), and 1,500 + 300 others as
    `own_file` (a silo's own examples)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    own_file.parent.mkdir(parents=True, exist_ok=True)
    with np.load(SHARED_DATA / "mnist.npz") as full:
        np.savez(
            data_dir / "mnist.npz",
            x_train=full["x_train"][:6000], y_train=full["y_train"][:6000],
            x_test=full["x_test"][:2000], y_test=full["y_test"][:2000],
        )  # fmt: skip
        np.savez(
            own_file,
            x_train=full["x_train"][50000:51500], y_train=full["y_train"][50000:51500],
            x_test=full["x_test"][5000:5300], y_test=full["y_test"][5000:5300],
        )  # fmt: skip


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist.npz").exists():
        pytest.skip(f"real MNIST not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def task_identity():
    """Messages built outside a running Flower app need a run and node identity."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def client_update(
    client: int,
    arrays: dict,
    examples: float = 1.0,
    metrics: dict | None = None,
    records: dict | None = None,
):
    """An accepted update as the aggregation step receives it: `arrays` from
    `client`, weighted by `examples` (also its `num-examples` metric), with
    further `metrics` and checked array `records` (SCAFFOLD's control)."""
    from flwr.app import MetricRecord

    from pollen.strategies.aggregation import ClientUpdate

    metric_record = MetricRecord({"num-examples": examples, **(metrics or {})})
    return ClientUpdate(client, arrays, metric_record, float(examples), records or {})


def reply_from(node: int, content, message_type: str = "train", answering=None):
    """A reply as node `node` sends it to the server (needs `task_identity`),
    answering message `answering` by its ID when one is given."""
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    server = TaskIdentity.node_id
    TaskIdentity.node_id = node
    try:
        reply = Message(content, dst_node_id=server, message_type=message_type)
    finally:
        TaskIdentity.node_id = server
    if answering is not None:  # as Flower's Message(content, reply_to=...) sets it
        reply.metadata.__dict__["_reply_to_message_id"] = answering.metadata.message_id
    return reply


@pytest.fixture(scope="session")
def warm_federation(tmp_path_factory) -> Iterator[Path]:
    """One warm simulation SuperLink and Ray head for the session's
    simulations that need no federation of their own (`pollen run
    --warm-simulation DIR`): each such run skips about 9 s of start-up.
    Tests that interrupt, kill or count a run's own processes start their own.
    One CPU, so a run starts one ClientApp actor (each imports torch: about
    4 CPU-s) instead of one per core: the xdist workers' runs share the cores."""
    from pollen.deployment.warm_simulation import warm_simulation

    directory = tmp_path_factory.mktemp("warm-simulation")
    with warm_simulation(directory, cpus=1) as federation:
        yield federation.root


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """A real MLflow tracking server (SQLite backend, artefacts served from a
    temporary directory) on a free loopback port; its URI."""
    from pollen.deployment import processes

    home = tmp_path_factory.mktemp("mlflow")
    port = processes.free_port()
    log = home / "server.log"
    server = processes.start(
        [processes.entry_point("mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
         "--artifacts-destination", str(home / "artifacts")],
        log=log, cwd=home, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
             # its job runner (not used here) adds half a minute to start-up
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        processes.wait_ready(
            server.pid, lambda: processes.answers_ok(f"{uri}/health"),
            name="mlflow server", log=log, timeout=120,
        )  # fmt: skip
        yield uri
    finally:
        processes.stop(server.pid)


def resumable_extra(run_config: dict) -> dict:
    """A checkpoint's `extra` as a run writes it: the run config and the
    learning-rate schedule's state."""
    from pollen.runs.lr_schedule import SCHEDULE_KEY, PlateauSchedule

    schedule = PlateauSchedule(0.01, 0.5, 1, 0.0, 0, 0.0)
    return {"settings": run_config, SCHEDULE_KEY: schedule.state_dict()}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The Flower release the suite ran on, last (`make test` and `make
    test-flower-next` run it on two)."""
    from importlib.metadata import distributions

    import flwr

    names = sorted(
        {d.metadata["Name"] for d in distributions()} & {"flwr", "flwr-nightly"}
    )
    terminalreporter.write_line(
        f"ran on Flower {flwr.__version__} ({', '.join(names)})"
    )

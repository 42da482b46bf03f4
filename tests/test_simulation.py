"""End to end through the real Flower simulation (`pollen run`, `flwr run`).

A run on a federation of its own starts a SuperLink, the Ray simulation
engine and ClientApp actors: about 31 s for two rounds on 2 cores. Runs
that need no federation of their own use the session's warm one
(`warm_federation`), about 9 s less each.
"""

from __future__ import annotations

import contextlib
import getpass
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from pollen.deployment.processes import descendants, free_port
from pollen.strategies.prototypes import ServerPrototypes
from pollen.task.client_state import SPILLED_LINE
from pollen.task.models import build_model
from pollen.task.sharing import Sharing, classifier_name
from tests.conftest import PROJECT, WORKER, read_through_line
from tests.user_package import PACKAGE, write_user_package

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
# what `pollen run` stages and logs in the temporary directory while it runs
TEMPORARY = re.compile(
    rf"{re.escape(tempfile.gettempdir())}/pollen-(app-[^/]+|flower-[^/]+\.log)$"
)
TORCH_CACHE = f"torchinductor_{getpass.getuser()}"  # torch's, in the temporary folder
ROUND_LINES = re.compile(
    r"=== Evaluate global model (\d+) Round ===\n\[(\d{2})\] acc=\d+\.\d{2}%, loss=\d+\.\d{6}\n"
)


class Webhook(http.server.BaseHTTPRequestHandler):
    """Collects the JSON bodies POSTed to it."""

    received: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        Webhook.received.append(json.loads(self.rfile.read(length))["text"])
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def webhook() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP endpoint for notifications: (its URL, the texts received)."""
    Webhook.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", Webhook.received
    finally:
        server.shutdown()


def running(marker: bytes = b"flower-superlink") -> set[int]:
    """PIDs of running processes whose command line holds `marker`."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes():
                pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def ours(pid: int) -> bool:
    """Whether process `pid` was started from this pytest process: under
    xdist the other worker's runs (and the detached SuperLink that `flwr run`
    leaves until its test stops it) are not this test's to count."""
    if WORKER is None:
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"PYTEST_XDIST_WORKER={WORKER}".encode() in environ


def orphaned(before: set[int], marker: bytes = b"flower-superlink") -> set[int]:
    """Processes (by command-line marker) started since `before` from this
    pytest process whose parent is gone (a leak).

    Another `pollen run` on the machine (a benchmark) may own such processes
    meanwhile; those still have their live parent, so they do not count.
    """
    leaked = set()
    for pid in filter(ours, running(marker) - before):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == 1 or not Path(f"/proc/{parent}").exists():
            leaked.add(pid)
    return leaked


def pollen_run(
    *config: str,
    timeout: float = 600,
    cwd: Path | None = None,
    warm: Path | None = None,
    env: dict[str, str] | None = None,
    federation: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`pollen run` of the project with `config` (and `--federation-config`
    values `federation`), on the warm federation in `warm` when given, else
    on a SuperLink and Ray of its own, in the environment `env` (default:
    this one)."""
    args = [str(BIN / "pollen"), "run", str(PROJECT)]
    if warm is not None:
        args += ["--warm-simulation", str(warm)]
    for value in config:
        args += ["-c", value]
    for value in federation:
        args += ["--federation-config", value]
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env=env,
    )


def history(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "history.json").read_text())


@pytest.fixture(scope="module")
def default_runs(
    tmp_path_factory, warm_federation: Path
) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """The embedded default run, twice with the same seed (a on a federation
    of its own, b on the warm one), from a shell directory that holds another
    `pollen` package: Ray puts its driver's directory on the ClientApp
    actors' module path, so a simulation started there would import that
    package instead of the app's own. Each in a temporary folder (TMPDIR) of
    its own, short as Ray's socket paths need: what they leave in it is
    returned too."""
    out = tmp_path_factory.mktemp("default")
    shell = tmp_path_factory.mktemp("shell")
    (shell / "pollen").mkdir()
    (shell / "pollen" / "__init__.py").write_text(
        'raise ImportError("the pollen package in the shell directory was imported")'
    )
    markers = (b"flower-superlink", b"flwr-simulation", b"raylet", b"gcs_server")
    before = {marker: running(marker) for marker in markers}
    scratch = Path(tempfile.mkdtemp(prefix="pollen-tmpdir-"))
    env = {**os.environ, "TMPDIR": str(scratch)}
    try:
        runs = [
            pollen_run(
                f"output-dir='{out}' run-name='{name}'", cwd=shell, warm=warm, env=env
            )
            for name, warm in (("a", None), ("b", warm_federation))
        ]
        # torch's own cache of compiled kernels (made by importing
        # torch._dynamo, as building an optimiser does) is torch's, per user
        left = [p.name for p in scratch.iterdir() if p.name != TORCH_CACHE]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # pollen run stops waiting once the ServerApp has written its results, and
    # stops the simulation (Ray included) itself
    for marker in markers:
        assert not orphaned(before[marker], marker), f"pollen run left {marker} running"
    return out, runs, left


@pytest.mark.xdist_group("default-runs")
def test_default_run_trains_digits_and_writes_results(default_runs) -> None:
    out, (run, _), _ = default_runs
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rounds = ROUND_LINES.findall(run.stdout)
    assert [int(r) for r, _ in rounds] == list(range(1, 11))
    run_dir = out / "a"
    assert run.stdout.count(f"results in {run_dir}") == 1  # said once, at the end
    assert re.search(r"s in all \([0-9.]+ s of them in the ServerApp\)", run.stdout)
    # Flower's and Ray's lines are in the run's flower.log, not on the console
    assert "INFO" not in run.stdout + run.stderr
    assert "Since flwr 1.32" not in run.stdout + run.stderr
    flower_log = (run_dir / "flower.log").read_text()
    assert "Starting Flower Simulation" in flower_log and "[01] acc=" in flower_log
    for name in ("settings.json", "history.json", "history.csv", "summary.json",
                 "curves.png", "labels.png", "model.pt"):  # fmt: skip
        assert (run_dir / name).stat().st_size > 0, name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 10
    assert summary["final-accuracy"] > 0.9  # chance is 0.1
    rows = history(run_dir)
    assert all(len(r["clients"]) == 5 and r["bytes-up"] > 0 for r in rows)
    assert all(r["bytes-down"] == r["bytes-up"] for r in rows)  # full model both ways
    csv_header = (run_dir / "history.csv").read_text().splitlines()[0]
    assert csv_header == (
        "round,accuracy,loss,lr,seconds,bytes-up,bytes-down,clients,rejected,clipped,"
        "skipped"
    )
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["data-set"] == "digits" and settings["num-clients"] == 10


@pytest.mark.xdist_group("default-runs")
def test_a_run_leaves_nothing_in_the_temporary_folder(default_runs) -> None:
    """A run on a federation of its own left Ray's session in $TMPDIR/ray
    for good (its logs and sockets; 166 of them after a day's tests), and
    neither run may leave its Flower home, staged app or log."""
    *_, left = default_runs
    assert left == []


@pytest.mark.xdist_group("default-runs")
def test_same_seed_gives_the_same_history(default_runs) -> None:
    out, runs, _ = default_runs
    assert all(r.returncode == 0 for r in runs)
    a, b = history(out / "a"), history(out / "b")
    keys = ("accuracy", "loss", "lr", "clients", "bytes-up", "bytes-down")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def test_real_mnist_subset_learns(
    shared_data: Path, tmp_path: Path, warm_federation: Path
) -> None:
    with np.load(shared_data / "mnist.npz") as full:
        subset = {
            "x_train": full["x_train"][:6000], "y_train": full["y_train"][:6000],
            "x_test": full["x_test"][:2000], "y_test": full["y_test"][:2000],
        }  # fmt: skip
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "mnist.npz", **subset)
    run = pollen_run(
        f"data-set='mnist' data-root='{tmp_path / 'data'}' model='cnn' rounds=3 "
        "num-clients=4 client-frac=1.0 batch-size=32 lr=0.05 download=false "
        f"output-dir='{tmp_path}' run-name='mnist'",
        warm=warm_federation,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = history(tmp_path / "mnist")
    assert len(rows) == 3 and rows[-1]["accuracy"] > 0.85  # chance is 0.1
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_ten_thousand_clients_share_a_hundred_nodes(
    tmp_path: Path, warm_federation: Path
) -> None:
    """10,000 Synthetic(1, 1) clients, 100 sampled per round, FedDyn: the
    simulation starts 100 nodes and asks them nothing, and clients' examples
    are generated only where they train; a bound below one client's h_k
    (2.4 kB) sends every h_k but the node's latest to the run's client-state
    folder (tests/test_client_state.py shows it trains the same)."""
    run = pollen_run(
        "data-set='synthetic' model='logreg' strategy='feddyn' num-clients=10000 "
        "client-frac=0.01 rounds=3 state-memory-mib=0.001 "
        f"output-dir='{tmp_path}' run-name='many'",
        warm=warm_federation,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (tmp_path / "many" / "flower.log").read_text()
    assert "pollen: 10000 clients on 100 nodes" in log
    rows = history(tmp_path / "many")
    assert [len(r["clients"]) for r in rows] == [100, 100, 100]
    assert rows[-1]["loss"] < rows[0]["loss"]
    spilled = re.search(SPILLED_LINE.replace("%d", r"(\d+)"), log)
    assert spilled, log[-3000:]
    assert 150 <= int(spilled[1]) < 300  # of 300 trainings; each node keeps its last
    assert not list((tmp_path / "many").rglob("*.npz"))  # spills go at the end


def test_cohorts_train_the_rounds_sequential_training_does(
    tmp_path: Path, warm_federation: Path
) -> None:
    """FedProx on 10 clients, 5 rounds, with and without cohorts: each of
    the two nodes trains its sampled clients as one vectorised cohort and
    the history is the sequential one (accuracy and loss within 1e-4)."""
    common = (
        "strategy='fedprox' num-clients=10 client-frac=0.8 rounds=5 local-epochs=2 "
        "partition='niid' alpha=0.5 min-size=5 "
        f"output-dir='{tmp_path}'"
    )
    for name, execution in (("seq", "sequential"), ("cohort", "cohort")):
        run = pollen_run(
            f"{common} run-name='{name}' client-execution='{execution}'",
            warm=warm_federation, federation=("num-supernodes=2",),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (tmp_path / "cohort" / "flower.log").read_text()
    assert "pollen: 10 clients on 2 nodes" in log
    sequential, cohort = history(tmp_path / "seq"), history(tmp_path / "cohort")
    assert [r["clients"] for r in cohort] == [r["clients"] for r in sequential]
    for key in ("accuracy", "loss"):
        assert [r[key] for r in cohort] == pytest.approx(
            [r[key] for r in sequential], abs=1e-4
        ), key
    assert cohort[-1]["accuracy"] > 0.8


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam"])
def test_secure_aggregation_trains_the_rounds_plain_aggregation_does(
    strategy: str, tmp_path: Path, warm_federation: Path
) -> None:
    """5 rounds of 6 clients on two nodes, in the clear and under SecAgg+:
    the server sees only each round's masked sum, and the runs agree round by
    round to within the quantisation's effect (accuracy within 0.5 points:
    one test image of 360 is 0.28)."""
    common = (
        f"strategy='{strategy}' num-clients=6 client-frac=1.0 rounds=5 "
        f"output-dir='{tmp_path}'"
    )
    for name in ("off", "secagg+"):
        run = pollen_run(
            f"{common} run-name='{name[:3]}' secure-aggregation='{name}'",
            warm=warm_federation, federation=("num-supernodes=2",),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plain, secure = history(tmp_path / "off"), history(tmp_path / "sec")
    assert [r["accuracy"] for r in secure] == pytest.approx(
        [r["accuracy"] for r in plain], abs=0.005
    )
    assert [r["loss"] for r in secure] == pytest.approx(
        [r["loss"] for r in plain], rel=0.01
    )
    for row in secure:
        report = row["aggregation"]
        assert report["secagg-survivors"] == 6 and not row["failures"]
        assert 0 < report["secagg-error-bound"] < 1e-5
    assert "secagg+ sum of 6/6 clients" in run.stdout


def test_failed_run_exits_non_zero_with_the_reason(tmp_path: Path) -> None:
    """A run that fails inside the ServerApp (here it diverges in round 1;
    missing data is caught before Flower starts): exit 1, the reason in
    summary.json and in the notification, no process left behind."""
    before = running()
    with webhook() as (hook, received):
        run = pollen_run(
            f"strategy='fedavgm' server-lr=1e17 rounds=2 notify-url='{hook}' "
            f"output-dir='{tmp_path}' run-name='fails'"
        )
    assert run.returncode == 1
    assert "the run diverged" in run.stderr
    summary = json.loads((tmp_path / "fails" / "summary.json").read_text())
    assert summary["status"] == "failed" and "diverged" in summary["error"]
    assert not orphaned(before)
    assert received[-1].startswith("pollen: run fails failed: DivergenceError: round 1")


def ctrl_c_after_round_2(argv: list[str]) -> tuple[str, str]:
    """Start the `pollen run` in `argv` (300 rounds), send it SIGINT (what
    Ctrl-C sends the foreground command) once round 2 is reported, and
    return its stdout and stderr after it exited 130, saying no traceback."""
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    shown = read_through_line(run, "round 2/300")
    run.send_signal(signal.SIGINT)
    output, errors = run.communicate(timeout=120)
    output = shown + output
    assert run.returncode == 130, errors[-3000:]
    assert "Traceback" not in output + errors
    return output, errors


def test_ctrl_c_ends_the_run_interrupted_checkpointed_and_resumable(
    tmp_path: Path,
) -> None:
    """Ctrl-C during a run without `checkpoint-every`: one line saying where it
    stopped and the command that resumes it, status 130, `summary.json`
    `interrupted`, a checkpoint of the last completed round, nothing left
    running; the printed command then finishes the run."""
    markers = (b"flower-superlink", b"flwr-simulation", b"raylet")
    before = {marker: running(marker) for marker in markers}
    config = f"rounds=300 output-dir='{tmp_path}' run-name='stopped'"
    _, errors = ctrl_c_after_round_2(
        [str(BIN / "pollen"), "run", str(PROJECT), "-c", config]
    )
    run_dir = tmp_path / "stopped"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds"] >= 2
    last = summary["rounds"]
    assert (run_dir / "checkpoints" / f"round-{last:05d}").is_dir()
    said = errors.strip().splitlines()[-2:]  # after Flower's lines on stderr
    assert said[0] == (
        f"pollen: interrupted after round {last} (checkpointed); resume with:"
    )
    command = said[1].strip()
    time.sleep(1)  # what was stopped has exited
    for marker in markers:
        assert not orphaned(before[marker], marker), f"{marker!r} left running"
    # the printed command, with fewer rounds, finishes the run from round last + 1
    resume = subprocess.run(
        command.replace("rounds=300", f"rounds={last + 1}").replace(
            "pollen run", f"{BIN / 'pollen'} run", 1
        ),
        shell=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert f"pollen: resuming after round {last}" in resume.stdout
    history = json.loads((run_dir / "history.json").read_text())
    assert [row["round"] for row in history] == list(range(1, last + 2))


def test_bad_setting_stops_before_anything_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    run = pollen_run(f"client-frac=1.5 output-dir='{tmp_path}'")
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "pollen: error: invalid value for 'client-frac': 1.5; allowed: in (0, 1]"
    )
    assert list(tmp_path.iterdir()) == [] and time.monotonic() - started < 30


def test_existing_run_directory_is_never_reused(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "summary.json").write_text("{}")
    run = pollen_run(f"output-dir='{tmp_path}' run-name='taken'")
    assert run.returncode == 2 and "already exists" in run.stderr
    assert (tmp_path / "taken" / "summary.json").read_text() == "{}"


def test_plain_flwr_run_on_flowers_default_federation(tmp_path: Path) -> None:
    """`flwr run .` with Flower's own 2-node default still trains 10 clients."""
    home = tmp_path / "flwr-home"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    try:
        run = subprocess.run(
            [str(BIN / "flwr"), "run", str(PROJECT), "--stream", "--run-config",
             f"output-dir='{tmp_path}' run-name='plain' rounds=3"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        for pid in running(str(home).encode()):  # flwr's detached SuperLink
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "10 clients on 2 nodes" in run.stdout + run.stderr
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 3


# Every server update, local objective and sharing policy (and DP-SGD), and
# aggregators beside the mean, 2 rounds each. Of the personal models the
# server does not see (it evaluates each client's own, whatever that is),
# Ditto and FedRoD run here; APFL, Per-FedAvg and FedALA go through the
# ClientApp's own handlers in their tests (test_apfl.py, test_per_fedavg.py,
# test_fedala.py), which is all an end-to-end row would add for them.
SUITE = [
    (
        "fedavgm",
        "silobn",
        "mlp-bn",
        "central-dp='adaptive' central-clip-on='client' "
        "central-noise-multiplier=0.5 central-count-noise=1",
    ),
    ("fedadagrad", "fedbn", "mlp-bn", "aggregator='median'"),
    (
        "fedadam",
        "shared",
        "mlp-bn",
        "aggregator='trimmed-mean' trim-fraction=0.3 min-train-nodes=4",
    ),
    (
        "fedyogi",
        "shared",
        "mlp",
        "update-norm-bound=1 min-train-replies=2 personal-eval-every=2",
    ),
    ("feddyn", "shared", "mlp-bn", "local-objective='feddyn-sam'"),
    ("fedprox", "shared", "cnn-gn", "dp=true dp-epsilon=4"),
    ("fedsam", "fedper", "mlp-bn", ""),
    ("fedsa", "lora-a", "cnn-lora", ""),
    ("scaffold", "silobn", "mlp-bn", "local-objective='scaffold-sam'"),
    ("fedavgm", "fedbn", "mlp-bn", "aggregator='fednova'"),
    ("ditto", "fedper", "mlp-bn", "head-epochs=1"),  # Ditto beside FedRep
    ("lg-fedavg", "lg", "mlp-bn", ""),
    ("moon", "fedbn", "mlp-bn", ""),
    ("fedrod", "shared", "mlp-bn", "local-objective='prox'"),  # BSM under FedProx
    ("fedproto", "local", "mlp-bn", ""),  # prototypes alone travel
    ("fedbabu", "fedper", "mlp-bn", "fine-tune-epochs=1"),
]


@pytest.mark.parametrize(("strategy", "policy", "model", "extra"), SUITE)
def test_every_strategy_runs_end_to_end(
    strategy, policy, model, extra, tmp_path: Path, warm_federation: Path
) -> None:
    sharing = "bn-policy" if policy in ("shared", "fedbn", "silobn") else "sharing"
    run = pollen_run(
        f"strategy='{strategy}' {sharing}='{policy}' model='{model}' rounds=2 "
        f"num-clients=4 client-frac=0.5 partition='silos' {extra} "
        f"output-dir='{tmp_path}' run-name='run'",
        warm=warm_federation,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(ROUND_LINES.findall(run.stdout)) == 2
    run_dir = tmp_path / "run"
    rows = history(run_dir)
    assert all(np.isfinite(r["loss"]) and not r["failures"] for r in rows)
    reference = build_model(model, (1, 8, 8), 10, 0)
    state = reference.state_dict()
    shared = Sharing.of(policy, reference).shared
    per_client = ArrayRecord({k: state[k] for k in shared}).count_bytes()
    if strategy == "scaffold":  # c down, Delta c_k up: the trained shared entries
        trained = Sharing.of(policy, reference).trained_shared(exclude_bn=False)
        per_client += ArrayRecord({k: state[k] for k in trained}).count_bytes()
    down = up = per_client
    if strategy == "fedproto":  # the prototypes down, each client's sums and counts up
        head = reference.get_submodule(classifier_name(reference))
        prototypes = ServerPrototypes(head.out_features, head.in_features, 1)
        down += prototypes.record().count_bytes()
        up += sum(
            ArrayRecord({k: Array(v) for k, v in expected.items()}).count_bytes()
            for expected in prototypes.expected().values()
        )
    for r in rows:  # exactly the shared entries travelled, both ways
        assert r["bytes-down"] == down * len(r["clients"])
        assert r["bytes-up"] == up * len(r["clients"])
    if policy == "local":  # the server's model never changes
        assert rows[0]["loss"] == rows[1]["loss"]
    if "update-norm-bound=1" in extra:  # of 2 updates, the larger is cut to the median
        assert [len(r["clipped"]) for r in rows] == [1, 1]
        assert "1 update clipped (history.json says why)" in run.stdout
    epsilons = [r["dp-epsilon"] for r in rows]
    if "dp=true" in extra:  # the largest client epsilon, within the budget
        assert 0 < epsilons[0] <= epsilons[1] <= 4.0 and "dp epsilon" in run.stdout
    else:
        assert epsilons == [None, None]
    if "central-dp" in extra:  # user-level epsilon per release, clip norm moving
        central = [r["aggregation"] for r in rows]
        assert 0 < central[0]["epsilon"] < central[1]["epsilon"]
        assert central[0]["clip-norm"] == 1.0 != central[1]["clip-norm"]
        assert "user-level epsilon" in run.stdout
    if "personal-eval-every=2" in extra:  # the global model on each own shard
        assert run.stdout.count("personal models") == 1 and not rows[0]["personal"]
        trained = {str(c) for r in rows for c in r["clients"]}
        own = rows[-1]["personal"]
        assert set(own) == trained
        assert all(v["global-accuracy"] is None for v in own.values())
        assert all(0 <= v["local-accuracy"] <= 1 for v in own.values())
    elif policy == "shared" and strategy != "fedrod":  # FedRoD: a head of its own
        assert "personal models" not in run.stdout and not rows[-1]["personal"]
    else:
        assert run.stdout.count("personal models") == 2
        trained = {c for r in rows for c in r["clients"]}
        assert set(rows[-1]["personal"]) == {str(c) for c in trained}
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["server-update"] != "auto" and settings["local-objective"] != "auto"


def test_resume_from_checkpoint_repeats_the_run_and_notifications_arrive(
    tmp_path: Path, warm_federation: Path
) -> None:
    """Round 3 played again from round 2's checkpoint (model, FedAdam's moments,
    scheduler) gives exactly the uninterrupted run's round 3."""
    common = "strategy='fedadam' model='mlp' lr-patience=0 lr-factor=0.5"
    with webhook() as (hook, texts):
        first = pollen_run(
            f"{common} rounds=3 checkpoint-every=2 checkpoint-keep=2 notify-url='{hook}' "
            f"notify-every=1 output-dir='{tmp_path}' run-name='a'",
            warm=warm_federation,
        )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "a"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "round-00002", "round-00003",
    ]  # fmt: skip
    assert len(texts) == 5, texts
    assert texts[0].startswith("pollen: run a started: fedadam on digits, 3 rounds")
    assert all(f"round {r}/3: accuracy" in texts[r] for r in (1, 2, 3))
    assert texts[4].startswith("pollen: run a finished after 3 rounds")
    assert hook not in first.stdout + first.stderr  # the URL is a secret
    uninterrupted = history(run_dir)
    done = pollen_run(f"{common} rounds=3 resume='{run_dir}'", warm=warm_federation)
    assert done.returncode == 2 and "raise rounds" in done.stderr
    shutil.rmtree(run_dir / "checkpoints" / "round-00003")  # "crash" after round 2
    meta = json.loads(
        (run_dir / "checkpoints" / "round-00002" / "meta.json").read_text()
    )
    to_checkpoint = meta["extra"]["elapsed-seconds"]
    assert (
        0
        < to_checkpoint
        < json.loads((run_dir / "summary.json").read_text())["total-seconds"]
    )
    started = time.monotonic()
    resumed = pollen_run(f"{common} rounds=3 resume='{run_dir}'", warm=warm_federation)
    this_process = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming after round 2" in resumed.stdout
    # its time counts the first process's up to the checkpoint, then its own
    # (at least round 3, at most this whole process with its start-up)
    total = json.loads((run_dir / "summary.json").read_text())["total-seconds"]
    again = history(run_dir)
    assert to_checkpoint + again[-1]["seconds"] < total + 0.01  # total is rounded
    assert total < to_checkpoint + this_process
    keys = ("round", "accuracy", "loss", "lr", "clients", "bytes-up")
    assert [[r[k] for k in keys] for r in again] == [
        [r[k] for k in keys] for r in uninterrupted
    ]
    summary = (run_dir / "summary.json").read_text()
    changed = pollen_run(
        f"{common} rounds=4 lr=0.5 resume='{run_dir}'", warm=warm_federation
    )
    assert changed.returncode == 2 and "lr=0.05, this run has lr=0.5" in changed.stderr
    assert history(run_dir) == again  # a refused resume changes nothing
    assert (run_dir / "summary.json").read_text() == summary


def kill_after_checkpoint(config: str, checkpoint: Path) -> None:
    """Start `pollen run`, and SIGKILL it with all its processes as soon as
    `checkpoint` is complete: a crash, no clean-up of any kind (the test
    removes what the run leaves behind: its Flower home, its staged app and
    its Flower log, Ray's folder, the temporary files its processes hold)."""
    args = [str(BIN / "pollen"), "run", str(PROJECT), "-c", config]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (checkpoint / "meta.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    processes = [*descendants(proc.pid), proc.pid]
    left = set()
    for pid in processes:
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            left |= {v[10:].decode() for v in environ if v.startswith(b"FLWR_HOME=")}
            ray = {v[11:].decode() for v in environ if v.startswith(b"RAY_TMPDIR=")}
            left |= {p for p in ray if Path(p).name.startswith("pollen-ray-")}
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            opened = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            left |= {p for p in argv + opened if TEMPORARY.match(p)}
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    for path in map(Path, left):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("strategy", ["feddyn", "fedadam"])
def test_killed_run_resumes_to_the_uninterrupted_history(
    strategy: str, tmp_path: Path, warm_federation: Path
) -> None:
    """Killed after round 2's checkpoint, resumed: the same rounds, the same
    numbers as the run that was never interrupted. FedDyn's clients read
    their h_k back from disk; FedAdam's moments come from the checkpoint.
    (FedAvg's resume takes the same path with no state to restore; it was a
    third case, 62 s of CI for nothing these two do not cover.)"""
    common = (
        f"strategy='{strategy}' rounds=6 num-clients=6 client-frac=0.5 "
        f"local-epochs=4 checkpoint-every=2 output-dir='{tmp_path}'"
    )
    whole = pollen_run(f"{common} run-name='whole'", warm=warm_federation)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    before = running()
    crashed = tmp_path / "crashed"
    kill_after_checkpoint(
        f"{common} run-name='crashed'", crashed / "checkpoints" / "round-00002"
    )
    assert not (crashed / "summary.json").exists()  # it never got to write one
    assert not orphaned(before)  # the crash took every process with it
    if strategy == "feddyn":
        states = list((crashed / "client-state").rglob("*.npz"))
        assert states, "FedDyn clients kept no state on disk"
    resumed = pollen_run(f"{common} resume='{crashed}'", warm=warm_federation)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"resuming after round [24]\n", resumed.stdout)
    keys = ("round", "accuracy", "loss", "lr", "clients", "bytes-up", "bytes-down")
    assert [[r[k] for k in keys] for r in history(crashed)] == [
        [r[k] for k in keys] for r in history(tmp_path / "whole")
    ]
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 6


@pytest.mark.parametrize(
    ("settings", "what", "cause"),
    [
        # the server's step overflows the model
        ("strategy='fedavgm' server-lr=1e17", r"round 1: .* not finite, the run "
         "diverged", "likely cause: server-lr=1e+17 too high"),
        # every client's training overflows: not a round of bad clients to skip
        ("lr=1e30 max-grad-norm=0", r"round 1: every client's reply carried NaN "
         "or infinity .* the clients' training diverged", "lr=1e+30 too high"),
    ],
    ids=["server", "clients"],
)  # fmt: skip
def test_diverged_run_stops_with_a_clear_message(
    settings: str, what: str, cause: str, tmp_path: Path, warm_federation: Path
) -> None:
    """A diverged run stops in round 1, names the round and the likely
    cause, and records nothing of it."""
    run = pollen_run(
        f"{settings} rounds=3 checkpoint-every=1 "
        f"output-dir='{tmp_path}' run-name='diverged'",
        warm=warm_federation,
    )
    assert run.returncode == 1
    assert re.search(f"DivergenceError: {what}", run.stderr), run.stderr[-2000:]
    assert cause in run.stderr
    run_dir = tmp_path / "diverged"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "round 1" in summary["error"]
    assert summary["rounds"] == 0 and not (run_dir / "checkpoints").exists()
    assert not (run_dir / "model.pt").exists()


def test_fedbuff_under_a_profile_resumes_from_its_last_version(
    tmp_path: Path, warm_federation: Path
) -> None:
    """FedBuff with FedBN on the simulated clock of the `mixed` preset (the
    last of 4 clients 10x slower; IID shards, so the others are about as fast
    as each other): every version records its simulated time
    and staleness, the slow client's update comes in stale. Killed after
    version 2's checkpoint and resumed: versions 1-2 are kept as written, the
    updates in flight at the checkpoint are not replayed (the first version
    after the resume is made of updates sent from version 2: staleness 0),
    and the clients' personal models are evaluated once, at the end."""
    profile = PROJECT / "configs" / "networks" / "mixed.toml"
    common = (
        f"strategy='fedbuff' bn-policy='fedbn' model='mlp-bn' rounds=4 "
        f"num-clients=4 partition='iid' concurrency=4 buffer-size=2 checkpoint-every=2 "
        f"network-profile='{profile}' output-dir='{tmp_path}'"
    )
    run_dir = tmp_path / "async"
    kill_after_checkpoint(
        f"{common} run-name='async'", run_dir / "checkpoints" / "round-00002"
    )
    kept = history(run_dir)[:2]
    resumed = pollen_run(f"{common} resume='{run_dir}'", warm=warm_federation)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = history(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and rows[:2] == kept
    assert all(r["sim-seconds"] > 0 and len(r["staleness"]) == 2 for r in rows)
    assert rows[0]["staleness"] == [0, 0] and 3 not in rows[0]["clients"]
    assert max(s for r in rows[:2] for s in r["staleness"]) > 0
    assert rows[2]["staleness"] == [0, 0]  # sent afresh from version 2
    assert not any(r["personal"] for r in rows[:3])
    assert set(rows[-1]["personal"]) == {str(c) for r in rows for c in r["clients"]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 4


def test_sign_flip_attack_breaks_the_mean_not_multi_krum(
    tmp_path: Path, warm_federation: Path
) -> None:
    """3 of 10 digits clients send their update reversed and 10x larger
    (sum: 7 - 30 = -23 honest updates' worth). The mean does not survive it
    (the run diverges or stays near chance); multi-Krum with f = 3 leaves
    exactly the attackers out every round and learns; both histories name
    the attackers."""
    attack = "num-clients=10 client-frac=1.0 rounds=3 attack='sign-flip' "
    attack += "attacker-clients='0,1,2'"
    runs = {
        name: pollen_run(
            f"{attack} {extra} output-dir='{tmp_path}' run-name='{name}'",
            warm=warm_federation,
        )
        for name, extra in (
            ("mean", ""),
            ("krum", "aggregator='multi-krum' byzantine-clients=3"),
        )
    }
    krum = runs["krum"]
    assert krum.returncode == 0, krum.stdout[-2000:] + krum.stderr[-2000:]
    rows = history(tmp_path / "krum")
    assert [r["attackers"] for r in rows] == [[0, 1, 2]] * 3
    assert [r["unselected"] for r in rows] == [[0, 1, 2]] * 3
    assert rows[-1]["accuracy"] > 0.8
    assert "left out by the aggregator [0, 1, 2]" in krum.stdout
    mean = runs["mean"]
    if mean.returncode == 0:
        rows = history(tmp_path / "mean")
        assert rows[0]["attackers"] == [0, 1, 2] and not rows[0]["unselected"]
        assert rows[-1]["accuracy"] < 0.3
    else:
        assert "DivergenceError" in mean.stderr, mean.stderr[-2000:]


def test_a_users_model_data_set_and_parts_run_from_their_package_on_pythonpath(
    tmp_path: Path,
) -> None:
    """A model factory, a data-set loader, an aggregation rule, a server
    update and a local objective of a package pollen knows nothing of, named
    by import path: `pollen run` validates them, and its PYTHONPATH reaches
    the ServerApp and the ClientApp actors, which import them. A federation
    of its own: the warm one's actors started without the package on their
    path."""
    root = write_user_package(tmp_path / "package")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    parts = {
        "model": f"{PACKAGE}.nets:tiny_net",
        "data-set": f"{PACKAGE}.data:blobs",
        "aggregator": f"{PACKAGE}.rules:UniformMean",
        "server-update": f"{PACKAGE}.updates:DampedAverage",
        "local-objective": f"{PACKAGE}.objectives:L1Decay",
    }
    chosen = " ".join(f"{key}='{name}'" for key, name in parts.items())
    run = pollen_run(
        f"{chosen} prox-mu=0.001 rounds=2 num-clients=4 output-dir='{tmp_path}' "
        "run-name='user'",
        env={**os.environ, "PYTHONPATH": path},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = parts["data-set"]
    assert f"pollen: {data} from a user's loader: 160 train / 60 test" in run.stdout
    assert [r["round"] for r in history(tmp_path / "user")] == [1, 2]
    settings = json.loads((tmp_path / "user" / "settings.json").read_text())
    assert {key: settings[key] for key in parts} == parts
    assert settings["server-lr"] == 0.5  # the user's update's own auto value
    summary = json.loads((tmp_path / "user" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final-accuracy"] > 0.5


def test_a_run_whose_every_client_fails_exits_1_naming_the_clients_error(
    tmp_path: Path,
) -> None:
    """Every client of every round raising: each round is skipped, and the
    run fails naming the clients' own error (it said "completed" at its
    initial accuracy, exit 0, before)."""
    root = write_user_package(tmp_path / "package")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    run = pollen_run(
        f"model='{PACKAGE}.nets:trains_on_gpu_only' rounds=2 num-clients=2 "
        f"output-dir='{tmp_path}' run-name='untrained'",
        env={**os.environ, "PYTHONPATH": path},
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    reason = (
        "NothingTrained: no round used a reply: all 2 rounds were skipped and the "
        "model is as it started; the first failure: RuntimeError: this model "
        "trains on a GPU only"
    )
    assert f"pollen: run failed: {reason}" in run.stderr
    console = run.stdout + run.stderr
    assert "pollen: error reply: node " in console
    # Flower's block of each client's failure is one line, not Ray's traceback
    assert "An exception was raised when processing a message" in console
    assert "ray::ClientAppActor" not in console
    summary = json.loads((tmp_path / "untrained" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == reason
    assert summary["skipped-rounds"] == summary["rounds"] == 2

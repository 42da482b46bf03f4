"""`pollen superexec`, the warm ClientApp executor: the Flower contract it
relies on, its module stash and hints, and real deployments (TLS, SuperNode
authentication) whose ClientApps it forks: the same histories as Flower's
own executor, a killed child, a killed parent, a changed app, and nothing
left running after `pollen deploy down`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollen.deployment import cluster, processes, superexec
from pollen.deployment.module_stash import ModuleStash
from pollen.deployment.warm_hint import HINT_FILE_ENV, WarmHint, report
from tests.conftest import PROJECT, SHARED_DATA, write_mnist_slices
from tests.deployed import finish, history, submit, wait_for_rounds

NODES = 2
WORKDIRS = Path(tempfile.gettempdir())  # where a warm parent makes its work folder
needs_mnist = pytest.mark.skipif(
    not (SHARED_DATA / "mnist.npz").exists(), reason=f"real MNIST not at {SHARED_DATA}"
)


# --- the contract with Flower ------------------------------------------------


def test_flower_runs_clientapps_by_the_command_the_launcher_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's stock executor runs `flwr-clientapp` from PATH with arguments
    that Flower's own `flwr-clientapp` parser accepts; the warm launcher
    stands in for that command. Fails if a Flower upgrade renames the
    command, resolves it otherwise or changes its arguments."""
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType
    from flwr.supercore.superexec.executor import ExecutionSpec
    from flwr.supercore.superexec.executor.subprocess_executor import (
        SubprocessExecutor,
    )
    from flwr.supernode.cli.flwr_clientapp import _parse_args_run_flwr_clientapp

    assert TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] == superexec.LAUNCHER
    seen = tmp_path / "argv.json"
    fake = tmp_path / superexec.LAUNCHER
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    spec = ExecutionSpec(
        task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9094",
        token="secret-token", insecure=False, root_certificates_path="/ca.pem",
        runtime_dependency_install=False, parent_pid=os.getpid(),
        suppress_output=True, task_id=7,
    )  # fmt: skip
    SubprocessExecutor().launch(spec)
    deadline = time.monotonic() + 20
    while not seen.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    args = json.loads(seen.read_text())
    parsed = _parse_args_run_flwr_clientapp().parse_args(args)
    assert parsed.runtime_api_address == "127.0.0.1:9094"
    assert parsed.token == "secret-token"
    assert parsed.root_certificates == "/ca.pem"
    assert parsed.parent_pid == os.getpid()


def test_flower_takes_a_loaded_app_module_as_it_is(tmp_path: Path) -> None:
    """Why the parent stashes what it preloads: Flower's `load_app` uses a
    module already in `sys.modules` whatever directory the task's FAB is in."""
    from flwr.supercore.object_ref import load_app

    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "contract_app_probe.py").write_text("app = 'stale'\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "contract_app_probe.py").write_text("app = 'fresh'\n")
    sys.path.insert(0, str(stale))
    try:
        import contract_app_probe  # noqa: F401

        assert load_app("contract_app_probe:app", ValueError, fresh) == "stale"
    finally:
        sys.modules.pop("contract_app_probe", None)
        for path in (str(stale), str(fresh)):
            while path in sys.path:
                sys.path.remove(path)


# --- the module stash --------------------------------------------------------


def _write_app(directory: Path, value: int) -> None:
    package = directory / "stashapp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import itertools\nLOADS = itertools.count()\n"
    )
    (package / "core.py").write_text(f"VALUE = {value}\n")


@pytest.fixture
def clean_import_state() -> Iterator[None]:
    path, meta = list(sys.path), list(sys.meta_path)
    yield
    sys.path[:], sys.meta_path[:] = path, meta
    for name in [n for n in sys.modules if n.split(".")[0] == "stashapp"]:
        del sys.modules[name]


def test_the_stash_gives_back_a_module_only_for_the_same_file(
    tmp_path: Path, clean_import_state: None
) -> None:
    import importlib

    first, second = tmp_path / "apps" / "a.1111", tmp_path / "apps" / "b.2222"
    _write_app(first, 1)
    _write_app(second, 2)
    sys.path.insert(0, str(first))
    before = set(sys.modules)
    preloaded = importlib.import_module("stashapp.core")
    sys.path.remove(str(first))
    stash = ModuleStash.take(set(sys.modules) - before)
    assert set(stash.modules) == {"stashapp", "stashapp.core"}
    assert "stashapp" not in sys.modules
    stash.install()

    sys.path.insert(0, str(second))  # another FAB: its own code
    other = importlib.import_module("stashapp.core")
    assert other.VALUE == 2 and other is not preloaded
    assert stash.restored == []
    for name in ("stashapp", "stashapp.core"):
        del sys.modules[name]
    sys.path.remove(str(second))

    sys.path.insert(0, str(first))  # the same FAB: the preloaded modules
    again = importlib.import_module("stashapp.core")
    assert again is preloaded and again.VALUE == 1
    assert sorted(stash.restored) == ["stashapp", "stashapp.core"]


def test_the_stash_refuses_a_file_changed_since_it_was_loaded(
    tmp_path: Path, clean_import_state: None
) -> None:
    import importlib

    app = tmp_path / "app"
    _write_app(app, 1)
    sys.path.insert(0, str(app))
    importlib.import_module("stashapp.core")
    stash = ModuleStash.take(["stashapp", "stashapp.core", "itertools"])
    stash.install()
    core = app / "stashapp" / "core.py"
    core.write_text("VALUE = 3  # edited in place\n")
    os.utime(core, ns=(time.time_ns() + 10**9,) * 2)
    assert importlib.import_module("stashapp.core").VALUE == 3
    assert stash.restored == ["stashapp"]


def test_a_plug_in_beside_the_app_is_stashed_and_its_edits_are_seen(
    tmp_path: Path, clean_import_state: None
) -> None:
    """A user's plug-in (a rule named by import path) imported by the warm-up
    from outside the app's folder is stashed as the app is, so a child
    imports its edited file (it stayed in the parent's `sys.modules`, and
    every task ran the code of the warm-up); modules installed in the
    environment stay loaded."""
    import importlib

    plugins = tmp_path / "plugins"
    _write_app(plugins, 1)  # `stashapp` here stands for the plug-in package
    sys.path.insert(0, str(plugins))
    importlib.import_module("stashapp.core")
    stash = ModuleStash.take(["stashapp", "stashapp.core", "pytest", "json.decoder"])
    assert set(stash.modules) == {"stashapp", "stashapp.core"}
    assert "pytest" in sys.modules and "json.decoder" in sys.modules
    stash.install()
    core = plugins / "stashapp" / "core.py"
    core.write_text("VALUE = 4  # the user edits the plug-in\n")
    os.utime(core, ns=(time.time_ns() + 10**9,) * 2)
    assert importlib.import_module("stashapp.core").VALUE == 4


# --- hints ---------------------------------------------------------------------


def test_a_hint_round_trips_and_a_malformed_one_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "hint.json"
    report(tmp_path, {"rounds": 3}, {"partition-id": 0}, 0.5)
    assert not path.exists()  # not under a warm executor: nothing written
    monkeypatch.setenv(HINT_FILE_ENV, str(path))
    report(tmp_path, {"rounds": 3}, {"partition-id": 0}, 0.5)
    hint = WarmHint.read(path)
    assert hint == WarmHint(str(tmp_path), {"rounds": 3}, {"partition-id": 0}, 0.5)
    for bad in ("not json", "[]", '{"app_dir": 1, "run_config": {}, "node_config": {}}',
                '{"app_dir": "x", "run_config": []}'):  # fmt: skip
        path.write_text(bad)
        assert WarmHint.read(path) is None, bad


def test_only_the_work_folders_of_ended_parents_are_removed(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid names no process (until reused)
    names = {
        "ended": f"{superexec.WORKDIR_PREFIX}{ended.pid}-ab_c1",
        "running": f"{superexec.WORKDIR_PREFIX}{os.getpid()}-xyz9",
        "old-style": f"{superexec.WORKDIR_PREFIX}ab_c1",
        "other": f"pollen-app-{ended.pid}-ab_c1",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "warm.sock").touch()
    superexec.remove_orphaned_workdirs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("running", "old-style", "other")
    )


def test_superexec_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture) -> None:
    for argv, says in (
        (["--max-tasks", "0"], "--max-tasks must be at least 1, got 0"),
        (["--executor", "kubernetes"], "pass --cold to choose Flower's executors"),
        (["--executor=warm"], "pass --cold to choose Flower's executors"),
    ):
        with pytest.raises(SystemExit) as stop:
            superexec.main(argv)
        assert stop.value.code == 2
        assert says in capsys.readouterr().err


@needs_mnist
def test_warm_up_loads_the_data_without_threads_or_cuda(tmp_path: Path) -> None:
    """The parent warms the real app on real MNIST: its modules are stashed
    (none left in `sys.modules`, its own restored), the node's shard is in
    the stashed modules' cache, and torch runs one thread, CUDA untouched."""
    data = tmp_path / "data"
    write_mnist_slices(data, tmp_path / "own.npz")
    script = textwrap.dedent(f"""
        import sys, threading
        from pathlib import Path
        from pollen.deployment import superexec
        from pollen.deployment.warm_hint import WarmHint
        own = sys.modules["pollen.deployment.superexec"]
        executor = superexec.WarmExecutor(Path({str(tmp_path)!r}), 1)
        hint = WarmHint({str(PROJECT)!r}, {{"data-set": "mnist",
            "data-root": {str(data)!r}, "num-clients": 2}},
            {{"partition-id": 1, "num-partitions": 2}})
        executor.warm(hint)
        import torch
        shards = executor.stash.modules["pollen.task.shards"][0]
        assert shards._client_shard.cache_info().currsize == 1
        assert "pollen.client_app" not in sys.modules
        assert sys.modules["pollen.deployment.superexec"] is own
        assert torch.get_num_threads() == 1 and not torch.cuda.is_initialized()
        assert threading.active_count() == 1
        print("ok", len(executor.stash.modules))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith("ok")


# --- real deployments ----------------------------------------------------------


def _up(root: Path, name: str, executor: str) -> cluster.Deployment:
    return cluster.up(
        root / name, NODES, port=processes.free_port(), data_root=str(root / "data"),
        executor=executor, superlink_state="file",  # a SuperLink test restarts
    )  # fmt: skip


def _task_processes(deployment: cluster.Deployment) -> list[int]:
    """Every process below the nodes' warm executors."""
    return [p for n in deployment.nodes for p in processes.descendants(n.executor_pid)]


def _warm_deployment(root: Path) -> Iterator[cluster.Deployment]:
    """Two SuperNodes (TLS, authentication) with warm executors in `root`,
    stopped after, with every task below them."""
    if not (SHARED_DATA / "mnist.npz").exists():
        pytest.skip(f"real MNIST not at {SHARED_DATA}")
    write_mnist_slices(root / "data", root / "own.npz")
    started = _up(root, "site", "warm")
    assert all(n.executor_pid for n in started.nodes)
    try:
        yield started
    finally:
        current = cluster.Deployment.load(started.root)
        below = _task_processes(current)
        cluster.down(started.root)
        assert not current.running()
        assert not [p for p in below if processes.alive(p)], "outlived deploy down"


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Iterator[cluster.Deployment]:
    """The module's deployment (`_warm_deployment`)."""
    yield from _warm_deployment(tmp_path_factory.mktemp("warm"))


@pytest.fixture
def restarting(tmp_path_factory) -> Iterator[cluster.Deployment]:
    """A deployment of its own (`_warm_deployment`) for a test that kills
    its SuperLink: it runs beside the module's group, on the other worker."""
    yield from _warm_deployment(tmp_path_factory.mktemp("restarting"))


@pytest.mark.xdist_group("warm-executor")
@pytest.mark.integration
def test_warm_and_cold_executors_train_to_the_same_history(
    warm: cluster.Deployment, tmp_path: Path
) -> None:
    """FedDyn (stateful clients: h_k in each node's context) trains to the
    same history whether each message gets a warm child or a fresh process."""
    cold = _up(warm.root.parent, "cold-site", "cold")
    try:
        assert not any(n.executor_pid for n in cold.nodes)
        config = "strategy='feddyn' rounds=2 run-name='feddyn'"
        for site in (warm, cold):
            finish(submit(site, tmp_path / site.root.name, config, NODES))
        ours, theirs = (
            history(tmp_path / site.root.name / "feddyn") for site in (warm, cold)
        )
        keep = ("accuracy", "loss", "clients", "failures", "bytes-up")
        assert [{k: r[k] for k in keep} for r in ours] == [
            {k: r[k] for k in keep} for r in theirs
        ]
        assert ours[-1]["accuracy"] > 0.8
    finally:
        cluster.down(cold.root)
    log = Path(warm.node(0).executor_log).read_text()
    assert "pollen superexec: warmed" in log and "exited 0" in log


KILLS = 5


@pytest.mark.xdist_group("superlink-restarts")
@pytest.mark.integration
def test_a_superlink_killed_five_times_never_hangs_and_the_run_converges(
    restarting: cluster.Deployment, tmp_path: Path
) -> None:
    """The SuperLink SIGKILLed after each of rounds 1-5's checkpoints, with
    a node SIGSTOPped from the kill until after `pollen deploy restart
    superlink` (a SuperLink restarted while its nodes hold a finished run's
    message or reply, or are paused, hung the resume in issue 73): each run
    says how to go on, the nodes reconnect by themselves, every `resume`
    finishes within its bounds (node-wait, round-timeout: a node that never
    answers would be a recorded failure, not a wait) and the run ends with
    the rounds an uninterrupted run has (FedDyn's clients read h_k back
    from their nodes' state-dir)."""
    # both nodes in every round, each waited for up to 60 s: on a loaded CI
    # machine a resume's round trained one client, the other node still
    # reconnecting to the restarted SuperLink (min-available-nodes=1 starts
    # a round with the nodes listed; a query's answer was waited for 30 s)
    common = (
        "strategy='feddyn' rounds=6 checkpoint-every=1 min-available-nodes=2 "
        "node-wait=60 round-timeout=60"
    )
    finish(submit(restarting, tmp_path, f"{common} run-name='whole'", NODES))
    crashed = tmp_path / "crashed"
    run = submit(restarting, tmp_path, f"{common} run-name='crashed'", NODES)
    for kill in range(1, KILLS + 1):
        checkpoint = crashed / "checkpoints" / f"round-{kill:05d}"
        deadline = time.monotonic() + 120  # start-up and a round: 20-30 s here
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checkpoint.exists(), run.communicate()[0][-3000:]
        paused = cluster.Deployment.load(restarting.root).node(kill % NODES).pid
        superlink = cluster.Deployment.load(restarting.root).superlink_pid
        os.killpg(paused, signal.SIGSTOP)  # the node, its executor and its task
        try:
            os.kill(superlink, signal.SIGKILL)
            os.waitpid(superlink, 0)  # this test started it: reap it, as init would
            output = run.communicate(timeout=120)[0]
            assert run.returncode != 0
            assert "`pollen deploy restart superlink --dir" in output, output[-3000:]
            assert f"--deployment {restarting.root} -c" in output
            assert f"resume='{crashed}'" in output
            cluster.restart_superlink(restarting.root)
        finally:
            os.killpg(paused, signal.SIGCONT)
        cluster.Deployment.load(restarting.root).wait_online(NODES, timeout=120)
        run = submit(restarting, tmp_path, f"{common} resume='{crashed}'", NODES)
    finish(run, timeout=240)
    failed = {r["round"]: r["failures"] for r in history(crashed) if r["failures"]}
    assert not failed, f"{failed}\n{_log_tails(restarting)}"
    keys = ("round", "accuracy", "loss", "clients", "bytes-up", "bytes-down")
    assert [[r[k] for k in keys] for r in history(crashed)] == [
        [r[k] for k in keys] for r in history(tmp_path / "whole")
    ]


def _log_tails(deployment: cluster.Deployment, chars: int = 3000) -> str:
    """The end of each node's and executor's log: what a failed reply's
    node said (a test's failure message on CI is all there is to read)."""
    logs = [log for n in deployment.nodes for log in (n.log, n.executor_log)]
    return "\n".join(
        f"--- {log}\n{processes.log_tail(Path(log), chars)}" for log in logs
    )


@pytest.mark.xdist_group("warm-executor")
@pytest.mark.integration
def test_a_killed_child_fails_its_reply_and_the_next_round_trains(
    warm: cluster.Deployment, tmp_path: Path
) -> None:
    executor = warm.node(1).executor_pid
    # The killed task's reply never comes: round 2 ends at round-timeout. Its
    # SuperNode takes no other message until its task token expires, about
    # 60 s after the kill (no task heartbeat for 2 x 30 s), when Flower
    # stores a CLIENT_APP_CRASHED_ERROR reply for the message: with
    # round-timeout=30, round 3 timed out on node 1 too (CI, 2026-11-25).
    run = submit(
        warm, tmp_path,
        "rounds=3 local-epochs=24 round-timeout=60 run-name='kill'", NODES,
    )  # fmt: skip
    wait_for_rounds(tmp_path / "kill", 1, run)
    # round 2's task: started after round 1 was recorded (it may have started
    # before this test looked: the history is polled every 0.5 s)
    recorded = (tmp_path / "kill" / "history.json").stat().st_mtime
    child = _wait_for_child(executor, set(), started_after=recorded - 0.05)
    # killed before it pulls its message, the task is re-run by Flower and
    # round 2 succeeds: kill it once it has worked for a while (the pull
    # comes first; 24 local epochs take a few CPU seconds after it even on a
    # fast machine: 8 took 1.07 s of the task's time on 2026-12-04's CI
    # machine, and the task ended before this test saw 1 s of its CPU)
    _wait_for_cpu(child, seconds=1.0)
    os.kill(child, signal.SIGKILL)
    output = finish(run)
    rows = history(tmp_path / "kill")
    assert [bool(r["failures"]) for r in rows] == [False, True, False], output[-3000:]
    assert "no reply for 1 of clients [1]" in rows[1]["failures"][0]
    assert processes.alive(executor)
    assert f"task {child} exited -9" in Path(warm.node(1).executor_log).read_text()


def _wait_for_child(
    executor: int, earlier: set[int], started_after: float = 0.0
) -> int:
    """The warm executor's first task child not in `earlier` and started after
    the wall-clock time `started_after` (a task of an earlier round may still
    be exiting). Only its own children are tasks: a task's own short-lived
    subprocesses (a library asking `uname`) are not."""
    # process start times count from boot, as /proc/uptime does (to 10 ms)
    since_boot = _uptime() - (time.time() - started_after) if started_after else 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for pid in set(processes.descendants(executor)) - earlier:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                started = _started_since_boot(pid)
                parent = _stat(pid)[1]
            except OSError:
                continue
            task = b"flower-superexec" not in command and b"launcher.py" not in command
            task = task and int(parent) == executor
            if task and started >= since_boot:
                return pid
        time.sleep(0.05)
    raise AssertionError("no task started")


def _wait_for_cpu(pid: int, seconds: float) -> None:
    """Until process `pid` has run `seconds` of CPU time (user and system)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            fields = _stat(pid)
        except FileNotFoundError:
            raise AssertionError(
                f"task {pid} ended before {seconds} s of CPU"
            ) from None
        if (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") >= seconds:
            return
        time.sleep(0.02)
    raise AssertionError(f"task {pid} used under {seconds} s of CPU in 120 s")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _started_since_boot(pid: int) -> float:
    """When process `pid` started, in seconds since boot."""
    return int(_stat(pid)[19]) / os.sysconf("SC_CLK_TCK")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


@pytest.mark.xdist_group("warm-executor")
@pytest.mark.integration
def test_a_killed_warm_parent_takes_its_processes_and_restarts(
    warm: cluster.Deployment, tmp_path: Path
) -> None:
    node = warm.node(0)
    below = processes.descendants(node.executor_pid)
    assert below  # its flower-superexec
    workdirs = list(WORKDIRS.glob(f"{superexec.WORKDIR_PREFIX}{node.executor_pid}-*"))
    assert len(workdirs) == 1 and (workdirs[0] / "warm.sock").exists()
    os.kill(node.executor_pid, signal.SIGKILL)
    os.waitpid(node.executor_pid, 0)  # this test started it: reap it, as init would
    deadline = time.monotonic() + 30
    while [p for p in below if processes.alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in below if processes.alive(p)]
    restarted = cluster.restart_node(warm.root, 0)
    assert restarted.executor_pid != node.executor_pid
    cluster.Deployment.load(warm.root).wait_online(NODES)
    finish(submit(warm, tmp_path, "rounds=1 run-name='after'", NODES))
    (row,) = history(tmp_path / "after")
    assert row["clients"] == [0, 1] and not row["failures"]
    assert not workdirs[0].exists()  # the new parent removed the killed one's


@pytest.mark.xdist_group("warm-executor")
@pytest.mark.integration
def test_a_changed_app_runs_its_own_code_not_the_preloaded(
    warm: cluster.Deployment, tmp_path: Path
) -> None:
    """Run the app (the parents warm it), then a copy whose ClientApp writes
    a marker into the node's state-dir, then the original again."""
    changed = tmp_path / "changed"
    changed.mkdir()
    shutil.copy(PROJECT / "pyproject.toml", changed)
    shutil.copytree(PROJECT / "pollen", changed / "pollen",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    client_app = changed / "pollen" / "client_app.py"
    source = client_app.read_text()
    anchor = (
        "    cm = ClientModel.assemble(msg, context)\n"
        "    run = cm.local_run(float(msg.content[CONFIG][LR]))\n"
    )
    assert anchor in source
    client_app.write_text(source.replace(anchor, anchor + (
        '    state_dir = Path(str(context.node_config["state-dir"]))\n'
        '    state_dir.mkdir(parents=True, exist_ok=True)\n'
        '    (state_dir / "marker").write_text("changed code")\n'
    )))  # fmt: skip
    markers = [warm.root / "state" / f"node-{k}" / "marker" for k in range(NODES)]
    for app, name in ((PROJECT, "before"), (changed, "changed"), (PROJECT, "after")):
        for marker in markers:
            marker.unlink(missing_ok=True)
        out = tmp_path / "results"
        finish(submit(warm, out, f"rounds=1 run-name='{name}'", NODES, app))
        wrote = [m.exists() for m in markers]
        assert wrote == [name == "changed"] * NODES, name

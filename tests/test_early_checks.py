"""Mistakes caught before any Flower process starts: each `pollen run` below
exits with status 2 and one line naming the key, the value and what is
allowed, without staging the app for Flower (issue 32's list of inputs that
used to be found only after start-up, or not at all)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pollen.cli import EXIT_BAD_INPUT, main
from pollen.deployment import launch, processes
from pollen.deployment.run_config import prepare_run, resolve_settings
from pollen.files import read_npz
from pollen.runs.checkpoints import Checkpoint, save_checkpoint
from pollen.runs.claim import claim
from pollen.runs.results import check_run_dir_is_new
from pollen.task import partition
from pollen.task.shards import federated_data
from tests.conftest import PROJECT, resumable_extra


@pytest.fixture
def no_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as staging the app for Flower."""

    def staged_app(app: Path) -> None:
        raise AssertionError("the run reached Flower before its check")

    monkeypatch.setattr(launch, "staged_app", staged_app)


CASES = [
    ("rounds=", r"'rounds=' has no value"),
    ("lr=0.01 rounds= local-epochs=2", r"'rounds=' has no value"),
    ("rounds 3", r"'rounds' is not key=value"),
    ("rounds='ten'", r"'rounds': 'ten'; allowed: an integer"),
    (
        "partition='pathological' classes-per-client=11",
        r"classes-per-client=11 with data-set='digits', which has 10 classes",
    ),
    ("dp=true model='mlp-bn'", r"dp=true with model='mlp-bn': its BatchNorm"),
    ("num-clients=100000", r"training split has 1,437 examples.*1 to 1437"),
    ("bn-policy='fedbn'", r"bn-policy='fedbn' with model='mlp', which has no"),
    ("tracking-uri='http://127.0.0.1:5000'", r"only tracker='mlflow' logs to a"),
    (
        "tracker='mlflow' tracking-uri='mlruns'",
        r"'tracking-uri': 'mlruns'; allowed: empty, an http\(s\) URL",
    ),
    ("run-name='../../x'", r"invalid value for 'run-name': '../../x'; allowed: a name"),
    ("run-name='/tmp/x'", r"invalid value for 'run-name': '/tmp/x'"),
    (
        "partition='niid' num-clients=1000 min-size=10",
        r"'min-size': 10; partition 'niid' needs .* = 10,000 samples, the training "
        r"split has 1,437; allowed: min-size at most 1",
    ),
    (
        "partition='niid-client' num-clients=200 min-size=10",
        r"gives each of 200 clients 7",
    ),
    ("lr=0.1 lrr=1", r"unknown run-config key 'lrr'; did you mean 'lr'\?"),
    ("colour=1", r"unknown run-config key 'colour'; `pollen list keys` lists every"),
]


@pytest.mark.parametrize(("config", "message"), CASES, ids=[c for c, _ in CASES])
def test_a_mistake_stops_before_flower_starts(
    config: str, message: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}'", "-c", config]
    assert main(argv) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert re.search(message, error), error
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_a_device_this_machine_lacks_stops_a_simulation(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda' is valid here")
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}' device='cuda'"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "'cuda'; no CUDA device here; allowed here: auto" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[: len(raw) // 2], r"cannot read .*mnist\.npz"),
        (lambda raw: b"not a zip archive" * 10, r"cannot read .*mnist\.npz"),
        (None, r"no data for 'mnist'.*set download=true"),
    ],
    ids=["truncated", "garbage", "missing"],
)
def test_a_damaged_data_file_stops_before_flower_starts(
    damage, message: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    """The data set the run names is read before Flower starts (and left
    decoded in the cache for the run); a damaged file is one line, exit 2."""
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "y_train": np.arange(20, dtype=np.uint8) % 10,
        "x_test": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "y_test": np.arange(10, dtype=np.uint8),
    }
    data = tmp_path / "data"
    data.mkdir()
    np.savez_compressed(data / "mnist.npz", **arrays)
    if damage is None:
        (data / "mnist.npz").unlink()
    else:
        (data / "mnist.npz").write_bytes(damage((data / "mnist.npz").read_bytes()))
    config = (f"output-dir='{tmp_path}' data-set='mnist' data-root='{data}' "
              "download=false num-clients=2")  # fmt: skip
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "data-set='mnist'" in error
    assert re.search(message, error), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no run dir


def test_an_output_dir_inside_a_run_directory_is_refused(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    """A new run nested inside an old run's results would pass for part of them."""
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "settings.json").write_text('{"run-name": "old-run"}')
    argv = ["run", str(PROJECT), "-c", f"output-dir='{old / 'plots'}'"]
    assert main(argv) == EXIT_BAD_INPUT
    assert f"is inside the run directory {old}" in capsys.readouterr().err
    assert sorted(p.name for p in old.iterdir()) == ["settings.json"]
    stray = tmp_path / "notes"  # a settings.json that is not a run's
    stray.mkdir()
    (stray / "settings.json").write_text("{}")
    assert check_run_dir_is_new(str(stray / "out"), "r") == stray / "out" / "r"


def test_a_tracking_server_that_does_not_answer_stops_the_run(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    uri = f"http://127.0.0.1:{processes.free_port()}"
    config = f"output-dir='{tmp_path}' tracker='mlflow' tracking-uri='{uri}'"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    assert f"no MLflow tracking server answers at {uri}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("federation", "message"),
    [
        ("num-supernodes=0", r"num-supernodes=0; allowed: an integer >= 1"),
        ("num-supernodes=-1", r"num-supernodes=-1; allowed: an integer >= 1"),
        ("client-resources-num-cpus=0", r"client-resources-num-cpus=0; allowed"),
        ("client-resources-num-cpus=999", r"client-resources-num-cpus=999; allowed"),
    ],
)
def test_a_federation_no_node_could_serve_is_refused(
    federation: str, message: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}'",
            "--federation-config", federation]  # fmt: skip
    started = time.monotonic()
    assert main(argv) == EXIT_BAD_INPUT
    assert time.monotonic() - started < 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and re.search(message, error), error
    assert not any(tmp_path.iterdir())


def test_an_output_dir_under_a_file_is_refused_before_flower(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    (tmp_path / "file").write_text("not a folder")
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path / 'file' / 'out'}'"]
    assert main(argv) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert "invalid value for 'output-dir': cannot create" in error
    assert "output-dir must be a folder this user can write" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_read_only_output_dir_is_refused_before_flower(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    """A read-only mount (as root, whom mode bits do not stop)."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(target), str(target)],
                             capture_output=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"mount refused here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        argv = ["run", str(PROJECT), "-c", f"output-dir='{target / 'out'}'"]
        assert main(argv) == EXIT_BAD_INPUT
        assert "Read-only file system" in capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert not any(target.iterdir())


def test_a_data_root_that_is_a_file_is_named(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    (tmp_path / "data").write_text("")
    config = f"output-dir='{tmp_path}' data-set='mnist' data-root='{tmp_path / 'data'}'"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "is a file; data-root must be a folder" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_an_unreadable_data_root_is_one_line(tmp_path: Path) -> None:
    """A data-root folder this user cannot read: as an unprivileged user
    (root reads any folder), where the venv is reachable for one."""
    data = tmp_path / "data"
    data.mkdir(mode=0o000)
    tmp_path.chmod(0o755)
    config = f"output-dir='/tmp' data-set='mnist' data-root='{data}'"
    code = (
        "import sys; from pollen.cli import main; "
        f"sys.exit(main(['run', {str(PROJECT)!r}, '-c', {config!r}]))"
    )
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        probe = subprocess.run([*user, sys.executable, "-c", "import pollen"],
                               capture_output=True, check=False, cwd="/")  # fmt: skip
        if probe.returncode != 0:
            pytest.skip("an unprivileged user cannot reach this venv or project")
        command = [*user, *command]
    run = subprocess.run(command, capture_output=True, text=True, check=False, cwd="/")
    assert run.returncode == EXIT_BAD_INPUT, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert f"cannot read {data}: permission denied" in run.stderr


def _checkpointed_run(run_dir: Path, config: str) -> None:
    """A run directory with a checkpoint of round 1 written under `config`."""
    settings = resolve_settings(PROJECT, [config])
    run_dir.mkdir()
    (run_dir / "settings.json").write_text(json.dumps({"run-name": run_dir.name}))
    save_checkpoint(run_dir, Checkpoint(
        1, {"w": np.ones((50, 50), np.float32)}, {"m": np.zeros(3)},
        resumable_extra(settings.to_run_config()),
    ), keep=1)  # fmt: skip


@pytest.mark.parametrize("damaged", ["model.npz", "strategy.npz"])
def test_a_damaged_checkpoint_stops_a_resume_before_flower(
    damaged: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    """Every file of the checkpoint is read before start-up: a truncated one
    is named, exit 2, nothing written."""
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, f"output-dir='{tmp_path}' rounds=3")
    path = run_dir / "checkpoints" / "round-00001" / damaged
    path.write_bytes(path.read_bytes()[:100])
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    started = time.monotonic()
    config = f"output-dir='{tmp_path}' rounds=5 resume='{run_dir}'"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    assert time.monotonic() - started < 2
    assert f"cannot read {path}" in capsys.readouterr().err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_resume_of_a_directory_another_run_holds_is_refused(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, f"output-dir='{tmp_path}' rounds=3")
    other = claim(run_dir, new=False)  # the command that runs it now
    try:
        config = f"output-dir='{tmp_path}' rounds=5 resume='{run_dir}'"
        assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
        error = capsys.readouterr().err
        assert f"{run_dir} is in use by another pollen run (pid {os.getpid()})" in error
    finally:
        other.release()
    claim(run_dir, new=False).release()  # released: free again


def test_a_partition_that_leaves_clients_empty_stops_before_flower(
    no_flower: None, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dirichlet(0.001) gives some of 20 clients nothing: the command draws
    the partition itself, exit 2, one line (found by the ServerApp 11-17 s
    after start-up before). Where this machine holds no copy of the data
    (mnist, nothing under data-root, download=true) the ServerApp draws as
    before: nothing is downloaded, nothing refused."""
    monkeypatch.delenv("POLLEN_CACHE_DIR", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    request = "partition='niid' alpha=0.001 num-clients=20 min-size=0"
    config = f"output-dir='{tmp_path / 'out'}' data-root='{data}' {request}"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert re.search(
        r"partition 'niid' with num-clients=20 leaves client \d+ without training "
        r"samples \(\d+ of 20 clients empty\); raise min-size \(now 0\) to at "
        r"least 1 or use fewer clients \(data-set='digits'\)$",
        error,
    ), error
    assert not (tmp_path / "out").exists()
    before = sorted(data.rglob("*"))  # the digits partition, kept
    elsewhere = f"{config} data-set='mnist' model='mlp' download=true"
    prepare_run(PROJECT, [elsewhere])
    assert sorted(data.rglob("*")) == before


def test_the_server_app_reads_the_partition_the_command_drew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One draw per partition: a second command and the ServerApp read the
    file the first command left, flwr-datasets not called again."""
    monkeypatch.delenv("POLLEN_CACHE_DIR", raising=False)
    data = tmp_path / "data"
    config = (f"output-dir='{tmp_path}' data-root='{data}' partition='niid' "
              "alpha=0.3 num-clients=5")  # fmt: skip
    settings, _, _ = prepare_run(PROJECT, [config])
    (saved,) = (data / ".pollen-cache" / "partitions").glob("*.npz")
    drawn = read_npz(saved)

    def no_draw(*_):
        raise AssertionError("drew the partition again instead of reading it")

    monkeypatch.setattr(partition, "_flwr_partition", no_draw)
    prepare_run(PROJECT, [config])
    _, shards = federated_data(settings)
    kept = [np.sort(drawn[f"shard-{c}"]) for c in range(5)]
    assert all(np.array_equal(a, b) for a, b in zip(shards, kept, strict=True))

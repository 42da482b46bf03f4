"""What `pollen run` checks of the run's model before any process starts
(`pollen/deployment/model_checks.py`, issue 78): a resumed checkpoint whose
entries are not those of the model built now is refused in one line
naming what was added, what is missing and what was resized, in the
ServerApp's words too; a model whose copies would not fit this machine's
memory is warned about, with the estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.cli import EXIT_BAD_INPUT, main
from pollen.deployment import launch, model_checks
from pollen.deployment.model_checks import (
    ModelSize,
    available_memory,
    memory_estimate,
    optimizer_copies,
)
from pollen.deployment.run_config import prepare_run, resolve_settings
from pollen.runs.checkpoints import Checkpoint, model_problem, save_checkpoint
from pollen.runs.progress import ServerParts
from pollen.settings import SettingsError
from tests.conftest import PROJECT, resumable_extra
from tests.user_package import PACKAGE, on_path, write_user_package

TINY = f"model='{PACKAGE}.nets:tiny_net'"  # on digits: 1.weight 16x64 ... 3.bias 10
# tiny_net's entries with its hidden layer renamed and its classifier resized
RENAMED = {
    "hidden.weight": np.zeros((16, 64), np.float32),
    "hidden.bias": np.zeros(16, np.float32),
    "3.weight": np.zeros((12, 16), np.float32),
    "3.bias": np.zeros(10, np.float32),
}
WORDS = (
    "invalid value for 'resume': the entries of the checkpoint's model (round 1) "
    f"are not those of model '{PACKAGE}.nets:tiny_net' as it is built now: added "
    "1.bias, 1.weight (the model has, the checkpoint lacks); missing hidden.bias, "
    "hidden.weight (the checkpoint has, the model lacks); resized 3.weight 12x16 "
    "in the checkpoint, 10x16 in the model; resume with the model that wrote the "
    "checkpoint, or start a new run"
)


@pytest.fixture(scope="module", autouse=True)
def user_package(tmp_path_factory) -> Iterator[Path]:
    with on_path(write_user_package(tmp_path_factory.mktemp("user"))) as root:
        yield root


def _checkpointed_run(run_dir: Path, config: str, model: dict) -> None:
    """A run directory with a checkpoint of round 1 of `model`, written
    under `config`."""
    settings = resolve_settings(PROJECT, [config])
    run_dir.mkdir()
    (run_dir / "settings.json").write_text(json.dumps({"run-name": run_dir.name}))
    extra = resumable_extra(settings.to_run_config())
    save_checkpoint(run_dir, Checkpoint(1, model, {}, extra), keep=1)


def test_a_resume_of_a_model_whose_layer_was_renamed_stops_before_flower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def staged_app(app: Path) -> None:
        raise AssertionError("the run reached Flower before its check")

    monkeypatch.setattr(launch, "staged_app", staged_app)
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, f"output-dir='{tmp_path}' rounds=3 {TINY}", RENAMED)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    config = f"output-dir='{tmp_path}' rounds=5 {TINY} resume='{run_dir}'"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == [f"pollen: error: {WORDS}"], error
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_resume_of_the_model_that_wrote_the_checkpoint_is_prepared(
    tmp_path: Path,
) -> None:
    settings = resolve_settings(PROJECT, [TINY])
    size = model_checks.built_model(settings)
    assert size is not None and size.entries["3.weight"] == (10, 16)
    model = {name: np.zeros(shape, np.float32) for name, shape in size.entries.items()}
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, f"output-dir='{tmp_path}' rounds=3 {TINY}", model)
    config = f"output-dir='{tmp_path}' rounds=5 {TINY} resume='{run_dir}'"
    assert prepare_run(PROJECT, [config])[2] == 1


def test_the_server_app_refuses_the_checkpoint_in_the_same_words() -> None:
    """`ServerParts.restore` asks `model_problem` as the command does; it
    refuses before it touches the parts, so none are built here."""
    size = model_checks.built_model(resolve_settings(PROJECT, [TINY]))
    assert size is not None
    parts = ServerParts(None, None, None)  # type: ignore[arg-type]
    with pytest.raises(SettingsError) as refused:
        parts.restore(Checkpoint(1, RENAMED), size.entries, f"{PACKAGE}.nets:tiny_net")
    assert str(refused.value) == WORDS


def test_a_refusal_names_a_few_entries_of_each_kind_then_how_many_more() -> None:
    checkpoint = Checkpoint(4, {f"old.{i}": np.zeros(2) for i in range(5)})
    problem = model_problem(checkpoint, {"new.0", "old.0"}, "net")
    assert problem is not None
    assert "added new.0 (the model has" in problem
    assert "missing old.1, old.2, old.3 and 1 more (the checkpoint has" in problem
    assert "resized" not in problem  # names only: shapes unknown
    scalar = Checkpoint(4, {"n": np.array(3)})
    assert "resized n scalar in the checkpoint, 1 in the model" in str(
        model_problem(scalar, {"n": (1,)}, "net")
    )
    assert model_problem(scalar, {"n": ()}, "net") is None


def test_a_built_in_model_on_a_built_in_data_set_keeps_the_command_torch_free() -> None:
    probe = (
        "import sys; from pathlib import Path; "
        "from pollen.deployment.run_config import prepare_run; "
        f"prepare_run(Path({str(PROJECT)!r}), ['output-dir=\"/nonexistent/x\"']); "
        "print('torch' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert run.stdout.strip().splitlines()[-1] == "False"


MILLION = ModelSize({}, parameters=1_000_000, trainable=1_000_000)


@pytest.mark.parametrize(
    ("optimizer", "momentum", "copies", "client"),
    [
        ("adam", 0.9, 2, 16_000_000),  # model, gradient, two moments: 4 x 4 MB
        ("adamw", 0.0, 2, 16_000_000),
        ("sgd", 0.9, 1, 12_000_000),  # model, gradient, momentum buffer
        ("sgd", 0.0, 0, 8_000_000),  # model, gradient
    ],
)
def test_the_memory_estimate_by_hand(
    optimizer: str, momentum: float, copies: int, client: int
) -> None:
    assert optimizer_copies(optimizer, momentum) == copies
    estimate = memory_estimate(MILLION, copies, at_once=4, sampled=10)
    assert estimate.client_bytes == client
    # the global model 4 MB, ten replies 40 MB, the float64 aggregate 8 MB
    assert estimate.server_bytes == 52_000_000
    assert estimate.total == 4 * client + 52_000_000
    assert estimate.round_traffic == 40_000_000


def test_frozen_parameters_have_no_gradient_or_optimiser_state() -> None:
    half = ModelSize({}, parameters=1_000_000, trainable=500_000)
    assert memory_estimate(half, 2, 1, 1).client_bytes == 4_000_000 + 6_000_000


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24000000 kB\nMemAvailable:    2048 kB\n")
    assert available_memory(meminfo) == 2048 * 1024
    assert available_memory(tmp_path / "absent") is None
    meminfo.write_text("MemTotal:  24000000 kB\n")
    assert available_memory(meminfo) is None


@pytest.mark.parametrize("available", [8 * 10**9, 16 * 10**9, None])
def test_a_model_beyond_the_available_memory_is_warned_about(
    available: int | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """The issue's model: 201 million parameters, trained with adam by the
    2 clients a round samples (10 clients, a fifth each round) on 2
    cores: 3.216 GB a client (model, gradient, two moments), the server
    4.02 GB (the model, 2 replies, the float64 aggregate), 10.452 GB in all."""
    size = ModelSize({}, parameters=201_000_000, trainable=201_000_000)
    monkeypatch.setattr(launch, "built_model", lambda settings: size)
    monkeypatch.setattr(model_checks, "available_memory", lambda: available)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    config = (
        f"output-dir='{tmp_path}' client-optimizer='adam' lr=0.001 num-clients=10 "
        "client-frac=0.2"
    )
    settings, _, _ = prepare_run(PROJECT, [config])
    launch.checked_federation(settings, [], launch.Target(connection="remote"))
    assert not capsys.readouterr().err  # a deployment's nodes: not estimated here
    launch.checked_federation(settings, [], launch.Target())  # warns, goes on
    error = capsys.readouterr().err
    if available != 8 * 10**9:
        assert "warning" not in error
        return
    assert error.strip().splitlines() == [
        "pollen: warning: model 'mlp' (201,000,000 parameters) may not fit this "
        "machine's memory: a simulation here needs about 10.5 GB (2 clients "
        "training at once, 3.2 GB each with adam's state; the server's copies "
        "4.0 GB), 8.0 GB is available; each round sends 1.6 GB down and 1.6 GB up "
        "(2 clients); train fewer clients at once (--federation-config "
        '"client-resources-num-cpus=2"), sample fewer (client-frac), or choose a '
        "smaller model"
    ]

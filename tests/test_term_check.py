"""A user's local-objective term tried for one step in the command: a pull
that is not a number and a term that drops gradients are refused before any
process starts (they made every client fail, or trained nothing, unsaid)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollen.deployment import launch
from pollen.deployment.run_config import prepare_run
from pollen.settings import Settings, SettingsError
from pollen.task.term_check import term_problem
from tests.conftest import PROJECT
from tests.user_package import PACKAGE, on_path, write_user_package

BROKEN = f"{PACKAGE}.broken_objectives"


@pytest.fixture(scope="module", autouse=True)
def user_package(tmp_path_factory) -> Iterator[Path]:
    with on_path(write_user_package(tmp_path_factory.mktemp("user"))) as root:
        yield root


def problem(objective: str, **values: object) -> str | None:
    run_config = {"local-objective": objective, "prox-mu": 0.01, **values}
    return term_problem(Settings.from_run_config(run_config))


def test_a_pull_that_is_a_tensor_is_refused_by_its_shape() -> None:
    assert problem(f"{BROKEN}:TensorPull") == (
        f"local-objective='{BROKEN}:TensorPull': its term's pull is a Tensor of "
        "shape []; expected a finite float (a number each reply's metrics carry)"
    )


def test_a_term_that_sets_gradients_to_none_is_refused_naming_them() -> None:
    said = problem(f"{BROKEN}:Dropping", model="mlp")
    assert said is not None
    assert said.startswith(
        f"local-objective='{BROKEN}:Dropping': its term left no gradient on "
        "'1.weight', '1.bias', '3.weight' and 3 more after one step"
    ), said


def test_a_tensor_pull_is_harmless_where_the_optimiser_is_not_sgd() -> None:
    """Only SGD's replies compute FedNova's effective steps from the pull."""
    assert problem(f"{BROKEN}:TensorPull", **{"client-optimizer": "adam"}) is None


def test_a_term_sees_the_trainable_parameters_as_the_training_loop_gives_them() -> None:
    """A frozen layer's parameters are not handed to the term (they have no
    gradient to add to), as in the clients' loop."""
    assert (
        problem(f"{PACKAGE}.objectives:L1Decay", model=f"{PACKAGE}.nets:half_frozen")
        is None
    )


@pytest.mark.parametrize(
    "objective",
    [f"{PACKAGE}.objectives:L1Decay", "prox", "feddyn", "scaffold", "plain",
     f"{BROKEN}:NeedsMessage"],
)  # fmt: skip
def test_sound_terms_and_those_a_step_cannot_try_pass(objective: str) -> None:
    """pollen's own terms pass; a term that reads what only the server's
    message carries is left to the clients (not refused on a guess)."""
    assert problem(objective) is None


def test_the_command_refuses_a_broken_term_before_anything_starts(
    tmp_path: Path,
) -> None:
    """`pollen run`'s preparation, before any Flower process: the line the
    clients would otherwise have failed on, each of them, every round."""
    with pytest.raises(SettingsError, match=r"its term's pull is a Tensor"):
        prepare_run(PROJECT, [f"local-objective='{BROKEN}:TensorPull' "
                              f"output-dir='{tmp_path}'"])  # fmt: skip
    settings, _, _ = prepare_run(
        PROJECT, [f"local-objective='{PACKAGE}.objectives:L1Decay' prox-mu=0.01 "
                  f"output-dir='{tmp_path}'"]
    )  # fmt: skip
    assert settings.local_objective == f"{PACKAGE}.objectives:L1Decay"
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_command_builds_a_users_model_once(tmp_path: Path) -> None:
    """Validation, the term's step, the entries and the memory estimate all
    read one build (a factory of a minute cost three before start-up)."""
    nets = importlib.import_module(f"{PACKAGE}.nets")
    settings, _, _ = prepare_run(
        PROJECT, [f"model='{PACKAGE}.nets:counted' output-dir='{tmp_path}' "
                  f"local-objective='{PACKAGE}.objectives:L1Decay' prox-mu=0.01"]
    )  # fmt: skip
    launch.checked_federation(settings, [], launch.Target())
    assert len(nets.BUILT) == 1

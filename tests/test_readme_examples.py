"""Every `pollen run` example of the README, run as written but shortened.

A newcomer copies the README's commands and changes one setting; each must
train to an accuracy a practitioner would call sensible for its few rounds
(issue 32: the digits run's lr once gave MNIST 25% after a round). The
commands are read from the README itself, so an example added there without
a row in `EXAMPLES` fails here, and one edited there is the one that runs.
Each runs on the session's warm federation with the rounds its row gives
and the real data sets from `../shared/data`, and must reach its accuracy
after the last round (chance is 10% everywhere): the global model's, or
where clients keep entries of their own (FedBN) the mean of their own
models' accuracies on their own test shards, which is what such a run is
for.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from pollen.experiments.report import Run
from tests.conftest import PROJECT
from tests.test_simulation import pollen_run

COMMAND = re.compile(r"^\.venv/bin/pollen run \.(?P<args>[^#\n]*)", re.MULTILINE)


@dataclass(frozen=True)
class Example:
    """How one README example is checked: run for `rounds` and held to
    `accuracy` (of each client's own model on its own shard if `personal`),
    or by the named test that already runs it (`covered_by`)."""

    accuracy: float = 0.0
    rounds: int = 2
    personal: bool = False
    real_data: bool = False  # reads a data set from ../shared/data
    covered_by: str = ""


# The README's `pollen run .` arguments (after `.`, before any comment) and
# how each is checked.
EXAMPLES = {
    "": Example(covered_by="tests/test_simulation.py::test_default_run_trains_digits_and_writes_results"),
    "-v": Example(covered_by="tests/test_console.py::test_verbose_shows_the_whole_stream"),
    '--deployment .pollen-deploy -c "num-clients=2"': Example(
        covered_by="tests/test_deployment.py::test_fedavg_and_feddyn_train_on_real_processes"
    ),
    '''-c "strategy='fedprox' partition='niid' alpha=0.3"''': Example(accuracy=0.8, rounds=5),
    "-c configs/mnist-fedavg.toml": Example(accuracy=0.95, real_data=True),
    '''-c "data-set='mnist' data-root='../shared/data'"''': Example(
        accuracy=0.9, real_data=True
    ),
    # the same run at 10,000 clients: Synthetic(1, 1) gives every client a task
    # of its own, so a global model stays near chance on the first 1,000
    # clients' test splits whatever the rounds; the example shows scale, and
    # that test holds it to a falling loss
    '''-c "data-set='synthetic' model='logreg' num-clients=100000 client-frac=0.001"''': Example(
        covered_by="tests/test_simulation.py::test_ten_thousand_clients_share_a_hundred_nodes",
    ),
    # the same with cohorts (run whole by benchmarks/cohort.py --end-to-end); the
    # cohort test holds a cohort run's history to the sequential one
    '''-c "data-set='synthetic' model='logreg' num-clients=100000 client-frac=0.001 client-execution='cohort'"''': Example(
        covered_by="tests/test_simulation.py::test_cohorts_train_the_rounds_sequential_training_does",
    ),
    # SecAgg+ on the default digits run: the secure-aggregation test runs
    # these settings and holds them to the plain run's history
    '''-c "secure-aggregation='secagg+' num-clients=6 client-frac=1.0"''': Example(
        covered_by="tests/test_simulation.py::test_secure_aggregation_trains_the_rounds_plain_aggregation_does",
    ),
    '''-c "tracker='mlflow'"''': Example(accuracy=0.8),
    '''-c "model='mlp-bn' strategy='fedyogi' bn-policy='fedbn'"''': Example(
        accuracy=0.8, personal=True
    ),
    '''-c "strategy='fedavg' local-objective='sam' client-optimizer='adamw'"''': Example(
        accuracy=0.9
    ),
}  # fmt: skip


def words(args: str) -> tuple[str, ...]:
    """A command's arguments as the shell splits them."""
    return tuple(shlex.split(args))


def readme_examples() -> list[tuple[str, ...]]:
    """The arguments of every `.venv/bin/pollen run .` line in the README."""
    text = (PROJECT / "README.md").read_text()
    return [words(m["args"]) for m in COMMAND.finditer(text)]


def test_every_readme_example_has_a_check() -> None:
    found = readme_examples()
    assert found, "no `.venv/bin/pollen run .` line found in README.md"
    known = {words(args) for args in EXAMPLES}
    unchecked = [shlex.join(args) for args in found if args not in known]
    assert not unchecked, f"README examples without a row in EXAMPLES: {unchecked}"
    stale = known - set(found)
    assert not stale, f"EXAMPLES rows no longer in the README: {stale}"


@pytest.mark.parametrize(
    "args", [a for a, e in EXAMPLES.items() if e.covered_by], ids=lambda a: a or "."
)
def test_a_covered_example_names_a_test_that_exists(args: str) -> None:
    path, _, name = EXAMPLES[args].covered_by.partition("::")
    assert f"def {name}(" in (PROJECT / path).read_text(), EXAMPLES[args].covered_by


@pytest.mark.integration
@pytest.mark.parametrize(
    "args", [a for a, e in EXAMPLES.items() if not e.covered_by], ids=lambda a: a
)
def test_readme_example_learns(
    args: str, request: pytest.FixtureRequest, tmp_path: Path, warm_federation: Path
) -> None:
    example = EXAMPLES[args]
    given = words(args)
    config = [value for flag, value in pairwise(given) if flag == "-c"]
    if example.real_data:
        data_root = request.getfixturevalue("shared_data")  # skips without it
        config.append(f"data-root='{data_root}' download=false")
    run = pollen_run(
        *config,
        f"rounds={example.rounds} output-dir='{tmp_path}' run-name='example'",
        cwd=PROJECT,
        warm=warm_federation,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = Run.read(tmp_path / "example")
    assert len(run_dir.history) == example.rounds
    if example.personal:
        own = run_dir.own_accuracies()
        assert own and np.mean(own) >= example.accuracy, (args, own)
    else:
        last = run_dir.history[-1]
        assert last["accuracy"] >= example.accuracy, (args, last)

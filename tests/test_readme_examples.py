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
from tests.conftest import PROJECT, fenced_blocks
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
    '''-c "strategy='fedprox' partition='niid' alpha=0.3"''': Example(accuracy=0.8, rounds=5),
    '''-c "model='mlp-bn' strategy='fedyogi' bn-policy='fedbn'"''': Example(
        accuracy=0.8, personal=True
    ),
}  # fmt: skip

# Every other command of the README's shell blocks, and the test that runs it
# as written (`make test` is what CI runs).
OTHER_COMMANDS = {
    "make run": "tests/test_simulation.py::test_default_run_trains_digits_and_writes_results",
    "make test": ".ci/run",
    ".venv/bin/pollen list": "tests/test_readme_examples.py::test_the_readmes_listing_commands_print",
    ".venv/bin/pollen config local-objective": "tests/test_readme_examples.py::test_the_readmes_listing_commands_print",
    ".venv/bin/pollen compare configs/grids/first-comparison.toml --out results/first-comparison":
        "tests/test_tutorials.py::test_the_first_comparison_from_the_command_line_runs_as_the_page_shows",
    ".venv/bin/pollen report results/first-comparison":
        "tests/test_tutorials.py::test_the_first_comparison_from_the_command_line_runs_as_the_page_shows",
}  # fmt: skip


def words(args: str) -> tuple[str, ...]:
    """A command's arguments as the shell splits them."""
    return tuple(shlex.split(args))


def readme_examples() -> list[tuple[str, ...]]:
    """The arguments of every `.venv/bin/pollen run .` line in the README."""
    text = (PROJECT / "README.md").read_text()
    return [words(m["args"]) for m in COMMAND.finditer(text)]


def readme_commands() -> list[str]:
    """Every command line of the README's shell blocks, without its comment."""
    text = (PROJECT / "README.md").read_text()
    lines = [line.split("  #")[0].strip() for block in fenced_blocks(text, "bash")
             for line in block.splitlines()]  # fmt: skip
    return [line for line in lines if line]


def test_every_readme_command_is_run_by_a_test() -> None:
    runs = [c for c in readme_commands() if COMMAND.match(c)]
    others = [c for c in readme_commands() if not COMMAND.match(c)]
    assert len(runs) == len(readme_examples())
    unchecked = [c for c in others if c not in OTHER_COMMANDS]
    assert not unchecked, f"README commands no test runs: {unchecked}"
    assert set(OTHER_COMMANDS) <= set(others), "OTHER_COMMANDS rows not in the README"
    for test in set(OTHER_COMMANDS.values()) - {".ci/run"}:
        path, _, name = test.partition("::")
        assert f"def {name}(" in (PROJECT / path).read_text(), test


def test_the_readmes_listing_commands_print(capsys: pytest.CaptureFixture[str]) -> None:
    from pollen import cli

    for command in OTHER_COMMANDS:
        if command.startswith((".venv/bin/pollen list", ".venv/bin/pollen config")):
            assert cli.main(shlex.split(command)[1:]) == 0, command
            assert capsys.readouterr().out.strip(), command


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

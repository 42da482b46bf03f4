"""The tutorials run from top to bottom, as a reader runs them.

Each `docs/tutorials/*.py` (a jupytext percent file: a notebook whose diffs
read as code) is executed in a real Jupyter kernel by nbclient, in a
folder of the test's own, and must finish without an error and show what
its text promises: the comparison's table with every strategy, and the
figures as pictures. The command-line tutorial's commands run as written
(their `results/` in the test's folder), and what the page shows of their
output is what they give.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import PROJECT, fenced_blocks

pytestmark = pytest.mark.integration
TUTORIALS = sorted((PROJECT / "docs" / "tutorials").glob("*.py"))
FIRST_COMPARISON = PROJECT / "docs" / "tutorials" / "first-comparison-cli.md"
BIN = Path(sys.executable).parent
CELL_SECONDS = 600  # one cell's limit; the whole notebook takes about 70 s


def outputs(cell: dict, mime: str) -> list[str]:
    """What a cell showed of type `mime` (`text/plain`, `image/png`, ...),
    streams counted as `text/plain`."""
    shown = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream" and mime == "text/plain":
            shown.append(output["text"])
        elif mime in output.get("data", {}):
            shown.append(output["data"][mime])
    return shown


def execute(path: Path, folder: Path) -> tuple[dict, float]:
    """The notebook in `path` executed in `folder`, and its seconds."""
    import jupytext
    from nbclient import NotebookClient

    notebook = jupytext.read(path)
    started = time.monotonic()
    NotebookClient(
        notebook, timeout=CELL_SECONDS, kernel_name="python3",
        resources={"metadata": {"path": str(folder)}},
    ).execute()  # fmt: skip
    return notebook, time.monotonic() - started


def test_there_is_a_tutorial() -> None:
    assert [p.name for p in TUTORIALS] == ["first-comparison.py"]
    assert FIRST_COMPARISON.is_file()


def test_the_first_comparison_runs_and_shows_its_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernel's temporary folder, where the notebook writes, removed after;
    # beside this one's (not in tmp_path: Ray's socket paths must stay short)
    scratch = Path(tempfile.mkdtemp(prefix="pollen-tutorial-test-"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    try:
        notebook, seconds = execute(
            PROJECT / "docs/tutorials/first-comparison.py", tmp_path
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    shown = {
        mime: "\n".join(text for cell in code for text in outputs(cell, mime))
        for mime in ("text/plain", "text/markdown")
    }
    for strategy in ("fedavg", "fedprox", "scaffold"):
        assert f"| {strategy} |" in shown["text/markdown"], shown["text/markdown"]
    pictures = sum(len(outputs(cell, "image/png")) for cell in code)
    assert pictures == 2  # the comparison's figure and the own model's
    assert "my_nets:wide_mlp" in shown["text/plain"]
    assert "pollen: round 8/8" in shown["text/plain"]  # the status, in place
    print(f"the tutorial ran in {seconds:.0f} s")


def test_the_first_comparison_from_the_command_line_runs_as_the_page_shows(
    tmp_path: Path,
) -> None:
    """Every command of the page, run as written from the checkout, with
    `results/` in the test's folder: the grid is the one it shows, every
    run completes, and the report's accuracies are the page's (the same
    seed trains to the same model; a point of slack for another CPU)."""
    page = FIRST_COMPARISON.read_text()
    (grid,) = fenced_blocks(page, "toml")
    commands = [
        line for block in fenced_blocks(page, "bash") for line in block.splitlines()
    ]
    assert commands[0] == "cat configs/grids/first-comparison.toml"
    assert tomllib.loads(grid) == tomllib.loads(
        (PROJECT / "configs/grids/first-comparison.toml").read_text()
    )
    started = time.monotonic()
    for command in commands[1:]:
        argv = [a.replace("results/", f"{tmp_path}/") for a in shlex.split(command)]
        assert argv[0] == ".venv/bin/pollen", command
        done = subprocess.run([str(BIN / "pollen"), *argv[1:]], cwd=PROJECT,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, command + done.stdout[-2000:] + done.stderr[-3000:]
    print(f"the tutorial's commands ran in {time.monotonic() - started:.0f} s")
    shown = {row[1]: float(row[3]) for row in _table(page)}
    report = {row[1]: float(row[3]) for row in _table(
        (tmp_path / "first-comparison" / "comparison.md").read_text())}  # fmt: skip
    assert report.keys() == shown.keys() == {"fedavg", "fedprox", "scaffold"}
    for strategy, accuracy in shown.items():
        assert abs(report[strategy] - accuracy) <= 1.0, (strategy, report, shown)


def _table(text: str) -> list[list[str]]:
    """The rows of the first Markdown table in `text`, below its rule."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]

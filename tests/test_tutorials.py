"""The tutorial notebooks run from top to bottom, as a reader runs them.

Each `docs/tutorials/*.py` (a jupytext percent file: a notebook whose diffs
read as code) is executed in a real Jupyter kernel by nbclient, in a
folder of the test's own, and must finish without an error and show what
its text promises: the comparison's table with every strategy, and the
figures as pictures.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import PROJECT

pytestmark = pytest.mark.integration
TUTORIALS = sorted((PROJECT / "docs" / "tutorials").glob("*.py"))
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

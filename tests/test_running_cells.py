"""`pollen compare --jobs N` on a terminal: one line per running cell, read
from the end of its log, redrawn under the lines said as cells start and end."""

from __future__ import annotations

import io
from pathlib import Path

from pollen.experiments import running_cells
from pollen.experiments.running_cells import RunningLines, cell_status

ROUNDS = """pollen: 10 clients on 10 nodes
=== Evaluate global model 3 Round ===
[03] acc=95.83%, loss=0.200993
     round 3/10: 0.10 s, up 0.35 MB, down 0.35 MB, lr 0.05, clients 5, ~8 s left
=== Evaluate global model 4 Round ===
[04] acc=95.00%, loss=0.154406
     round 4/10: 0.12 s, up 0.35 MB, down 0.35 MB, lr 0.05, clients 5, ~5 s left
=== Evaluate global model 5 Round ===
[05] acc=96.94%, loss=0.116168
"""


def test_a_cell_s_status_is_the_last_round_its_log_finished(tmp_path: Path) -> None:
    log = tmp_path / "cell.log"
    assert cell_status(log) == "starting"  # no log yet
    log.write_text("pollen: results go to x\n")
    assert cell_status(log) == "starting"
    log.write_text(ROUNDS)  # round 5 evaluated, its line not yet written
    assert cell_status(log) == "round 4/10, 95.00 %, ~5 s left"
    with log.open("a") as f:
        f.write("     round 5/10: 0.08 s, up 0.35 MB, clients 5, ~4 s left\n")
    assert cell_status(log) == "round 5/10, 96.94 %, ~4 s left"
    # resumed: the log goes on after what its earlier run wrote
    assert cell_status(log, offset=log.stat().st_size) == "starting"


def test_lines_said_go_above_the_running_cells_which_are_redrawn(
    tmp_path: Path, monkeypatch
) -> None:
    terminal = io.StringIO()
    lines = RunningLines(lambda line: terminal.write(line + "\n"), terminal)
    (tmp_path / "a.log").write_text(ROUNDS)
    cells = {"a": (tmp_path / "a.log", 0), "b": (tmp_path / "b.log", 0)}
    monkeypatch.setattr(running_cells, "REDRAW_SECONDS", 3600.0)
    lines.redraw(cells)  # the first: drawn
    lines.redraw(cells)  # too soon: left as drawn
    lines.say("[3/3] c: running")
    erase = running_cells.UP_AND_ERASE.format(2)
    block = "  a: round 4/10, 95.00 %, ~5 s left\n  b: starting\n"
    assert terminal.getvalue() == f"{block}{erase}[3/3] c: running\n"
    lines.redraw(cells)  # after a line said: drawn again under it
    assert terminal.getvalue().endswith(f"running\n{block}")
    lines.redraw({}, force=True)  # the last cell ended: the block goes
    assert terminal.getvalue().endswith(f"{block}{erase}")


def test_without_a_terminal_only_the_lines_said_are_written(tmp_path: Path) -> None:
    said: list[str] = []
    lines = RunningLines(said.append, None)
    lines.redraw({"a": (tmp_path / "a.log", 0)}, force=True)
    lines.say("[1/2] a: running")
    assert said == ["[1/2] a: running"]

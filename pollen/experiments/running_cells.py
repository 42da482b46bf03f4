"""The lines `pollen compare --jobs N` keeps under its progress on a terminal:
one per running cell, with the round, accuracy and time left its log said
last, redrawn about once a second (`RunningLines`). In a file, a pipe or a
notebook only the lines said when a cell starts and ends are written."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from ..deployment.console import REDRAW_SECONDS
from ..runs.results import ACCURACY_LINE, ROUND_LINE

TAIL_BYTES = 16_384  # a round's lines of a cell's log fit well within it
# ANSI: to the start of the line n lines up, then erase to the screen's end
UP_AND_ERASE = "\x1b[{}F\x1b[J"


def cell_status(log: Path, offset: int = 0) -> str:
    """A running cell's progress as the end of its `pollen run` log says it
    after `offset` (the log's size when this run of the cell began; a resumed
    cell's log holds its earlier run's): "round 4/10, 95.00 %, ~5 s left",
    or "starting" before its first round."""
    try:
        with log.open("rb") as f:
            f.seek(max(offset, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "starting"
    ends = (ROUND_LINE.match(line) for line in reversed(lines))
    progress = next((match for match in ends if match), None)
    if progress is None:
        return "starting"
    status = f"round {progress['round']}/{progress['rounds']}"
    for line in reversed(lines):  # that round's accuracy, where the log has it
        accuracy = ACCURACY_LINE.match(line)
        if accuracy and int(accuracy["round"]) == int(progress["round"]):
            status += f", {accuracy['accuracy']} %"
            break
    return f"{status}, ~{progress['left']} s left"


class RunningLines:
    """`say` (through `echo`) a line above a block of one line per running
    cell, which `redraw` renews, on the terminal `stream` that `echo` writes
    to; without one (None), `say` alone."""

    def __init__(self, echo: Callable[[str], None], stream: TextIO | None) -> None:
        self.echo = echo
        self.stream = stream
        self.shown = 0
        self.drawn_at = 0.0

    def say(self, line: str) -> None:
        """`line` where the block was; the next `redraw` draws the block."""
        self._erase()
        self.echo(line)
        self.drawn_at = 0.0

    def redraw(
        self, cells: Mapping[str, tuple[Path, int]], force: bool = False
    ) -> None:
        """Show `cells` (running cell -> its log and `cell_status`'s offset),
        each cut to the terminal's width, at most once a
        `REDRAW_SECONDS` (or since a line was said) unless `force`d."""
        if self.stream is None or (
            not force and time.monotonic() - self.drawn_at < REDRAW_SECONDS
        ):
            return
        self._erase()
        width = shutil.get_terminal_size().columns - 1  # a row each: no wrapping
        for name, (log, offset) in cells.items():
            self.stream.write(f"  {name}: {cell_status(log, offset)}"[:width] + "\n")
        self.stream.flush()
        self.shown, self.drawn_at = len(cells), time.monotonic()

    def _erase(self) -> None:
        if self.stream is not None and self.shown:
            self.stream.write(UP_AND_ERASE.format(self.shown))
            self.stream.flush()
            self.shown = 0

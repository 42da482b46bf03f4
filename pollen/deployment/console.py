"""What `pollen run` shows of a run's stream, and where the rest goes.

`flwr run --stream` interleaves the ServerApp's own lines with Flower's log
(every round's `INFO`, start-up notices, warnings that do not apply to a
pollen run) and Python warnings from Ray. Every line goes to the run's
`flower.log`; the console gets pollen's lines only: its `pollen: ...`
messages (also those it logs through Flower's logger, shown without the
level prefix), the per-round block in the seeds' format
(`results.round_lines`, unchanged) and the label table on stdout, and every
error in full on stderr (Flower's `ERROR` lines and any traceback), but
for the block Flower's simulation logs of a ClientApp that raised: its
first line only (the ServerApp names the client's exception in a line of
its own). `--verbose` shows the rest of the stream too, on stdout.

On a terminal a status line under the output says the round, accuracy,
loss, time since the command started and the time left, redrawn every
second; in a Jupyter kernel (`pollen.run` in a notebook) the same status is
one output above the lines, updated in place; elsewhere (a file, a pipe, a
comparison's cell log) there is no status line and no control character
(Flower's colours are dropped), only the lines.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from ..runs.results import (
    ACCURACY_LINE,
    ROUND_LINE,
    RoundRecord,
    round_lines,
    seconds_left,
)

# A line of Flower's logger: colour, level, colour reset, colon, padding
FLOWER_LOG = re.compile(
    r"^(?:\x1b\[\d+m)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*(?:\x1b\[0m)?:\s+(.*)$"
)
# What a resumed run's ServerApp says first (`runs.progress`)
RESUMING_LINE = re.compile(r"^pollen: resuming after round (?P<round>\d+)$")
ERROR_LEVELS = ("ERROR", "CRITICAL")
# the first line of a round's block (`results.round_lines`) and the lines after
# it that belong to the block (its accuracy line, its indented lines)
BLOCK_START = re.compile(r"^=== Evaluate global model (?P<round>\d+) Round ===$")
BLOCK_LINE = re.compile(r"^(?:\[\d{2,}\] acc=| {5}\S)")
# What the ServerApp prints itself: pollen's messages, the round block
# (`results.round_lines`: its header, the accuracy line, indented details)
# and `print-labels`' table (`partition.format_label_counts`)
POLLEN_LINE = re.compile(
    r"^(?:pollen: |=== Evaluate global model |\[\d{2,}\] acc=| {5}\S"
    r"|client  total |\s*\d+ +\d+(?: +\d+)+$)"
)
COLOUR = re.compile(r"\x1b\[\d+(?:;\d+)*m")
TRACEBACK_START = "Traceback (most recent call last):"
# what a chained traceback says between its parts
CHAIN_LINK = re.compile(
    r"The above exception was the direct cause of the following exception:"
    r"|During handling of the above exception, another exception occurred:"
)
# after an error, unprefixed lines may be a traceback's FRAMES, the rest of a
# MESSAGE that ended with a colon, or the blank and LINK lines between the
# parts of a chained traceback
FRAMES, MESSAGE, LINK = "frames", "message", "link"


def _continued(text: str) -> str | None:
    """MESSAGE when an error's text goes on in the lines after it (it is
    empty or ends with a colon), else None."""
    return MESSAGE if not text or text.endswith(":") else None


# What Flower's simulation logs first of a ClientApp that raised
# (flwr/server/superlink/fleet/vce/vce_api.py), before the exception and its
# traceback as two more ERROR records
CLIENT_FAILURE = "An exception was raised when processing a message by"

# `flwr` (the CLI) reports a refused command in a box: "╭─ Error ─...╮", its
# text in "│ ... │" lines, "╰─...─╯"
ERROR_BOX_START, ERROR_BOX_END = "╭─ Error ", "╰"
REDRAW_SECONDS = 1.0


class Console:
    """Routes a run's stream: everything to the log, pollen's lines to `out`."""

    def __init__(
        self,
        log: TextIO,
        out: TextIO | None = None,
        err: TextIO | None = None,
        verbose: bool = False,
    ) -> None:
        self.log = log
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.verbose = verbose
        self.live = self.out.isatty()
        # in a Jupyter kernel: the status as an output updated in place
        self._show = None if self.live else notebook_status()
        self.started = time.monotonic()
        self._error_tail: str | None = None  # what unprefixed lines continue
        self._client_failure = False  # inside Flower's block of a client's failure
        # the stream's last error: a traceback's exception line, or the text
        # of Flower's last ERROR line (`pollen run` names it if the run fails)
        self.last_error: str | None = None
        # the exception line of the stream's last traceback (Flower's last
        # ERROR line often only says how the process ended: "Exit Code: 700")
        self.exception: str | None = None
        self._box: list[str] | None = None  # the text of a `flwr` error box
        self._status = ""
        self._progress: dict[str, float] = {}
        # the last round whose block the stream showed whole (or that a resume
        # continues after), and the lines it showed of the next one's block:
        # the stream can stop inside a block
        self._shown_through = 0
        self._block_shown: list[str] = []
        # after `catch_up` the screen shows what the history holds: a line the
        # stream still delivers (its reader outlived the stop on a loaded
        # machine) goes to the log only
        self._caught_up = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        if self.live or self._show is not None:
            threading.Thread(target=self._redraw_every_second, daemon=True).start()

    def line(self, raw: str) -> None:
        """One line of the stream (without its newline)."""
        self.log.write(raw + "\n")
        self.log.flush()
        if self._caught_up or (not self.verbose and self._in_client_failure(raw)):
            return
        error = self._is_error(raw)
        shown = raw if error or self.verbose else self._pollen_text(raw)
        self._note_progress(raw)
        if shown is None:
            return
        self._note_block(shown)
        stream = self.err if error else self.out
        if not stream.isatty():  # a file or pipe gets plain text
            shown = COLOUR.sub("", shown)
        with self._lock:
            self._clear_status()
            stream.write(shown + "\n")
            stream.flush()
            self._draw_status()
            self.out.flush()

    def catch_up(
        self, history: Sequence[RoundRecord], total_rounds: int, after: int = 0
    ) -> None:
        """Show the round blocks of `history` after round `after` that the
        stream did not, once an interrupted run has stopped: Flower's log
        stream ends when the run is finished, and the ServerApp's last lines
        can still be on their way to the SuperLink (its uploader sends every
        0.2 s; on a loaded machine several rounds were lost, and a stream
        stopped inside a block, after its accuracy line). What the console
        shows last is then what the history holds, and the status says that
        round. Not written to Flower's log: they are not its lines."""
        with self._lock:
            self._caught_up = True
            self._clear_status()
            for count, record in enumerate(history, 1):
                if record.round <= max(after, self._shown_through):
                    continue
                left = seconds_left(history[:count], total_rounds)
                lines = round_lines(record, total_rounds, left).splitlines()
                if record.round == self._shown_through + 1:  # the rest of its block
                    lines = [text for text in lines if text not in self._block_shown]
                for text in lines:
                    self.out.write(text + "\n")
                    self._note_progress(text)
                    self._note_block(text)
            self.out.flush()

    def close(self) -> None:
        """Stop the status line and leave the terminal as it was (a
        notebook's status says where the run ended)."""
        self._stopped.set()
        with self._lock:
            self._clear_status()
            if self._show is not None:
                self._show(self.status())
            self.out.flush()
        self.log.flush()

    def _pollen_text(self, raw: str) -> str | None:
        """`raw` if it is one of pollen's lines (without Flower's level prefix
        where pollen logged it through Flower's logger), else None."""
        logged = FLOWER_LOG.match(raw)
        if logged:
            message = logged.group(2)
            return message if message.startswith("pollen: ") else None
        return raw if POLLEN_LINE.match(raw) else None

    def _in_client_failure(self, raw: str) -> bool:
        """Whether `raw` is the rest of the block Flower's simulation logs for
        a ClientApp that raised (`CLIENT_FAILURE`, then the exception and
        its traceback twice over: about 160 lines a client, every round).
        The block's first line is shown; the rest stays in the log, and the
        ServerApp names the client's exception in one line of its own
        ("pollen: error reply: node N: ValueError: ..."). Anything else
        ends the block: a pollen line, another record, another error."""
        logged = FLOWER_LOG.match(raw)
        text = COLOUR.sub("", logged.group(2) if logged else raw).strip()
        if logged and text.startswith(CLIENT_FAILURE):
            self._client_failure = True
            return False  # shown, as the error it is
        if not self._client_failure:
            return False
        if logged is None and not POLLEN_LINE.match(raw):
            return True
        if (
            logged
            and logged.group(1) in ERROR_LEVELS
            and text.startswith(("ray::", TRACEBACK_START))
        ):
            return True
        self._client_failure = False
        return False

    def _is_error(self, raw: str) -> bool:
        """Whether `raw` reports an error: Flower's ERROR lines, and every line
        of a traceback (its indented frames and the exception's line)."""
        if raw.startswith(ERROR_BOX_START):  # `flwr` refusing a command
            self._box = []
            return True
        if self._box is not None:
            if raw.startswith(ERROR_BOX_END):
                self.last_error = " ".join(self._box)
                self._box = None
            else:
                self._box.append(raw.strip("│ "))
            return True
        logged = FLOWER_LOG.match(raw)
        text = COLOUR.sub("", logged.group(2) if logged else raw).strip()
        if text.startswith(TRACEBACK_START):  # alone, or an ERROR record's message
            self._error_tail = FRAMES
            return True
        if logged is None and self._error_tail and self._error_continues(raw, text):
            return True
        self._error_tail = None
        if logged and logged.group(1) in ERROR_LEVELS:
            self.last_error = text
            self._error_tail = _continued(text)
            return True
        if self._pollen_text(raw) is not None:  # the run went on: it survived
            self.exception = None  # the traceback (one client's failure, say)
        return False

    def _error_continues(self, raw: str, text: str) -> bool:
        """Whether an unprefixed line after an error is still that error: a
        traceback's frame or its exception's line; the further lines of a
        message that ended with a colon (or was empty: it starts on the next
        line, as Flower's ClientAppException does); the blank and linking
        lines of a chained traceback. Anything else (a Ray warning, pollen's
        lines) is not."""
        if self._error_tail == FRAMES:
            if raw[:1].isspace() or not raw:
                return True
            self.last_error, self._error_tail = text, _continued(text) or LINK
            self.exception = text
            return True
        if self._error_tail == MESSAGE and text and not POLLEN_LINE.match(raw):
            if self.exception is not None and self.exception == self.last_error:
                self.exception = f"{self.exception} {text}".strip()
            self.last_error = f"{self.last_error} {text}".strip()
            return True
        if not text or CHAIN_LINK.fullmatch(text):
            self._error_tail = LINK
            return True
        return False

    def failure(self) -> str | None:
        """Why the run failed, as the stream says it: its last error line and,
        where another came before it, the last traceback's exception."""
        if self.exception and self.last_error and self.exception != self.last_error:
            return f"{self.exception} (then {self.last_error})"
        return self.last_error or self.exception

    def _note_block(self, shown: str) -> None:
        """Keep `shown` if it starts or continues a round's block (by its
        text: another line between a block's lines is not one of them)."""
        if match := RESUMING_LINE.match(shown):
            self._shown_through, self._block_shown = int(match["round"]), []
        elif match := BLOCK_START.match(shown):
            self._shown_through, self._block_shown = int(match["round"]) - 1, [shown]
        elif self._block_shown and BLOCK_LINE.match(shown):
            self._block_shown.append(shown)

    def _note_progress(self, raw: str) -> None:
        if match := RESUMING_LINE.match(raw):  # the rounds before are not this run's
            self._progress["round"] = int(match["round"])
        elif match := ACCURACY_LINE.match(raw):
            self._progress["round"] = int(match["round"])
            self._progress["accuracy"] = float(match["accuracy"])
            self._progress["loss"] = float(match["loss"])
        elif match := ROUND_LINE.match(raw):
            self._progress["round"] = int(match["round"])
            self._progress["rounds"] = int(match["rounds"])
            self._progress["left"] = float(match["left"])
            self._progress["at"] = time.monotonic()

    def status(self) -> str:
        """The status line: round, accuracy, loss, elapsed, time left."""
        elapsed = time.monotonic() - self.started
        progress = self._progress
        if "rounds" not in progress:
            return f"pollen: starting up ... {_clock(elapsed)}"
        left = max(0.0, progress["left"] - (time.monotonic() - progress["at"]))
        return (
            f"pollen: round {progress['round']:.0f}/{progress['rounds']:.0f}"
            f" | acc {progress.get('accuracy', float('nan')):.2f}%"
            f" | loss {progress.get('loss', float('nan')):.4f}"
            f" | {_clock(elapsed)} elapsed | ~{_clock(left)} left"
        )

    def _draw_status(self) -> None:
        if self._show is not None:
            self._show(self.status())
        elif self.live and not self._stopped.is_set():
            self._status = self.status()
            self.out.write(self._status)

    def _clear_status(self) -> None:
        if self.live and self._status:
            self.out.write("\r\x1b[K")
            self._status = ""

    def _redraw_every_second(self) -> None:
        while not self._stopped.wait(REDRAW_SECONDS):
            with self._lock:
                self._clear_status()
                self._draw_status()
                self.out.flush()


def notebook_status() -> Callable[[str], None] | None:
    """In a Jupyter kernel, a function that shows a line of text as one
    output of the running cell, replaced at each call (IPython's display
    handles: no widget library needed, and a notebook run by nbclient keeps
    the last one); None anywhere else. IPython is imported only where a
    kernel already did."""
    if "ipykernel" not in sys.modules:
        return None
    from IPython import get_ipython
    from IPython.display import display

    if getattr(get_ipython(), "kernel", None) is None:
        return None
    handle = display({"text/plain": "pollen: starting up ..."}, raw=True,
                     display_id=True)  # fmt: skip

    def show(text: str) -> None:
        handle.update({"text/plain": text}, raw=True)

    return show


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

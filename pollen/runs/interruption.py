"""Ctrl-C, SIGTERM and SIGHUP: a stopped run ends `interrupted`, and can be
resumed.

`pollen run` answers Ctrl-C, SIGTERM or SIGHUP by sending SIGINT to the process
that runs the ServerApp (`flwr-simulation`; `deployment.launch`: Ray's
driver there answers SIGTERM by exiting at once). Flower's SIGINT handler
runs its exit handlers before the process exits;
pollen's (`StopSignal.install`) asks the server loop to stop and waits until
the run has recorded how it ended. The loop stops at its next exchange with
the clients (`InterruptibleGrid`); the last completed round is checkpointed
(unless a checkpoint of it exists) from a copy of the server's state taken
when that round ended (the interrupted round may have changed it already:
FedOpt's moments before its personal evaluation, say), `summary.json` says
`interrupted`, and `resume=<run dir>` continues the run. The ServerApp gets
SIGINT whatever stopped the command, so the command, once the ServerApp has
ended, names the signal in the summary's reason (`record_stop_cause`).

Where the ServerApp runs in the process's main thread (a deployment's
`flwr-serverapp`), the signal arrives inside the server loop itself: the
run is still recorded as interrupted, but without a checkpoint of a state
that may be half-updated.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..files import write_json

# How long Flower's exit waits for the ServerApp to record the interruption
SETTLE_SECONDS = 60.0


class RunInterrupted(Exception):
    """The run was asked to stop: its command got Ctrl-C, SIGTERM or SIGHUP,
    or was killed (its watchdog then stops the run). `pollen run` passes
    each on as SIGINT, so the ServerApp cannot tell which; the command
    that knows gives it as `cause` (`record_stop_cause`)."""

    def __init__(self, cause: str | None = None) -> None:
        super().__init__(
            f"interrupted: its command got {cause}"
            if cause
            else "interrupted: its command was stopped (Ctrl-C, SIGTERM or "
            "SIGHUP) or killed"
        )


def record_stop_cause(run_dir: Path, token: str, cause: str) -> None:
    """Name `cause`, what stopped the command, in the reason of the summary
    its ServerApp wrote on ending `interrupted` (it said only that one of
    Ctrl-C, SIGTERM or SIGHUP did). Only the summary of the run `token`
    claims, once that run has ended; any other summary is left as it is."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or summary.get("run-token") != token:
        return
    if summary.get("status") != "interrupted":
        return
    summary["error"] = f"{RunInterrupted.__name__}: {RunInterrupted(cause)}"
    write_json(path, summary)


class StopSignal:
    """A request to stop the server loop, and the loop's word that the run's
    files say so."""

    def __init__(self) -> None:
        self._asked = threading.Event()
        self._settled = threading.Event()
        self._loop_thread = threading.get_ident()

    def install(self) -> None:
        """Be asked to stop when Flower's process exits on a signal (its exit
        handlers also run at a normal exit: by then the run has settled)."""
        from flwr.supercore.exit import add_exit_handler

        add_exit_handler(self.ask, run_before_force_exit=True)

    def ask(self) -> None:
        """Ask the loop to stop; from another thread, wait until it has."""
        self._asked.set()
        if threading.get_ident() != self._loop_thread:
            self._settled.wait(SETTLE_SECONDS)

    @property
    def asked(self) -> bool:
        return self._asked.is_set()

    def check(self) -> None:
        """Raise `RunInterrupted` if the loop was asked to stop."""
        if self._asked.is_set():
            raise RunInterrupted

    def settle(self) -> None:
        """The run's files are final: let the process exit."""
        self._settled.set()


class InterruptibleGrid:
    """A Grid whose every exchange with the clients first checks `stop`."""

    def __init__(self, grid: Any, stop: StopSignal) -> None:
        self._grid = grid
        self._stop = stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        self._stop.check()
        return self._grid.push_messages(messages)

    def pull_messages(self, *args: Any, **kwargs: Any) -> Iterable[Any]:
        """Flower's `pull_messages` in either release's form: 1.42's
        `(message_ids)`, 1.43's `(reply_to_message_ids=None, *,
        message_ids=None)` (its `message_ids` keyword deprecated, and its own
        code calling it with no argument), passed on as given."""
        self._stop.check()
        return self._grid.pull_messages(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        self._stop.check()
        return self._grid.get_node_ids()

    def send_and_receive(self, messages: Iterable[Any], **kwargs: Any) -> Any:
        self._stop.check()
        return self._grid.send_and_receive(messages, **kwargs)

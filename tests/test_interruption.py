"""`InterruptibleGrid`: every exchange with the clients checks the stop
signal first, and Flower's Grid methods keep their signatures through it
(1.42's `pull_messages(message_ids)` and 1.43's `pull_messages(
reply_to_message_ids=None, *, message_ids=None)` alike)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flwr.server import Grid

from pollen.deployment import launch
from pollen.deployment.launch import report_interrupted
from pollen.deployment.processes import (
    StopSignalInterrupt,
    stop_cause,
    stop_signals_interrupt,
)
from pollen.files import write_json
from pollen.runs.claim import claimed_token
from pollen.runs.interruption import (
    InterruptibleGrid,
    RunInterrupted,
    StopSignal,
    record_stop_cause,
)
from pollen.runs.results import RoundRecord, write_history
from pollen.settings import Settings
from pollen.strategies.cohort_grid import CohortGrid
from pollen.strategies.sampling import OneMessagePerNode

# pull_messages as each Flower release calls it: by position, by either
# keyword, and (1.43's own code) with no argument
CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((["m1", "m2"],), {}),
    ((), {"message_ids": ["m1"]}),
    ((), {"reply_to_message_ids": ["m1"]}),
    ((), {}),
]


class RecordingGrid:
    """Stands in for Flower's grid: records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def pull_messages(self, *args: Any, **kwargs: Any) -> list[str]:
        self.calls.append((args, kwargs))
        return ["reply"]


def accepted_by_installed_flower(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(Grid.pull_messages).bind(None, *args, **kwargs)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_pull_messages_passes_on_either_releases_form_as_given(args, kwargs):
    inner = RecordingGrid()
    grid = InterruptibleGrid(inner, StopSignal())
    assert grid.pull_messages(*args, **kwargs) == ["reply"]
    assert inner.calls == [(args, kwargs)]


def test_the_installed_flower_takes_the_positional_form_pollen_uses():
    """pollen's own calls (sampling, the asynchronous loop) pass the IDs by
    position: the form both releases take."""
    assert accepted_by_installed_flower(*CALLS[0])


def test_a_stopped_run_exchanges_nothing_more():
    inner, stop = RecordingGrid(), StopSignal()
    grid = InterruptibleGrid(inner, stop)
    stop.ask()  # from the loop's own thread: no wait
    with pytest.raises(RunInterrupted):
        grid.pull_messages()
    assert inner.calls == []


def takes_every_call_of(wrapper: Any, flowers: Any) -> bool:
    """Whether `wrapper` takes every call `flowers` takes: each of Flower's
    parameters under its own name (a kind at least as open, a default
    where Flower has one), or through *args where it may come by position
    and **kwargs where by keyword; and no parameter of its own that a call
    of Flower's would leave without a value."""
    ours = inspect.signature(wrapper).parameters
    theirs = inspect.signature(flowers).parameters
    kinds = {p.kind for p in ours.values()}
    for p in theirs.values():
        by_position = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        by_keyword = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            taken = p.kind in kinds
        elif p.name in ours:
            own = ours[p.name]
            taken = own.kind in (p.kind, p.POSITIONAL_OR_KEYWORD) and (
                p.default is p.empty or own.default is not p.empty
            )
        else:
            taken = (not by_position or p.VAR_POSITIONAL in kinds) and (
                not by_keyword or p.VAR_KEYWORD in kinds
            )
        if not taken:
            return False
    return all(
        p.name in theirs
        or p.default is not p.empty
        or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in ours.values()
    )


@pytest.mark.parametrize(
    "wrapper",
    [InterruptibleGrid, OneMessagePerNode, CohortGrid],
    ids=lambda w: w.__name__,
)
def test_every_grid_wrapper_takes_the_installed_flowers_signatures(wrapper):
    """A method a wrapper defines over Flower's Grid takes every call the
    installed Flower's takes (the suite runs on both releases); the rest
    pass through `__getattr__` untouched."""
    overridden = [
        n for n in vars(wrapper) if not n.startswith("_") and hasattr(Grid, n)
    ]
    assert overridden
    for name in overridden:
        assert takes_every_call_of(getattr(wrapper, name), getattr(Grid, name)), name


def test_an_interrupted_run_names_every_signal_that_stops_it():
    """The ServerApp's own reason (the ServerApp gets SIGINT for each, and
    the watchdog of a killed command sends it too) names every way."""
    reason = str(RunInterrupted())
    assert all(name in reason for name in ("Ctrl-C", "SIGTERM", "SIGHUP", "killed"))


@pytest.mark.parametrize(
    ("stop", "said"),
    [
        (KeyboardInterrupt(), "Ctrl-C (SIGINT)"),
        (StopSignalInterrupt(signal.SIGTERM), "SIGTERM"),
        (StopSignalInterrupt(signal.SIGHUP), "SIGHUP (its terminal or SSH session closed)"),
    ],
    ids=["SIGINT", "SIGTERM", "SIGHUP"],
)  # fmt: skip
def test_the_summary_of_a_stopped_run_names_the_signal_that_stopped_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stop: KeyboardInterrupt,
    said: str,
) -> None:
    """After SIGHUP (the terminal closed) summary.json said "its command was
    stopped (Ctrl-C, SIGTERM or SIGHUP)": `pollen run` knows which, and says
    it once the ServerApp has recorded the interruption (here as it does,
    with the run's token, and the signal raised as its handler raises it)."""
    settings = replace(Settings(), output_dir=str(tmp_path), run_name="stopped")
    monkeypatch.setattr(launch, "prepare_run", lambda app, o: (settings, "", 0))
    monkeypatch.setattr(launch, "find_target", lambda c, d, w: launch.Target())
    monkeypatch.setattr(launch, "checked_federation", lambda s, f, t: [])

    def stopped(app, run_config, run_dir, federation, target, console, watchdog):
        (run_dir / "settings.json").write_text("{}")  # the run started
        write_json(run_dir / "summary.json", {
            "status": "interrupted", "error": f"RunInterrupted: {RunInterrupted()}",
            "run-token": claimed_token(run_dir),
        })  # fmt: skip
        raise stop

    monkeypatch.setattr(launch, "_submit", stopped)
    with pytest.raises(launch.Interrupted):
        launch.run(tmp_path / "app", [])
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["error"] == f"RunInterrupted: interrupted: its command got {said}"


def test_sigterm_and_sighup_are_raised_naming_the_signal() -> None:
    """What `stop_signals_interrupt` raises keeps the signal (SIGTERM here:
    SIGHUP's handler would also silence a terminal on standard output)."""
    with pytest.raises(StopSignalInterrupt) as stopped, stop_signals_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once
    assert stop_cause(stopped.value) == "SIGTERM"


def test_a_summary_another_run_wrote_is_left_as_it_is(tmp_path: Path) -> None:
    """Only the run's own interrupted summary gets the signal's name."""
    theirs = {"status": "interrupted", "error": "x", "run-token": "theirs"}
    write_json(tmp_path / "summary.json", theirs)
    record_stop_cause(tmp_path, "mine", "SIGTERM")
    assert json.loads((tmp_path / "summary.json").read_text()) == theirs


@pytest.mark.parametrize(
    ("done", "said"),
    [
        (3, "pollen: stopped during the wrap-up after the last round (3 of 3): "
            "history.json holds every round; model.pt and curves.png may be missing"),
        (2, "pollen: interrupted after round 2 of 3, with no checkpoint to resume "
            "from"),
        (0, "pollen: interrupted before a round was completed; nothing to resume"),
    ],
)  # fmt: skip
def test_a_stop_without_a_checkpoint_says_how_far_the_run_got(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], done: int, said: str
) -> None:
    """A stop during the wrap-up after the last round (model and curves
    being written, no checkpoint at checkpoint-every=0) was told as one
    "before a round was completed"."""
    write_history(tmp_path, [RoundRecord(n, 0.9, 0.3, 0.05, 1.0, 10, 20)
                             for n in range(1, done + 1)])  # fmt: skip
    settings = Settings.from_run_config({"rounds": 3, "checkpoint-every": 0})
    assert report_interrupted(tmp_path, settings, "pollen run ...") is None
    assert capsys.readouterr().err.startswith(said)

"""What `pollen run` shows of a run's stream (`deployment.console`): pollen's
lines and every error on the console, everything in the log, a status line
on a terminal only."""

from __future__ import annotations

import io
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from pollen.deployment.console import Console
from pollen.runs.results import RoundRecord, round_lines, seconds_left, write_history
from pollen.settings import Settings

STREAM = [
    "Using SuperLink: pollen (127.0.0.1:40771)",
    "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation",
    "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.",
    "/venv/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: ...",
    "  warnings.warn(",
    "pollen: results go to /tmp/r",
    "\x1b[92mINFO \x1b[0m:      pollen: 10 clients on 10 nodes",
    "\x1b[92mINFO \x1b[0m:      [ROUND 1]",
    "client  total    0   1",
    "     0    120   60  60",
    "=== Evaluate global model 1 Round ===",
    "[01] acc=74.72%, loss=1.482462",
    "     round 1/3: 3.21 s, up 0.35 MB, down 0.35 MB, lr 0.05, clients 5, ~7 s left",
    "     1 reply failed or rejected (history.json says why)",
    "\x1b[91mERROR \x1b[0m:     ServerApp raised an exception",
    "Traceback (most recent call last):",
    '  File "/app/pollen/server_app.py", line 90, in main',
    "    _train(grid)",
    "ValueError: the model broke",
    "\x1b[92mINFO \x1b[0m:      Exiting",
]
SHOWN = [
    "pollen: results go to /tmp/r",
    "pollen: 10 clients on 10 nodes",
    *STREAM[8:14],
]
ERRORS = STREAM[14:19]  # Flower's ERROR line and the traceback, on stderr


def uncoloured(line: str) -> str:
    return re.sub(r"\x1b\[\d+m", "", line)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def play(
    out: io.StringIO, err: io.StringIO | None = None, verbose: bool = False
) -> io.StringIO:
    log = io.StringIO()
    console = Console(log, out, err or io.StringIO(), verbose=verbose)
    for line in STREAM:
        console.line(line)
    console.close()
    return log


def test_the_console_shows_pollens_lines_and_errors_the_log_everything() -> None:
    out, err = io.StringIO(), io.StringIO()
    log = play(out, err)
    assert out.getvalue().splitlines() == [uncoloured(line) for line in SHOWN]
    assert err.getvalue().splitlines() == [uncoloured(line) for line in ERRORS]
    assert log.getvalue().splitlines() == STREAM
    assert not re.search(r"[\r\x1b]", out.getvalue())  # no control characters


def test_verbose_shows_the_whole_stream() -> None:
    out, err = io.StringIO(), io.StringIO()
    play(out, err, verbose=True)
    shown = out.getvalue().splitlines() + err.getvalue().splitlines()
    assert sorted(shown) == sorted(uncoloured(line) for line in STREAM)
    assert err.getvalue().splitlines() == [uncoloured(line) for line in ERRORS]


def test_a_terminal_gets_a_status_line_that_leaves_the_lines_as_they_are() -> None:
    out = Terminal()
    play(out, Terminal())
    # every status line is erased before a line is written, and at the end
    plain = re.sub(r"pollen: (starting up|round \d).*?\r\x1b\[K", "", out.getvalue())
    assert plain.splitlines() == SHOWN
    status = re.findall(r"(pollen: round [^\r]*)\r\x1b\[K", out.getvalue())
    assert status[-1].startswith("pollen: round 1/3 | acc 74.72% | loss 1.4825 | ")
    assert status[-1].endswith(" left")
    assert "pollen: starting up ... 0:00" in out.getvalue()


def test_the_last_error_is_the_exception_line_or_flowers_error_box() -> None:
    """What `pollen run` names when a run fails before writing its results."""
    console = Console(io.StringIO(), io.StringIO(), io.StringIO())
    for line in STREAM:
        console.line(line)
    assert console.last_error == "ValueError: the model broke"
    box = [
        "╭─ Error ──────────────────────────────╮",
        "│ The provided configuration string is │",
        "│ in an invalid format.                │",
        "╰──────────────────────────────────────╯",
    ]
    err = io.StringIO()
    console = Console(io.StringIO(), io.StringIO(), err)
    for line in box:
        console.line(line)
    assert console.last_error == (
        "The provided configuration string is in an invalid format."
    )
    assert err.getvalue().splitlines() == box  # shown in full, as errors


# Flower's error reports as its logger writes them: a traceback as an ERROR
# record's message, a chained traceback, an ERROR record starting with a newline
ERROR = "\x1b[91mERROR \x1b[0m:     "
WARNING = "\x1b[93mWARNING \x1b[0m:   "

# What flwr/server/superlink/fleet/vce/vce_api.py:262-264 logs when the
# simulation runtime crashes: `log(ERROR, "An exception occured!! %s", ex)`,
# `log(ERROR, traceback.format_exc())`, `log(WARN, ...)`. The traceback is the
# message of an ERROR record, so its first line carries the ERROR prefix and
# the rest (frames, the exception's line) follow unprefixed.
FORMAT_EXC_STREAM = [
    ERROR + "An exception occured!! the shard is empty",
    ERROR + "Traceback (most recent call last):",
    '  File "/app/pollen/client_app.py", line 9, in train',
    "    f()",
    "ValueError: the shard is empty",
    "",
    WARNING + "Stopping Simulation Runtime.",
]


def feed_lines(lines: list[str]) -> tuple[Console, io.StringIO]:
    err = io.StringIO()
    console = Console(io.StringIO(), io.StringIO(), err)
    for line in lines:
        console.line(line)
    console.close()
    return console, err


def test_a_traceback_logged_as_an_error_message_reaches_stderr_in_full() -> None:
    _, err = feed_lines(FORMAT_EXC_STREAM)
    shown = err.getvalue().splitlines()
    # the frames and the exception's own line are errors too
    assert '  File "/app/pollen/client_app.py", line 9, in train' in shown
    assert "ValueError: the shard is empty" in shown


def test_the_last_error_of_a_logged_traceback_is_its_exception_line() -> None:
    console, _ = feed_lines(FORMAT_EXC_STREAM)
    # what `pollen run` names if the run fails before writing its summary
    assert console.last_error == "ValueError: the shard is empty"


# A ServerApp failure with a cause (`raise ResultsError(...) from err`), as
# Flower logs it: `log(ERROR, "%s raised an exception", ..., exc_info=ex)`.
CHAINED = [
    ERROR + "ServerApp raised an exception",
    "Traceback (most recent call last):",
    '  File "/app/pollen/runs/results.py", line 120, in create_run_dir',
    "    path.mkdir()",
    "PermissionError: [Errno 13] Permission denied: '/results/r'",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/app/pollen/server_app.py", line 90, in main',
    "    _run(grid, context, started, stop)",
    "pollen.runs.results.ResultsError: cannot create run directory /results/r",
]


def test_a_chained_traceback_keeps_the_line_that_links_its_parts() -> None:
    _, err = feed_lines(CHAINED)
    assert (
        "The above exception was the direct cause of the following exception:"
        in err.getvalue().splitlines()
    )


# A ClientApp that raises in a simulation, as flwr/server/superlink/fleet/vce/
# vce_api.py:143-144 logs it (`log(ERROR, ex)`, `log(ERROR, traceback.format_exc())`)
# for ray_actor.py:65's `raise ClientAppException(str(ex)) from ex`;
# ClientAppException's message starts with a newline (client_app.py:89).
# Captured from flwr 1.41's logger.
CLIENT_APP_FAILURE = [
    ERROR,
    "Exception ClientAppException occurred. Message: client broke",
    ERROR + "Traceback (most recent call last):",
    '  File "/app/pollen/client_app.py", line 12, in train',
    "    f()",
    "ValueError: client broke",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/flwr/simulation/ray_transport/ray_actor.py", line 65, in run',
    "    raise ClientAppException(str(ex)) from ex",
    "flwr.clientapp.client_app.ClientAppException: ",
    "Exception ClientAppException occurred. Message: client broke",
]


def test_a_failing_client_apps_message_reaches_stderr() -> None:
    console, err = feed_lines(CLIENT_APP_FAILURE)
    assert "client broke" in err.getvalue()
    assert "client broke" in (console.last_error or "")


# What Flower 1.42's simulation logs of a ClientApp that raised
# (vce_api.py: the first line, `log(ERROR, ex)`, `log(ERROR, format_exc())`),
# frames abridged; about 160 lines a client in a real run, every round
RAY_CLIENT_FAILURE = [
    ERROR + "An exception was raised when processing a message by RayBackend",
    ERROR + "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=7097, ip=192.0.2.2)",
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/flwr/clientapp/client_app.py", line 161, in __call__',
    "    return self._registered_funcs[full_name](message, context)",
    '  File "/torch/optim/optimizer.py", line 400, in __init__',
    '    raise ValueError("optimizer got an empty parameter list")',
    "ValueError: optimizer got an empty parameter list",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=7097, ip=192.0.2.2)",
    "flwr.clientapp.client_app.ClientAppException: ",
    "Exception ClientAppException occurred. Message: optimizer got an empty "
    "parameter list",
    ERROR + "Traceback (most recent call last):",
    '  File "/flwr/server/superlink/fleet/vce/vce_api.py", line 132, in worker',
    "    raise value.as_instanceof_cause()",
    "ray.exceptions.RayTaskError(ClientAppException): ray::ClientAppActor.run()",
    "Exception ClientAppException occurred. Message: optimizer got an empty "
    "parameter list",
]
ERROR_REPLY = (
    WARNING + "pollen: error reply: node 7: ValueError: optimizer got an empty "
    "parameter list"
)


def test_flowers_block_of_a_failed_client_is_one_line_on_the_console() -> None:
    """Two clients raising: one line each on stderr, and pollen's own line
    naming the exception (it was about 160 lines a client, each round);
    every line stays in the log, and an error after the block is shown."""
    log, out, err = io.StringIO(), io.StringIO(), io.StringIO()
    console = Console(log, out, err)
    stream = [*RAY_CLIENT_FAILURE, *RAY_CLIENT_FAILURE, ERROR_REPLY,
              ERROR + "Exit Code: 700"]  # fmt: skip
    for line in stream:
        console.line(line)
    console.close()
    plain = "ERROR :     "  # a file or pipe gets no colours
    assert err.getvalue().splitlines() == [
        plain + "An exception was raised when processing a message by RayBackend",
        plain + "An exception was raised when processing a message by RayBackend",
        plain + "Exit Code: 700",
    ]
    assert out.getvalue().splitlines() == [
        "pollen: error reply: node 7: ValueError: optimizer got an empty parameter list"
    ]
    assert log.getvalue().splitlines() == stream
    assert console.failure() == "Exit Code: 700"
    shown, verbose_err = io.StringIO(), io.StringIO()
    verbose = Console(io.StringIO(), shown, verbose_err, verbose=True)
    for line in RAY_CLIENT_FAILURE:
        verbose.line(line)
    shown_lines = shown.getvalue().splitlines() + verbose_err.getvalue().splitlines()
    assert len(shown_lines) == len(RAY_CLIENT_FAILURE)  # --verbose: every line


def test_a_warning_after_a_one_line_error_is_no_part_of_it() -> None:
    """Ray's and Python's unprefixed warnings stay hidden after an ERROR line
    that says all it has to say, and are not glued onto the error named."""
    console, err = feed_lines([
        ERROR + "ServerApp thread raised an exception: boom",
        "/venv/ray/_private/worker.py:2210: DeprecationWarning: x is deprecated",
        "  warnings.warn(",
    ])  # fmt: skip
    assert console.last_error == "ServerApp thread raised an exception: boom"
    assert "DeprecationWarning" not in err.getvalue()


def test_a_failure_names_the_exception_before_flowers_exit_line() -> None:
    """Flower ends a failed simulation with "Exit Code: 700": the failure
    said is the traceback's exception, then that line."""
    console, _ = feed_lines([
        ERROR + "Simulation raised an exception",
        "Traceback (most recent call last):",
        '  File "/pollen/settings.py", line 9, in check',
        "pollen.keys.SettingsError: model='m:net': cannot import 'm:net'",
        ERROR + "Exit Code: 700",
    ])  # fmt: skip
    assert console.failure() == (
        "pollen.keys.SettingsError: model='m:net': cannot import 'm:net' "
        "(then Exit Code: 700)"
    )
    alone, _ = feed_lines([ERROR + "ServerApp thread raised an exception: boom"])
    assert alone.failure() == "ServerApp thread raised an exception: boom"


def test_a_traceback_the_run_survived_is_not_named_as_its_failure() -> None:
    """One client's traceback, rounds after it, then Flower's exit line: the
    failure is that line, not the old exception."""
    console, _ = feed_lines([
        "Traceback (most recent call last):",
        '  File "/pollen/client_app.py", line 9, in train',
        "ValueError: one client broke",
        "[03] acc=50.00%, loss=1.000000",
        ERROR + "Exit Code: 700",
    ])  # fmt: skip
    assert console.failure() == "Exit Code: 700"


def records(count: int) -> list[RoundRecord]:
    return [RoundRecord(n, 0.5 + n / 100, 1.0, 0.05, 2.0, 1_000, 2_000)
            for n in range(1, count + 1)]  # fmt: skip


def block(round_: int) -> list[str]:
    """Round `round_`'s block as the ServerApp prints it, of 5 rounds."""
    history = records(round_)
    return round_lines(history[-1], 5, seconds_left(history, 5)).splitlines()


@pytest.mark.parametrize(
    ("stream", "shown_after", "round_lines_from"),
    [
        ([], 0, 1),  # the stream lost every round
        (block(2), 2, 2),
        # the stream stopped inside round 3's block: after its accuracy line,
        (block(3)[:2], 3, 3),
        (block(3)[:1], 2, 3),  # after its header,
        ([*block(3)[:1], "     a note"], 2, 3),  # after another indented line
        (["pollen: resuming after round 3"], 3, 4),  # the rounds before: not shown
    ],
)
def test_an_interrupted_run_shows_the_rounds_its_history_holds_and_the_stream_lost(
    stream: list[str], shown_after: int, round_lines_from: int
) -> None:
    """Flower's log stream can end before the ServerApp's last lines reach
    it; the console then shows the rest from the history, each line of a
    round's block once, and not in Flower's log."""
    out, log = io.StringIO(), io.StringIO()
    console = Console(log, out, io.StringIO())
    for line in stream:
        console.line(line)
    console.catch_up(records(5), 5)
    console.catch_up(records(5), 5)
    console.close()
    caught_up = out.getvalue().splitlines()[len(stream) :]
    assert [
        int(m) for m in re.findall(r"^\[(\d+)\]", "\n".join(caught_up), re.M)
    ] == list(range(shown_after + 1, 6))
    assert [
        int(m) for m in re.findall(r"^ {5}round (\d+)/5: ", out.getvalue(), re.M)
    ] == list(range(round_lines_from, 6))
    assert "round 5/5: " in caught_up[-1]
    assert log.getvalue().splitlines() == stream


def test_a_line_the_stream_delivers_after_the_catch_up_goes_to_the_log_only() -> None:
    """A stream reader that outlived the stop (a loaded machine) delivered
    round 2's line after the catch-up had shown round 3: the console's last
    round was no longer the history's."""
    out, log = io.StringIO(), io.StringIO()
    console = Console(log, out, io.StringIO())
    console.line(block(1)[0])
    console.catch_up(records(3), 5)
    late = block(2)[-1]
    console.line(late)
    console.close()
    shown = re.findall(r"^ {5}round (\d+)/5: ", out.getvalue(), re.M)
    assert shown == ["1", "2", "3"]  # not round 2 again after round 3
    assert log.getvalue().splitlines()[-1] == late


def test_the_status_after_a_catch_up_is_the_last_caught_up_round() -> None:
    out = io.StringIO()
    console = Console(io.StringIO(), out, io.StringIO())
    console.catch_up(records(3), 5)
    assert console.status().startswith("pollen: round 3/5 | acc 53.00% | loss 1.0000")
    assert "round 3/5: 2.00 s, " in out.getvalue()
    assert out.getvalue().rstrip().endswith("~4 s left")  # 2 rounds of 2 s to go
    console.close()


@pytest.mark.parametrize(
    ("resume", "history_after", "shown"),
    [
        (False, 3, [1, 2, 3]),  # a new run: every round the stream lost
        (True, 7, [6, 7]),  # a resume after round 5 that ran rounds 6 and 7
        (True, None, []),  # a resume stopped before its first round
    ],
)
def test_an_interrupted_run_catches_up_on_its_own_rounds_only(
    resume: bool,
    history_after: int | None,
    shown: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`launch.run` with Flower's part replaced: the ServerApp (re)writes
    history.json, or does not, and the stream carries none of its lines
    before the interrupt. A resumed run's directory already holds the
    earlier run's rounds 1..7 (checkpoint at round 5): they are not this
    run's, so only what it recorded after round 5 is shown."""
    from pollen.deployment import launch

    run_dir = tmp_path / "run"
    if resume:
        run_dir.mkdir()
        write_history(run_dir, records(7))
    settings = replace(Settings(), rounds=10, output_dir=str(tmp_path), run_name="run",
                       resume=str(run_dir) if resume else "")  # fmt: skip

    def interrupted(app, run_config, run_dir, federation, target, console, watchdog):
        if history_after is not None:  # the ServerApp recorded rounds, then stopped
            (run_dir / "history.json").unlink(missing_ok=True)
            ran = [replace(r, seconds=3.0) if r.round > 5 else r  # this run's own
                   for r in records(history_after)]  # fmt: skip
            write_history(run_dir, ran)
        raise KeyboardInterrupt

    resumed_after = 5 if resume else 0  # the checkpoint's round, as prepare_run says
    monkeypatch.setattr(
        launch, "prepare_run", lambda app, o: (settings, "", resumed_after)
    )
    monkeypatch.setattr(launch, "checked_federation", lambda s, f, t: [])
    monkeypatch.setattr(launch, "_submit", interrupted)
    monkeypatch.setattr(launch, "_report_stopped", lambda *args: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Flower's log, kept here
    with pytest.raises(launch.Interrupted):
        launch.run(tmp_path / "app", [])
    out = capsys.readouterr().out
    assert [int(n) for n in re.findall(r"^\[(\d+)\] acc=", out, re.M)] == shown, out


def test_in_a_notebook_the_status_is_one_output_updated_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a Jupyter kernel the status goes to an IPython display handle (no
    control characters in the output), and closing shows where the run ended."""
    import types

    import IPython
    import IPython.display

    shown: list[str] = []

    class Handle:
        def update(self, data: dict, raw: bool) -> None:
            shown.append(data["text/plain"])

    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=1))
    monkeypatch.setattr(IPython.display, "display",
                        lambda data, raw, display_id: Handle())  # fmt: skip
    out = io.StringIO()
    console = Console(io.StringIO(), out)
    console.line("     round 1/2: 0.50 s, up 0.01 MB, down 0.01 MB, lr 0.05, "
                 "clients 5, ~1 s left")  # fmt: skip
    console.close()
    assert shown[-1].startswith("pollen: round 1/2 | ")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()

"""What a `pollen run` leaves if it is killed outright: nothing.

SIGINT, SIGTERM and SIGHUP reach the command's own handlers, which stop what
it started. SIGKILL (or an out-of-memory kill) does not, and the processes a
run starts live in sessions of their own (the SuperLink, `flwr run`), so
neither a closing terminal nor the kernel would take them along. The
watchdog is a small process the command starts first, in its own session,
reading a pipe from the command: the command tells it, line by line, each
process it started and each temporary path it made, and says `done` when it
has cleaned up itself. If the pipe closes without `done`, the command died:
the watchdog interrupts the run's ServerApp as Ctrl-C would (so the run
directory is marked interrupted and checkpointed, resumable), stops every
process it was told of with all they started, keeps Flower's log in the run
directory, and removes the temporary paths.

Run as `python -m pollen.deployment.watchdog`; it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from ..runs.claim import abandon
from ..runs.interruption import SETTLE_SECONDS
from ..runs.results import RUN_MARKER

# The process that runs a simulation's ServerApp, and how long it may take to
# record an interruption (its own wait, and Flower's exit after it)
SERVERAPP_PROCESSES = ("flwr-simulation",)
SERVERAPP_GRACE = SETTLE_SECONDS + 15.0

DONE = "done"


class Watchdog:
    """The command's side: start the watchdog, tell it what to clean up;
    dismissed when its `with` block ends."""

    def __init__(self) -> None:
        # -P: not the shell's directory first on the module path (a `pollen`
        # folder there must not be imported), but this pollen's own folder
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(
            filter(None, [package_root, os.environ.get("PYTHONPATH")])
        )
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", __name__],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, text=True,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        self.lost = False

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dismiss()

    def _say(self, **message: Any) -> None:
        """Tell the watchdog; if it has died, say once that a kill of this
        command would now leave processes behind, and go on (it is a safety
        net, not part of the run)."""
        pipe = self.process.stdin
        assert pipe is not None
        if self.lost:
            return
        try:
            pipe.write(json.dumps(message) + "\n")
            pipe.flush()
        except (OSError, ValueError):
            self.lost = True
            print(
                f"pollen: warning: the watchdog (pid {self.process.pid}) exited; "
                "if this command is killed outright, stop what it started by hand",
                file=sys.stderr,
            )

    def superlink(self, pid: int) -> None:
        """A simulation SuperLink: its ServerApp is interrupted first."""
        self._say(superlink=pid)

    def warm_run(self, superlink: int, earlier: list[int]) -> None:
        """A run on a warm federation: only its own ServerApp (one below
        `superlink` that is not in `earlier`) is interrupted; the
        federation stays."""
        self._say(warm=superlink, earlier=earlier)

    def process_started(self, pid: int) -> None:
        self._say(process=pid)

    def temporary(self, path: Path) -> None:
        self._say(remove=str(path))

    def log(self, path: Path, run_dir: Path, name: str) -> None:
        """Keep `path` in `run_dir` as `name` (if the run made it) before
        the temporary paths go."""
        self._say(log=str(path), run_dir=str(run_dir), name=name)

    def claim(self, run_dir: Path, made: list[Path]) -> None:
        """The run directory the command holds (`pollen.runs.claim`)."""
        self._say(claim=str(run_dir), made=[str(p) for p in made])

    def dismiss(self) -> None:
        """The command cleaned up itself: the watchdog exits doing nothing."""
        self._say(done=True)
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        self.process.wait()


def watch(pipe: IO[str]) -> None:
    """Collect what the command says until the pipe closes; clean up unless
    its last word was `done`."""
    superlinks: list[int] = []
    started: list[int] = []
    logs: list[dict[str, str]] = []
    paths: list[str] = []
    claims: list[dict[str, Any]] = []
    warm: list[dict[str, Any]] = []
    for line in pipe:
        message = json.loads(line)
        if message.get(DONE):
            return
        if "superlink" in message:
            superlinks.append(int(message["superlink"]))
        if "process" in message:
            started.append(int(message["process"]))
        if "log" in message:
            logs.append(message)
        if "remove" in message:
            paths.append(message["remove"])
        if "claim" in message:
            claims.append(message)
        if "warm" in message:
            warm.append(message)
    for run in warm:
        interrupt_new_serverapps(int(run["warm"]), set(run["earlier"]))
    clean_up(superlinks, started, logs, paths)
    for claim in claims:
        abandon(Path(claim["claim"]), [Path(p) for p in claim["made"]], ours=False)


def interrupt_serverapp(superlink_pid: int) -> None:
    """Ask the simulation ServerApp below the SuperLink `superlink_pid` to
    stop, and give it time to record the interruption: SIGINT, as Flower's
    handler runs pollen's (Ray's SIGTERM handler exits at once)."""
    from . import processes

    processes.end_named(
        superlink_pid, SERVERAPP_PROCESSES, SERVERAPP_GRACE, signal.SIGINT
    )


def keep_log(log_path: Path, run_dir: Path, name: str) -> Path | None:
    """Copy a log into the run directory as `name` (a resumed run keeps the
    earlier ones: `superlink.log`, `superlink-2.log`, ...); where it went
    (None where no run started in `run_dir`)."""
    if not (log_path.exists() and run_dir.is_dir()):
        return None
    if not (run_dir / RUN_MARKER).is_file():  # no run started there
        return None
    stem, suffix = name.rsplit(".", 1)
    target, n = run_dir / name, 1
    while target.exists():
        n += 1
        target = run_dir / f"{stem}-{n}.{suffix}"
    shutil.copy(log_path, target)
    return target


def interrupt_new_serverapps(superlink: int, earlier: set[int]) -> None:
    """Interrupt the ServerApps below a warm federation's `superlink` that
    were not running before the command submitted its run."""
    from . import processes

    found = processes.named_descendants(superlink, SERVERAPP_PROCESSES)
    ours = [pid for pid in found if pid not in earlier]
    processes.end(ours, SERVERAPP_GRACE, first=signal.SIGINT)


def clean_up(
    superlinks: list[int],
    started: list[int],
    logs: list[dict[str, str]],
    paths: list[str],
) -> None:
    """Interrupt the ServerApps, stop every process, keep the logs, remove
    the temporary paths: what `pollen run` does on Ctrl-C."""
    from . import processes

    for pid in superlinks:
        interrupt_serverapp(pid)
    for pid in started:
        processes.stop(pid, grace=processes.KILL_WAIT_SECONDS)
    for pid in superlinks:
        processes.stop(pid)
    for log in logs:
        keep_log(Path(log["log"]), Path(log["run_dir"]), log["name"])
    for path in map(Path, paths):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    watch(sys.stdin)

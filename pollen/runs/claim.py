"""A run directory owned by one `pollen run` from before its first process
starts until it has reported the outcome.

The command creates the directory itself (an exclusive `mkdir`: of two runs
given one name, the second fails at once, naming it), or for `resume` takes
the existing one, and holds an exclusive `flock` on `run.lock` inside it for
its whole life: a second command on the same directory fails in well under a
second, and a lock left by a killed command is released by the kernel. The
lock file holds a token the command passes to its ServerApp (`run-token`);
the ServerApp writes only into a directory whose lock holds its token, and
echoes the token into `summary.json`, so the command reports the outcome of
its own run and never another's (an earlier run's summary in a resumed
directory, or a competing run's).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from pathlib import Path

from .results import RUN_MARKER, ResultsError, already_exists

LOCK_FILE = "run.lock"


class RunClaim:
    """The exclusive hold of one command on one run directory (`claim`);
    released when its `with` block ends, or by `release`."""

    def __init__(self, run_dir: Path, token: str, lock: int, made: list[Path]) -> None:
        self.run_dir = run_dir
        self.token = token
        self.made = made  # folders this claim created, the run directory last
        self._lock = lock

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the directory up (`abandon`)."""
        abandon(self.run_dir, self.made)
        os.close(self._lock)  # releases the flock


def abandon(run_dir: Path, made: list[Path], *, ours: bool = True) -> None:
    """Remove `run_dir`'s lock file; and if the run never started (no
    `settings.json`), the folders `made` for it, when empty: a run that
    never ran leaves nothing. Not `ours` (the watchdog of a killed command,
    whose lock the kernel freed at once): nothing, when another command
    holds the directory by now (a resume started meanwhile)."""
    if not ours and is_held(run_dir):
        return
    with contextlib.suppress(OSError):
        (run_dir / LOCK_FILE).unlink()
    if not (run_dir / RUN_MARKER).exists():
        _remove_empty(made)


def claim(run_dir: Path, *, new: bool) -> RunClaim:
    """Take `run_dir` for one run: create it (`new`; it must not exist) or
    take the existing one (a resume). `ResultsError` names the directory
    and what is wrong: it exists, it cannot be made or written (a read-only
    or unwritable output-dir, a file in the path), or another run holds it."""
    made: list[Path] = []
    if new:
        made = [p for p in (*reversed(run_dir.parents), run_dir) if not p.exists()]
        try:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            run_dir.mkdir()  # exclusive: of two runs given one name, one wins
        except FileExistsError as err:
            if Path(err.filename or "") != run_dir:  # a file where a folder goes
                _remove_empty(made)
                raise _unwritable(run_dir, "a file is in the way") from None
            raise already_exists(run_dir) from None
        except OSError as err:
            _remove_empty(made)
            raise _unwritable(run_dir, err.strerror or str(err)) from None
    token = secrets.token_hex(8)
    try:
        lock = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        _remove_empty(made)
        raise ResultsError(
            f"cannot write in the run directory {run_dir} ({err.strerror or err}); "
            "it must be a folder this user can write"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(lock)
        os.close(lock)
        raise ResultsError(
            f"the run directory {run_dir} is in use by another pollen run"
            + (f" (pid {holder})" if holder else "")
            + "; wait for it to end, or choose another run-name"
        ) from None
    os.ftruncate(lock, 0)
    os.write(lock, json.dumps({"pid": os.getpid(), "token": token}).encode())
    return RunClaim(run_dir, token, lock, made)


def _unwritable(run_dir: Path, why: str) -> ResultsError:
    return ResultsError(
        f"invalid value for 'output-dir': cannot create {run_dir} ({why}); "
        "output-dir must be a folder this user can write"
    )


def check_claimed(run_dir: Path, token: str) -> None:
    """Refuse to write into a directory the command that submitted this run
    did not claim for it: with a `run-token`, its lock must hold that token.
    Without a token (`flwr run` by hand) there is nothing to check."""
    if not token:
        return
    if claimed_token(run_dir) != token:
        raise ResultsError(
            f"{run_dir} is not held for this run (its {LOCK_FILE} does not hold "
            f"run-token {token!r}); `pollen run` claims a run's directory before "
            "submitting it: start the run with it, or leave run-token empty"
        )


def is_held(run_dir: Path) -> bool:
    """Whether a command holds `run_dir` now (a run in progress)."""
    try:
        lock = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(lock)
    return False


def claimed_token(run_dir: Path) -> str | None:
    """The token in `run_dir`'s lock file, if a command holds it."""
    try:
        return str(json.loads((run_dir / LOCK_FILE).read_text())["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _holder(lock: int) -> int | None:
    try:
        return int(json.loads(os.pread(lock, 4096, 0))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return

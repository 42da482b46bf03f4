"""One process at a time in a folder: an exclusive `flock` on a lock file.

`pollen compare` holds `compare.lock` in its `--out`, and `pollen deploy`'s
`up`, `down` and `restart` hold `deploy.lock` in the deployment's folder.
The lock file records the holder's PID and what it is doing, so a second
command can say who holds it; the kernel frees the lock when the holder's
process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, NamedTuple


class Holder(NamedTuple):
    """What a held lock file records: the holder's PID ("?" when it has not
    written it yet) and what it said it does (empty for nothing yet)."""

    pid: str
    doing: str


class LockHeld(RuntimeError):
    """Another process holds the lock."""

    def __init__(self, holder: Holder) -> None:
        super().__init__(f"held by pid {holder.pid}")
        self.holder = holder


@contextlib.contextmanager
def held(path: Path) -> Iterator[Callable[[str], None]]:
    """Hold an exclusive lock on `path` (made if missing; its opening writes
    nothing) while inside, or raise `LockHeld` at once; an `OSError` where
    it cannot be opened. Yields `say(doing)`, which records this process's
    PID and `doing` for a second command to read (`say("")` is done first)."""
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeld(holder(lock)) from None

        def say(doing: str) -> None:
            lock.truncate(0)
            lock.write(f"{os.getpid()} {doing}".rstrip())
            lock.flush()

        say("")
        yield say


def current_holder(path: Path) -> Holder | None:
    """Who holds the lock on `path`, or None when nobody does. The probe
    holds a shared lock for an instant; a process taking the lock in that
    instant is refused (`LockHeld`) and should try again."""
    try:
        lock = path.open()
    except FileNotFoundError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder(lock)
        fcntl.flock(lock, fcntl.LOCK_UN)
        return None


def holder(lock: IO[str]) -> Holder:
    """What the lock file `lock` records."""
    lock.seek(0)
    pid, _, doing = lock.read().strip().partition(" ")
    return Holder(pid or "?", doing)

"""One line on stderr while a user's code is slow, and one when it is done.

A user's data-set loader runs, unseen, in every process that needs the data
(the `pollen` command as it checks the settings, the ServerApp, each
ClientApp): one that takes a minute used to leave a minute of silence that
looked like a hang. `announced` says, once the code has run for
`ANNOUNCE_AFTER_S`, that it is still running, and when it returns, how long
it took. Code that returns sooner prints nothing: the common case stays
silent. The lines go to stderr, flushed, because that is what each process's
console or log keeps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ANNOUNCE_AFTER_S = 2.0  # seconds of silence before the "still running" line


@contextmanager
def announced(doing: str, done: str) -> Iterator[None]:
    """Run the block; once it has run `ANNOUNCE_AFTER_S`, print
    `pollen: <doing> ... still running after <s> s`, and when it returns,
    `pollen: <done> in <elapsed> s`. The second line follows only the first,
    and only when the block returns: one that raises says why itself, and
    its timer is cancelled, so no line comes after the error.

    A lock orders the timer's line against the block's end, so even when
    the two meet at the threshold, the timer never speaks after the block
    has ended and a block that returns gets both lines or neither.
    """
    after = ANNOUNCE_AFTER_S
    lock = threading.Lock()
    finished = False
    said = threading.Event()  # the "still running" line was printed

    def still_running() -> None:
        with lock:
            if not finished:
                _say(f"{doing} ... still running after {after:g} s")
                said.set()

    start = time.monotonic()
    timer = threading.Timer(after, still_running)
    timer.daemon = True  # never keeps a process alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            finished = True
    if said.is_set():
        _say(f"{done} in {time.monotonic() - start:.1f} s")


def _say(line: str) -> None:
    """One line of pollen's on stderr, flushed at once (a process's console
    or log may be read while the code still runs)."""
    print(f"pollen: {line}", file=sys.stderr, flush=True)

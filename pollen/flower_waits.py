"""Flower's idle waits, shortened in the processes pollen runs Flower's code in:
`pollen supernode`, the warm executor's ClientApps and pollen's ServerApp;
and the SuperNode's endless wait for a reply no task will write, ended.

Flower's SuperNode (`flwr/supernode/start_client_internal.py`) waits in
three places that no setting reaches, and a deployed round pays each one:

- `time.sleep(3)` when a pull finds no message: after a node replies it asks
  once more, finds nothing (the server still waits for the others), and the
  next round's message waits up to 3 s for it;
- `time.sleep(0.5)` between checks for the ClientApp's reply, and between
  checks for the reply's objects (`_push_messages`);
- a first retry after `PULL_INITIAL_BACKOFF = 1` s (then doubling) when an
  object is not there yet (`pull_objects`): the node registers a message
  before it has pulled the message's objects, so a ClientApp that starts at
  once (a warm child does) finds them missing and backs off for a second.

`pollen supernode` runs Flower's own `flower-supernode` entry point with every
flag it takes, after changing exactly these waits in that one module (its
`time` is swapped for a `PollClock`; nothing else in the process changes):
a sleep lasts `--poll-interval` (default 0.1 s; 0 runs Flower's code
unchanged) just after a message, then 5 % of the time since the last
message, never longer than Flower's own. A node in a run picks up the next
message within about 0.1 s of its arrival when rounds are short, and within
5 % of its wait when they are long; a node idle for a minute polls every
3 s again, so idle nodes load the SuperLink no more than Flower's do
(polling every 0.1 s all the time took 43 % of a core on the SuperLink with
8 idle nodes here, against 10 %). Object pulls retry after the poll
interval, doubling up to 1 s, for up to Flower's 2 h (Flower: after 1 s,
doubling up to 10 s, at most 500 tries). The warm executor (`pollen superexec`)
makes its ClientApps' object pulls retry the same way, and pollen's
ServerApp its pulls of the replies' objects: a reply is listed on the
SuperLink before the node has pushed its objects, so the server's first
pull of them often fails and Flower waits a second before the next.

One more wait of the SuperNode's has no end in Flower 1.42: after taking a
message, `_push_messages` waits for the ClientApp's reply however long it
takes, and a task that ended without writing one leaves the node listed
online (its heartbeats go on) but never taking a message again. `pollen
supernode` ends that wait once no task is left unfinished, as Flower's own
`_push_messages` does from 1.43 (`end_reply_waits_without_task`).

The change stands for a small one upstream (docs/deployment.md): a poll
interval in place of the constants 3 and 0.5 in `start_client_internal`,
and `PULL_INITIAL_BACKOFF`/`PULL_BACKOFF_CAP` as settings. Each is a
patch of `pollen.flower_patches`, guarded by version: only the Flower
releases it was verified on are changed; any other Flower runs unchanged,
with one warning line.
"""

from __future__ import annotations

import argparse
import functools
import time
import types
from collections.abc import Callable
from typing import Any

from .flower_patches import (
    CLIENTAPP_PULLS,
    PULL_AND_INFLATE,
    PULL_OBJECTS,
    SERVERAPP_PULLS,
    SUPEREXEC_POLLS,
    SUPERNODE_REPLY_WAIT,
    SUPERNODE_WAITS,
    guard,
    resolve,
)

POLL_SECONDS = 0.1
IDLE_SHARE = 0.05  # after a wait of T s, a message is picked up within ~0.05 T
# An object pull's retries: from the poll interval, doubling up to this, for
# as long as Flower's own (PULL_MAX_TIME, 2 h; not its 500 tries, which at
# 0.1 s would give up on a slow node's push after 50 s).
PULL_RETRY_CAP_SECONDS = 1.0
# An empty pull that took this long was held by a `pollen superlink` (a
# plain SuperLink answers in milliseconds): it counts as the idle sleep.
HELD_PULL_SECONDS = 1.0


class PollClock(types.ModuleType):
    """The `time` module as a polling loop of Flower's sees it (a SuperNode's,
    a SuperExec's): `sleep` waits the poll interval just after a message
    (received or replied to; for a SuperExec, a task launched), then a
    `share` of the time since (so a node idle for a minute is back at
    Flower's 3 s, and a message that comes after a wait of T seconds is
    picked up within about `share` x T), never longer than Flower asked.

    An empty pull that a `pollen superlink` held (`pull_held`: it took at
    least `HELD_PULL_SECONDS`) has waited already: the next sleep is that
    much shorter, so after a 20 s hold the node asks again at once."""

    def __init__(self, poll_seconds: float, share: float = IDLE_SHARE) -> None:
        super().__init__("time")
        self.poll_seconds = poll_seconds
        self.share = share
        self.last_message = time.monotonic()
        self.waited = 0.0  # by the held pull just before the next sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def message_seen(self) -> None:
        self.last_message = time.monotonic()

    def pull_held(self, seconds: float) -> None:
        """The empty pull before the next sleep was held `seconds`."""
        self.waited = seconds

    def sleep(self, seconds: float) -> None:
        since = time.monotonic() - self.last_message
        due = min(seconds, max(self.poll_seconds, self.share * since))
        time.sleep(max(0.0, due - self.waited))
        self.waited = 0.0


def _quicker_pulls(name: str, poll_seconds: float) -> None:
    """Object pulls through `name` retry after `poll_seconds` (never later
    than Flower's first retry), doubling up to `PULL_RETRY_CAP_SECONDS`, for
    up to Flower's `max_time` (Flower: after 1 s, doubling up to 10 s, at
    most 500 tries)."""
    from flwr.supercore.constant import PULL_INITIAL_BACKOFF

    defaults = resolve(name).__kwdefaults__
    first = min(poll_seconds, PULL_INITIAL_BACKOFF)
    defaults["initial_backoff"] = first
    defaults["backoff_cap"] = max(first, PULL_RETRY_CAP_SECONDS)
    defaults["max_tries_per_object"] = None


class NotingMessages:
    """A SuperNode step (`_pull_and_store_message`, `_push_messages`) that
    tells `clock` when it handled a message: a pull that returned a run ID,
    or a push of replies; and an empty pull that the SuperLink held."""

    def __init__(self, step: Callable[..., Any], clock: PollClock, pull: bool) -> None:
        self.step, self.clock, self.pull = step, clock, pull
        functools.update_wrapper(self, step)  # its source stays Flower's (`guard`)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = self.step(*args, **kwargs)
        if result is not None or not self.pull:
            self.clock.message_seen()
        elif (took := time.monotonic() - started) >= HELD_PULL_SECONDS:
            self.clock.pull_held(took)
        return result


def _on_clock(
    module: types.ModuleType, poll_seconds: float, steps: dict[str, bool]
) -> None:
    """`module`'s `time` becomes a `PollClock` that each of its functions
    named in `steps` restarts when it handled a message (name -> whether it
    is a pull, which handled one only when it returned something)."""
    clock = PollClock(poll_seconds)
    module.time = clock  # type: ignore[attr-defined]
    for name, pull in steps.items():
        setattr(module, name, NotingMessages(getattr(module, name), clock, pull))


def shorten_supernode_waits(poll_seconds: float = POLL_SECONDS) -> bool:
    """In this process, the SuperNode's idle sleeps and reply checks follow a
    `PollClock` and its object pulls retry from `poll_seconds`; False (and
    one warning line) when this Flower is not one the change was tested with."""
    if not guard(SUPERNODE_WAITS):
        return False
    from flwr.supernode import start_client_internal as node

    _on_clock(
        node, poll_seconds, {"_pull_and_store_message": True, "_push_messages": False}
    )
    _quicker_pulls(PULL_OBJECTS, poll_seconds)
    return True


class NothingToPush(Exception):
    """No reply is in, and no task is left to write one."""


class TaskAwareState:
    """A SuperNode's state as Flower 1.42's `_push_messages` sees it: a look
    for replies that finds none while no task is unfinished ends the wait
    (`NothingToPush`) instead of waiting for a reply that cannot come."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def get_messages_legacy(self, **filters: Any) -> Any:
        from flwr.common.constant import Status

        found = self._state.get_messages_legacy(**filters)
        if not filters.get("is_reply") or found:
            return found
        unfinished = [Status.PENDING, Status.STARTING, Status.RUNNING]
        if self._state.get_tasks(statuses=unfinished, limit=1):
            return found
        # a ClientApp stores its reply before it finishes its task: one may
        # have come in since the first look
        if found := self._state.get_messages_legacy(**filters):
            return found
        raise NothingToPush


class PushWhileTasksRun:
    """`_push_messages` that returns, pushing nothing, once no reply is in
    and no task is left to write one (`TaskAwareState`)."""

    def __init__(self, push: Callable[..., Any]) -> None:
        self.push = push
        functools.update_wrapper(self, push)  # its source stays Flower's (`guard`)

    def __call__(self, *, state: Any, **others: Any) -> None:
        try:
            self.push(state=TaskAwareState(state), **others)
        except NothingToPush:
            return


def end_reply_waits_without_task() -> bool:
    """In this process (a SuperNode's), the wait for a ClientApp's reply ends
    when no task is left to write one (`PushWhileTasksRun`), as it does in
    Flower from 1.43; False where this Flower does so itself, or is not a
    release the change was tested with (then with one warning line)."""
    if not guard(SUPERNODE_REPLY_WAIT):
        return False
    from flwr.supernode import start_client_internal as node

    node._push_messages = PushWhileTasksRun(node._push_messages)  # type: ignore[attr-defined]
    return True


def shorten_superexec_polls(poll_seconds: float = POLL_SECONDS) -> bool:
    """In this process (a `flower-superexec`), the task poll follows a
    `PollClock`: `poll_seconds` just after a task was launched, then a share
    of the time since, never longer than Flower's interval (1 s, or
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL). Every poll is an HTTP request that
    costs the SuperNode or SuperLink it asks milliseconds of CPU; a fixed
    0.1 s cost an idle SuperLink 10 % of a core and a SuperNode 5 % here.
    False (and one warning line) when this Flower is not one the change was
    tested with."""
    if not guard(SUPEREXEC_POLLS):
        return False
    from flwr.supercore.superexec import run_superexec as loop

    _on_clock(loop, poll_seconds, {"_handle_launch_result": False})
    return True


def shorten_clientapp_pulls(poll_seconds: float = POLL_SECONDS) -> bool:
    """In this process (and the children it forks), a ClientApp retries a
    message object its SuperNode has not pulled yet every `poll_seconds`."""
    if not guard(CLIENTAPP_PULLS):
        return False
    _quicker_pulls(PULL_AND_INFLATE, poll_seconds)
    return True


def shorten_serverapp_pulls(poll_seconds: float = POLL_SECONDS) -> bool:
    """In this process (a ServerApp's), the grid retries a reply's objects
    that its node has not pushed yet every `poll_seconds`."""
    if not guard(SERVERAPP_PULLS):
        return False
    _quicker_pulls(PULL_OBJECTS, poll_seconds)
    return True


def seconds_or_flowers(text: str, low: float, high: float, zero: str) -> float:
    """`text` as seconds from `low` to `high`, or 0 (`zero`: what Flower
    then does itself); else argparse's error, which says both."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds != 0 and not low <= seconds <= high:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected seconds from {low:g} to {high:g}, or 0 for {zero}"
        )
    return seconds


def poll_interval(text: str) -> float:
    """An argparse type: seconds, 0 (Flower's own waits) or 0.01 to 3."""
    return seconds_or_flowers(text, 0.01, 3, "Flower's own waits")


def add_poll_interval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--poll-interval", type=poll_interval, default=POLL_SECONDS, metavar="SECONDS",
        help=f"the sleep right after a message, growing with the idle time up to "
        f"Flower's (default {POLL_SECONDS}; 0 keeps Flower's: 3 s when no message "
        "waits, 0.5 s reply checks, 1 s first object-pull retry)",
    )  # fmt: skip

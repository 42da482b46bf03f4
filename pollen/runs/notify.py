"""Optional webhook notifications of a training run (Slack-compatible).

A `Notifier` POSTs short texts as JSON `{"text": "..."}` to one webhook URL:
when the run starts, every `every` rounds (and after the last one), when it
finishes and when it fails. Slack incoming webhooks, Mattermost and most chat
bridges accept this body as it is.

Notifications must never slow down or break training. The public methods only
put a text on a bounded queue and return; one daemon thread does the POSTs,
each with a timeout. A full queue drops the message, and a failed POST
(refused connection, timeout, HTTP 4xx/5xx) is counted and logged, once per
kind of failure, never raised. `close` waits a bounded time for the queue to
drain, so a hanging endpoint cannot hold up the end of a run.

Webhook URLs carry their credentials in the path, so they are secrets: the
full URL is never logged or put in an error message; `describe()` gives
scheme and host only, for the run to print.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from types import TracebackType
from urllib.parse import urlsplit

from ..common.webhook import URL_ENV, check_url

QUEUE_SIZE = 100
MAX_REASON = 500  # characters of a failure reason that go into a message

log = logging.getLogger("pollen.runs.notify")

_STOP = object()  # the queue item that tells the sender thread to finish


def redact(url: str) -> str:
    """Scheme and host (and port) of `url`: what may be printed of a secret URL."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}/…"


class Notifier:
    """Sends a run's progress to a webhook from a background thread.

    Parameters
    ----------
    url : str
        The webhook, an http:// or https:// URL; "" makes a disabled
        notifier (see `disabled`).
    every : int
        Send a round's results every `every` rounds, and after the last
        round; 0 or less sends none.
    timeout : float
        Seconds one POST may take before it counts as failed.
    queue_size : int
        Messages waiting to be sent at most; more are dropped.

    The counters `sent`, `failed` and `dropped` say what became of the
    messages; they are read by tests and may be printed at the end of a run.
    """

    def __init__(
        self,
        url: str,
        every: int,
        timeout: float = 5.0,
        *,
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        if url:
            check_url(url)
        if not timeout > 0:
            raise ValueError(f"notify timeout must be > 0, got {timeout!r}")
        self._url = url
        self.every = every
        self.timeout = timeout
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._lock = threading.Lock()  # guards `dropped` and `_logged`
        self._logged: set[str] = set()  # kinds of failure already logged
        self._closed = False
        self._abandoned = threading.Event()  # set when `close` gave up waiting
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(
                target=self._work, name="pollen-notify", daemon=True
            )
            self._thread.start()

    @classmethod
    def from_settings(
        cls,
        url_setting: str,
        every: int,
        environ: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> Notifier:
        """The notifier a run asks for: the `notify-url` setting if non-empty,
        else `POLLEN_NOTIFY_URL`, else a disabled one."""
        environ = os.environ if environ is None else environ
        url = url_setting.strip()
        if url:
            check_url(url)
        else:
            url = environ.get(URL_ENV, "").strip()
            if url:
                check_url(url, from_env=True)
        return cls(url, every, timeout)

    @classmethod
    def disabled(cls) -> Notifier:
        """A notifier whose methods do nothing, so callers need no `if`."""
        return cls("", 0)

    @property
    def enabled(self) -> bool:
        return bool(self._url)

    def describe(self) -> str:
        """Where notifications go, safe to print: "https://hooks.slack.com/…"."""
        return redact(self._url) if self.enabled else "off"

    # -- the messages ------------------------------------------------------

    def run_started(
        self, run_name: str, strategy: str, data_set: str, rounds: int
    ) -> None:
        self._enqueue(
            f"pollen: run {run_name} started: {strategy} on {data_set}, {rounds} rounds"
        )

    def round_finished(
        self,
        run_name: str,
        server_round: int,
        rounds: int,
        accuracy: float | None,
        loss: float | None,
        epsilon: float | None = None,
    ) -> None:
        """Send a round's results if it is a multiple of `every` or the last."""
        if self.every <= 0:
            return
        if server_round % self.every != 0 and server_round != rounds:
            return
        self._enqueue(
            f"pollen: run {run_name} round {server_round}/{rounds}: "
            + _results(accuracy, loss, epsilon)
        )

    def run_finished(
        self,
        run_name: str,
        rounds_done: int,
        accuracy: float | None,
        loss: float | None,
        epsilon: float | None = None,
    ) -> None:
        self._enqueue(
            f"pollen: run {run_name} finished after {rounds_done} rounds: "
            + _results(accuracy, loss, epsilon)
        )

    def run_interrupted(self, run_name: str, rounds_done: int) -> None:
        self._enqueue(
            f"pollen: run {run_name} interrupted after {rounds_done} rounds "
            "(Ctrl-C, SIGTERM or SIGHUP)"
        )

    def run_failed(self, run_name: str, reason: str) -> None:
        reason = " ".join(str(reason).split())  # one line
        if len(reason) > MAX_REASON:
            reason = reason[: MAX_REASON - 1] + "…"
        self._enqueue(f"pollen: run {run_name} failed: {reason}")

    # -- lifetime ----------------------------------------------------------

    def close(self, wait: float = 2.0) -> None:
        """Let queued messages go out for at most `wait` seconds, then return.

        Messages still queued when the time is up are dropped; a POST in
        flight finishes (or times out) on the daemon thread, unwaited for.
        Later messages are ignored. Calling `close` again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        wait = max(wait, 0.0)
        deadline = time.monotonic() + wait
        with contextlib.suppress(queue.Full):  # blocks only while it is full
            self._queue.put(_STOP, timeout=wait)
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            self._abandoned.set()
            # wake the thread in case it drained the queue meanwhile
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)

    def __enter__(self) -> Notifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Notifier({self.describe()!r}, every={self.every})"

    # -- the sender thread -------------------------------------------------

    def _enqueue(self, text: str) -> None:
        if not self.enabled or self._closed:
            return
        try:
            self._queue.put_nowait(text)
        except queue.Full:
            with self._lock:
                self.dropped += 1
            self._log_once("queue-full", "queue full, dropping messages")

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._abandoned.is_set():
                self._drop_queued()
                return
            self._post(str(item))

    def _drop_queued(self) -> None:
        """Count what is still queued as dropped (once `close` gave up)."""
        dropped = 1  # the item just taken
        while True:
            try:
                if self._queue.get_nowait() is not _STOP:
                    dropped += 1
            except queue.Empty:
                break
        with self._lock:
            self.dropped += dropped

    def _post(self, text: str) -> None:
        request = urllib.request.Request(
            self._url,
            data=json.dumps({"text": text}).encode(),
            headers={"Content-Type": "application/json", "User-Agent": "pollen"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as e:
            self._fail(f"HTTP {e.code}", f"HTTP {e.code} {e.reason}")
        except urllib.error.URLError as e:
            reason = e.reason
            kind = (
                type(reason).__name__
                if isinstance(reason, BaseException)
                else "URLError"
            )
            self._fail(kind, str(reason))
        except Exception as e:  # a timeout while reading, a broken connection...
            self._fail(type(e).__name__, str(e) or type(e).__name__)
        else:
            self.sent += 1

    def _fail(self, kind: str, detail: str) -> None:
        self.failed += 1
        # `detail` should not hold the URL, but a secret must not slip through
        detail = detail.replace(self._url, self.describe())
        self._log_once(kind, f"a notification failed ({detail}); training goes on")

    def _log_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning("notify %s: %s", self.describe(), message)


def _results(accuracy: float | None, loss: float | None, epsilon: float | None) -> str:
    """The numbers for people: "accuracy 93.41%, loss 0.2345, epsilon 2.31"."""
    parts = [
        "accuracy n/a" if accuracy is None else f"accuracy {100 * accuracy:.2f}%",
        "loss n/a" if loss is None else f"loss {loss:.4f}",
    ]
    if epsilon is not None:
        parts.append(f"epsilon {epsilon:.2f}")
    return ", ".join(parts)

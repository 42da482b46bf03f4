"""Webhook notifications against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pollen.common.webhook import URL_ENV, check_url
from pollen.runs.notify import Notifier, redact

SECRET = "T000/B000/s3cr3t-t0ken"


@dataclass
class Hook:
    """A local webhook: what it received, and how it answers."""

    url: str
    status: int = 200
    delay: float = 0.0
    bodies: list[dict] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        return [b["text"] for b in self.bodies]


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours proxy variables; loopback requests must go direct."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def hook() -> Iterator[Hook]:
    state = Hook(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.content_types.append(self.headers["Content-Type"])
            state.bodies.append(json.loads(body))
            time.sleep(state.delay)
            try:
                self.send_response(state.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
            except OSError:  # the client timed out and hung up
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/services/{SECRET}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL with nothing listening (the port was just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/services/{SECRET}"


def test_messages_arrive_as_slack_json(hook: Hook) -> None:
    with Notifier(hook.url, every=2) as notifier:
        notifier.run_started("demo", "fedavg", "digits", rounds=5)
        for r in range(1, 6):
            notifier.round_finished("demo", r, 5, accuracy=0.5 + r / 100, loss=1 / r)
        notifier.run_finished("demo", 5, accuracy=0.93456, loss=0.23456, epsilon=2.345)
        notifier.run_failed("demo", "CUDA out of\nmemory")
    assert notifier.sent == 6 and notifier.failed == notifier.dropped == 0
    assert hook.content_types == ["application/json"] * 6
    assert all(set(b) == {"text"} for b in hook.bodies)
    assert hook.texts == [
        "pollen: run demo started: fedavg on digits, 5 rounds",
        "pollen: run demo round 2/5: accuracy 52.00%, loss 0.5000",
        "pollen: run demo round 4/5: accuracy 54.00%, loss 0.2500",
        "pollen: run demo round 5/5: accuracy 55.00%, loss 0.2000",
        "pollen: run demo finished after 5 rounds: "
        "accuracy 93.46%, loss 0.2346, epsilon 2.35",
        "pollen: run demo failed: CUDA out of memory",
    ]


def test_round_epsilon_and_every_zero(hook: Hook) -> None:
    with Notifier(hook.url, every=1) as notifier:
        notifier.round_finished("dp", 1, 3, 0.1, 2.0, epsilon=0.5)
    with Notifier(hook.url, every=0) as never:
        for r in range(1, 4):
            never.round_finished("dp", r, 3, 0.1, 2.0)
    assert hook.texts == [
        "pollen: run dp round 1/3: accuracy 10.00%, loss 2.0000, epsilon 0.50"
    ]


def test_env_fallback_and_setting_wins(hook: Hook) -> None:
    from_env = Notifier.from_settings("", 1, environ={URL_ENV: hook.url})
    assert from_env.enabled and from_env._url == hook.url
    other = "https://hooks.example.com/services/x"
    from_setting = Notifier.from_settings(other, 1, environ={URL_ENV: hook.url})
    assert from_setting._url == other
    from_env.close(wait=0)
    from_setting.close(wait=0)


def test_env_fallback_reads_os_environ(
    hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, hook.url)
    with Notifier.from_settings("", every=1) as notifier:
        notifier.run_failed("r", "boom")
    assert hook.texts == ["pollen: run r failed: boom"]


def test_empty_setting_and_env_disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)
    for notifier in (
        Notifier.from_settings("", 1),
        Notifier.from_settings("  ", 1, environ={URL_ENV: ""}),
        Notifier.disabled(),
    ):
        assert not notifier.enabled and notifier.describe() == "off"
        notifier.run_started("r", "fedavg", "digits", 3)
        notifier.round_finished("r", 1, 3, 0.5, 1.0)
        notifier.run_finished("r", 3, 0.5, 1.0)
        notifier.run_failed("r", "x")
        notifier.close()
        assert notifier.sent == notifier.failed == notifier.dropped == 0
        assert notifier._thread is None


@pytest.mark.parametrize("url", ["ftp://x", "not a url", "http://", "https:///p"])
def test_invalid_url_names_the_key(url: str) -> None:
    with pytest.raises(ValueError, match="invalid value for 'notify-url'") as e:
        Notifier.from_settings(url, 1, environ={})
    assert "allowed: an http(s) URL, or empty" in str(e.value)
    with pytest.raises(ValueError, match="'notify-url'"):
        Notifier(url, 1)


def test_invalid_env_url_is_not_revealed() -> None:
    bad = f"ftp://hooks.example.com/{SECRET}"
    with pytest.raises(ValueError, match="'notify-url'") as e:
        Notifier.from_settings("", 1, environ={URL_ENV: bad})
    assert SECRET not in str(e.value) and "hooks.example.com" not in str(e.value)
    assert f"from {URL_ENV}" in str(e.value)


def test_describe_is_redacted() -> None:
    url = f"https://user:pw@hooks.slack.com/services/{SECRET}"
    assert check_url(url) == url
    assert redact(url) == "https://hooks.slack.com/…"
    notifier = Notifier(url, 1)
    assert notifier.describe() == "https://hooks.slack.com/…"
    assert SECRET not in repr(notifier)
    notifier.close(wait=0)


def test_slow_endpoint_never_blocks(hook: Hook) -> None:
    hook.delay = 3.0
    notifier = Notifier(hook.url, every=1, timeout=0.5)
    start = time.monotonic()
    notifier.run_started("slow", "fedavg", "digits", 3)
    for r in range(1, 4):
        notifier.round_finished("slow", r, 3, 0.5, 1.0)
    assert time.monotonic() - start < 0.1
    start = time.monotonic()
    notifier.close(wait=1.0)
    assert time.monotonic() - start < 1.5
    assert notifier.failed >= 1 and notifier.sent == 0
    notifier.run_failed("slow", "after close")  # ignored, returns at once
    assert notifier.sent == 0


def test_full_queue_drops(hook: Hook) -> None:
    hook.delay = 3.0
    notifier = Notifier(hook.url, every=1, timeout=0.3, queue_size=1)
    start = time.monotonic()
    for r in range(1, 11):
        notifier.round_finished("busy", r, 10, 0.5, 1.0)
    assert time.monotonic() - start < 0.1
    assert notifier.dropped >= 8
    notifier.close(wait=0.1)


def test_dead_endpoint_counts_failures(dead_url: str) -> None:
    with Notifier(dead_url, every=1, timeout=0.5) as notifier:
        notifier.run_started("dead", "fedavg", "digits", 2)
        notifier.run_failed("dead", "x")
    assert notifier.failed == 2 and notifier.sent == 0


def test_http_500_is_a_failure(hook: Hook) -> None:
    hook.status = 500
    with Notifier(hook.url, every=1) as notifier:
        notifier.run_started("r", "fedavg", "digits", 1)
    assert len(hook.bodies) == 1
    assert notifier.failed == 1 and notifier.sent == 0


def test_url_never_logged(
    hook: Hook, dead_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    hook.status = 500
    caplog.set_level(logging.DEBUG, logger="pollen.runs.notify")
    for url in (hook.url, dead_url):
        with Notifier(url, every=1, timeout=0.5) as notifier:
            notifier.run_started("r", "fedavg", "digits", 1)
            notifier.run_failed("r", "x")
        assert notifier.failed == 2
    records = [r for r in caplog.records if r.name == "pollen.runs.notify"]
    assert len(records) == 2  # once per kind of failure and notifier
    assert "HTTP 500" in caplog.text and "127.0.0.1" in caplog.text
    assert SECRET not in caplog.text and "/services" not in caplog.text


def test_a_run_that_cannot_open_its_directory_tells_its_failure(
    hook: Hook, tmp_path
) -> None:
    """A resume refused before the first round still sends `failed`."""
    from flwr.app import Context, RecordDict

    from pollen import server_app
    from pollen.settings import Settings

    config = {"resume": str(tmp_path / "gone"), "notify-url": hook.url}
    run_config = Settings.from_run_config(config).to_run_config()
    with pytest.raises(Exception, match="is not a pollen run directory"):
        server_app.main(None, Context(1, 0, {}, RecordDict(), run_config))
    (text,) = hook.texts
    assert text.startswith("pollen: run gone failed: ResultsError: invalid value")

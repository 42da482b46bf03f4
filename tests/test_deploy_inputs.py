"""`pollen deploy` on stale records and bad input: a PID the system gave to
another process since `up` recorded it is never signalled and never counts
as a running deployment; Unicode digits, host names a certificate cannot
hold, an IPv6 host, a taken port and a key pair that exists are refused or
handled in one line. No Flower process is started."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pollen import cli
from pollen.deployment import cluster, deploy_actions, flower, processes


def stale_record(directory: Path, pid: int) -> None:
    """A deployment.json whose SuperLink PID `pid` was recorded with another
    start time (its process ended, a reboot came, the PID was reused)."""
    record = cluster.Deployment(
        str(directory), "127.0.0.1:9093", True, superlink_pid=pid,
        superlink_state="memory",
    )  # fmt: skip
    record.save()
    raw = json.loads((directory / cluster.STATE_FILE).read_text())
    raw["started"] = {str(pid): 1}  # clock tick 1 after boot: long gone
    (directory / cluster.STATE_FILE).write_text(json.dumps(raw))


def test_down_leaves_a_process_that_reused_a_recorded_pid(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        stale_record(tmp_path, other.pid)
        assert cluster.down(tmp_path) == []
        time.sleep(0.2)
        assert other.poll() is None, "down killed a process up never started"
    finally:
        other.kill()
        other.wait()


def test_a_stale_record_is_not_a_running_deployment(tmp_path: Path) -> None:
    stale_record(tmp_path, os.getpid())
    assert cluster.Deployment.load(tmp_path).running() == []
    fresh = cluster.Deployment(str(tmp_path), "127.0.0.1:9093", True,
                               superlink_pid=os.getpid())  # fmt: skip
    fresh.save()  # as up records its own process: its start time with it
    assert cluster.Deployment.load(tmp_path).running() == [os.getpid()]


def test_a_unicode_digit_is_no_node_index(tmp_path: Path, capsys) -> None:
    cluster.Deployment(str(tmp_path), "127.0.0.1:9093", True).save()
    assert cli.main(["deploy", "restart", "²", "--dir", str(tmp_path)]) == 1
    assert "pollen: error" in capsys.readouterr().err
    with pytest.raises(deploy_actions.NodeConfigError, match="node index"):
        deploy_actions.node_extra(["²:slowdown=2"], 3)


@pytest.mark.parametrize("host", ["", "bücher.example", "a..example"])
def test_a_host_no_certificate_can_name_is_one_line(
    tmp_path: Path, capsys, host: str
) -> None:
    assert cli.main(["deploy", "certs", str(tmp_path / "certs"), host]) == 2
    assert "neither an IP address nor a DNS name" in capsys.readouterr().err
    assert not (tmp_path / "certs" / "ca.pem").exists()
    code = cli.main(["deploy", "up", "--nodes", "1", "--dir", str(tmp_path / "d"),
                     "--san", host or "bad name"])  # fmt: skip
    assert code == 2 and not (tmp_path / "d").exists()


def test_an_ipv6_host_is_bracketed_in_the_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster, "_start_processes", lambda *a, **k: None)
    deployment = cluster.up(tmp_path, 1, host="::1", port=9093, insecure=True)
    assert deployment.address == "[::1]:9093"


def test_a_key_pair_that_exists_is_never_replaced(tmp_path: Path, capsys) -> None:
    """The SuperLink may hold the old public key: a new pair locked the node out."""
    key = tmp_path / "node-0"
    assert cli.main(["deploy", "key", str(key)]) == 0
    before = key.read_bytes(), key.with_name("node-0.pub").read_bytes()
    assert cli.main(["deploy", "key", str(key)]) == 1
    assert "exists" in capsys.readouterr().err
    assert (key.read_bytes(), key.with_name("node-0.pub").read_bytes()) == before


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_superlink_whose_port_is_taken_is_not_reported_ready(tmp_path: Path) -> None:
    """Another program answering /health on the port made the new SuperLink
    look ready while it exited with 'address already in use'."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        try:
            process = flower.start_superlink(
                ["--insecure"], host="127.0.0.1", port=port,
                address=f"127.0.0.1:{port}", env=flower.flower_env(tmp_path / "home"),
                log=tmp_path / "superlink.log",
            )  # fmt: skip
        except processes.ProcessError as err:
            assert f"127.0.0.1:{port}" in str(err)
        else:  # reported ready: stop what it started, then fail
            processes.stop(process.pid)
            pytest.fail("a SuperLink on a taken port was reported ready")
    finally:
        server.shutdown()


def group_with_a_dead_leader(tmp_path: Path, name: str) -> tuple[int, int]:
    """A process group whose leader ended (reaped) while a member runs on:
    the leader's PID (the group's ID) and the member's."""
    pidfile = tmp_path / f"{name}.member"
    code = (
        "import subprocess; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    leader.wait()
    member = int(pidfile.read_text())
    assert os.getpgid(member) == leader.pid
    return leader.pid, member


def test_down_stops_what_a_dead_process_left_in_its_group(tmp_path: Path) -> None:
    """A SuperNode that died may leave its group running (its SuperExec):
    down signals the group still, as before start times were checked (then
    only a live leader's group was)."""
    leader, member = group_with_a_dead_leader(tmp_path, "supernode")
    cluster.Deployment(str(tmp_path), "127.0.0.1:1", True, superlink_pid=leader).save()
    try:
        cluster.down(tmp_path)
        assert processes.reaped(member, 5.0) or not processes.alive(member)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)

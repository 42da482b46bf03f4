"""`pollen deploy` on stale records and bad input: a PID the system gave to
another process since `up` recorded it is never signalled and never counts
as a running deployment; Unicode digits, host names a certificate cannot
hold, an IPv6 host, a taken port and a key pair that exists are refused or
handled in one line; one command at a time changes a deployment. No Flower
process is started, but by the tests marked `integration` (an `up` beside a
second one, a SuperLink that exits or whose port another program answers
on, an `up` stopped by SIGTERM: seconds each)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


# --- one command at a time on a deployment's directory ------------------------


def files_in(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@contextlib.contextmanager
def a_taken_port() -> Iterator[int]:
    """A port another program listens on while inside."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_one_command_at_a_time_changes_a_deployment(tmp_path: Path, capsys) -> None:
    """While one command holds the directory (an `up` starting its
    processes), `up`, `down` and `restart` there exit 2 at once, naming the
    directory and the holder's PID, and write nothing (two `up`s mixed two
    SuperLinks' output in one log and one record); `status` still reads."""
    cluster.Deployment(str(tmp_path), "127.0.0.1:1", True).save()
    with a_taken_port() as port, cluster.exclusive(tmp_path, "up"):
        before = files_in(tmp_path)
        for argv in (
            ["up", "--insecure", "--nodes", "1", "--port", str(port)],
            ["down"], ["restart", "superlink"], ["restart", "0"],
        ):  # fmt: skip
            started = time.monotonic()
            assert cli.main(["deploy", *argv, "--dir", str(tmp_path)]) == 2, argv
            assert time.monotonic() - started < 1.0
            error = capsys.readouterr().err
            assert f"`pollen deploy up` (pid {os.getpid()})" in error, error
            assert str(tmp_path.resolve()) in error
        assert files_in(tmp_path) == before
        assert cli.main(["deploy", "status", "--dir", str(tmp_path)]) == 0
    assert cli.main(["deploy", "down", "--dir", str(tmp_path)]) == 0  # free again


def test_up_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    """A port another program holds (it made the certificates, then failed
    as a deployment, exit 1), and a deployment that runs in the directory:
    exit 2 naming the port and --port, or the running PIDs; no process
    started, no record, certificate or log written."""
    with a_taken_port() as port:
        argv = ["deploy", "up", "--dir", str(tmp_path / "d"), "--port", str(port)]
        assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert f"port {port}" in error and "--port" in error, error
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [cluster.LOCK_FILE]
    running = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        cluster.Deployment(
            str(tmp_path), "127.0.0.1:1", True, superlink_pid=running.pid
        ).save()
        record = (tmp_path / cluster.STATE_FILE).read_bytes()
        argv = ["deploy", "up", "--dir", str(tmp_path), "--port", "1"]
        assert cli.main(argv) == 2
        assert f"already up in {tmp_path.resolve()} (PIDs {running.pid})" in (
            capsys.readouterr().err
        )
        assert (tmp_path / cluster.STATE_FILE).read_bytes() == record
        assert not (tmp_path / "certs").exists()
    finally:
        running.kill()
        running.wait()


def test_who_listens_on_a_port_is_told_from_its_health_check() -> None:
    """What tells this deployment's SuperLink from another program that took
    its port (a health check cannot: either answers)."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        with a_taken_port() as port:
            assert not processes.another_listens(os.getpid(), port)
            assert processes.another_listens(child.pid, port)
        assert not processes.another_listens(child.pid, port)  # nothing listens
    finally:
        child.kill()
        child.wait()


# --- real SuperLinks and SuperNodes (a few seconds each) ----------------------


def quick_up(site: Path, nodes: int, port: int) -> cluster.Deployment:
    """`up` as quick as it gets: insecure, Flower's own SuperExec."""
    return cluster.up(site, nodes, port=port, insecure=True, executor="cold")


def recorded_superlink(site: Path, timeout: float = 60.0) -> int:
    """The SuperLink PID `up` records once its SuperLink answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(cluster.DeployError):
            if pid := cluster.Deployment.load(site).superlink_pid:
                return pid
        time.sleep(0.02)
    raise AssertionError(f"no SuperLink recorded in {site} in {timeout:.0f} s")


@pytest.mark.integration
def test_of_two_ups_at_once_one_refuses_at_once_and_one_comes_up(
    tmp_path: Path, capsys
) -> None:
    """Measured before the lock: one exited 1 after 60 s, both SuperLinks'
    output mixed in one log; the other exited 0 with its own SuperLink dead
    (`address already in use`) and its nodes on the other's."""
    site = tmp_path / "site"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(quick_up, site, 1, processes.free_port())
        try:
            recorded_superlink(site)  # the first `up` is starting its nodes
            started = time.monotonic()
            argv = ["deploy", "up", "--dir", str(site), "--insecure", "--nodes", "1",
                    "--port", str(processes.free_port())]  # fmt: skip
            assert cli.main(argv) == 2
            assert time.monotonic() - started < 1.0
            assert f"(pid {os.getpid()}) is changing" in capsys.readouterr().err
            deployment = first.result(timeout=120)  # its node online
            assert len(deployment.running()) == 2  # its SuperLink runs too
        finally:
            first.exception(timeout=120)  # stopped what it started if it failed
            if (site / cluster.STATE_FILE).exists():
                cluster.down(site)


@pytest.mark.integration
def test_a_superlink_that_exits_during_up_is_reported_at_once(
    tmp_path: Path,
) -> None:
    """Its nodes are not waited for (60 s) nor asked about through `flwr`:
    `up` names the SuperLink with the end of its log, stops the nodes and
    leaves a record in which nothing runs."""
    site = tmp_path / "site"
    with ThreadPoolExecutor(1) as pool:
        failing = pool.submit(quick_up, site, 2, processes.free_port())
        superlink = recorded_superlink(site)
        os.kill(superlink, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(cluster.DeployError) as error:
            failing.result(timeout=120)
    assert time.monotonic() - killed < 15.0
    assert f"the SuperLink (pid {superlink}) exited; the end of" in str(error.value)
    assert str(site.resolve() / "logs" / "superlink.log") in str(error.value)
    record = cluster.Deployment.load(site)
    assert record.superlink_pid == superlink and record.nodes
    assert record.running() == []


@pytest.mark.integration
def test_a_superlink_whose_port_another_program_answers_on_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program that takes the port after `up` checked it (here: the
    check told nothing) answers the health check while the new SuperLink
    exits on `address already in use`: refused at once, naming the port and
    --port, nothing left running."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(processes, "port_problem", lambda host, port: None)
    monkeypatch.setattr(cluster, "port_problem", lambda host, port: None)
    try:
        started = time.monotonic()
        with pytest.raises(cluster.DeployError, match=f"took port {port}.*--port"):
            quick_up(tmp_path / "site", 1, port)
        assert time.monotonic() - started < 30.0
    finally:
        server.shutdown()
    record = cluster.Deployment.load(tmp_path / "site")
    assert record.superlink_pid and record.running() == [] and not record.nodes


def running_in(site: Path) -> list[int]:
    """The processes whose Flower home is in `site` (every one `up` starts)."""
    home = f"FLWR_HOME={site.resolve()}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and any(
                v.startswith(home)
                for v in (entry / "environ").read_bytes().split(b"\0")
            ):
                found.append(int(entry.name))
    return found


@pytest.mark.integration
def test_a_stopped_up_stops_what_it_started(tmp_path: Path) -> None:
    """SIGTERM (as Ctrl-C) while `pollen deploy up` starts its nodes: the
    SuperLink and the nodes are stopped (they ran on when SIGTERM ended the
    command outright), a node whose start the signal interrupted in `Popen`
    too, and the record says nothing runs; one line, exit 130."""
    site = tmp_path / "site"
    argv = [processes.entry_point("pollen"), "deploy", "up", "--dir", str(site),
            "--insecure", "--executor", "cold", "--nodes", "2",
            "--port", str(processes.free_port())]  # fmt: skip
    command = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        recorded_superlink(site)
        command.send_signal(signal.SIGTERM)
        _, error = command.communicate(timeout=60)
        assert command.returncode == cli.EXIT_INTERRUPTED, error
        assert "deploy up interrupted; what it had started is stopped" in error
        assert "Traceback" not in error
        assert cluster.Deployment.load(site).running() == []
        assert running_in(site) == []
    finally:
        if command.poll() is None:
            command.kill()
        cluster.down(site)
        for pid in running_in(site):
            processes.stop(pid)

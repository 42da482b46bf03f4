"""Processes pollen starts, waits for and stops: the one place for all three.

Every long-lived process (a SuperLink, a SuperNode, a warm executor) is
started in a session of its own, so it can be stopped as a process group by
the PID a deployment records, even by another `pollen` invocation. Waiting
for one to be ready checks, until a deadline, that it still runs and that a
readiness probe (e.g. a health URL) answers; a failure quotes the end of its
log. Stopping is always the same: SIGTERM, a grace period, SIGKILL, and a
wait that reaps the process when it is this one's child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

STOP_GRACE_SECONDS = 10.0  # from SIGTERM to SIGKILL, unless a caller says
KILL_WAIT_SECONDS = 5.0  # after SIGKILL: only the kernel is left to act
POLL_SECONDS = 0.1


class ProcessError(RuntimeError):
    """A process exited or did not become ready in time; says why."""


def entry_point(name: str) -> str:
    """A command installed next to this Python (the project's venv) or on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distinct_free_ports(n: int) -> list[int]:
    """`n` different free ports (`free_port` may give one port twice)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def start(
    command: Sequence[str],
    *,
    log: Path | None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start `command` in a session (and process group) of its own, with
    environment `env` (default: this one), its output appended to `log`
    (discarded when None: the process writes its own log), and no stdin."""
    if log is None:
        return _popen(command, env, cwd, subprocess.DEVNULL)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return _popen(command, env, cwd, out)


def _popen(
    command: Sequence[str], env: dict[str, str] | None, cwd: Path | None, out: object
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def wait_ready(
    pid: int,
    ready: Callable[[], bool],
    *,
    name: str,
    log: Path,
    timeout: float,
) -> None:
    """Return once `ready()` is true; `ProcessError` with the end of `log` if
    process `pid` exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            raise ProcessError(f"{name} exited; the end of {log}:\n{log_tail(log)}")
        if ready():
            return
        time.sleep(POLL_SECONDS)
    raise ProcessError(
        f"{name} did not answer in {timeout:.0f} s; the end of {log}:\n{log_tail(log)}"
    )


def answers_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether `url` answers HTTP 200 within a second (a health endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def log_tail(path: Path, chars: int = 2000) -> str:
    """The last `chars` characters of a log file."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def port_problem(host: str, port: int) -> str | None:
    """Why nothing new can listen on `host:port` (another program does), or
    None: checked before a server starts, since a health probe on a taken
    port hears the other program and the new server's exit goes unseen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            return f"{host}:{port}: {err.strerror or err}"
    return None


def another_listens(pid: int, port: int) -> bool:
    """Whether what listens on TCP `port` (any address) is another process
    than `pid` and those it started, from /proc: a health check that
    answered on the port then heard that program, and the server `pid`
    exits on `address already in use`. False where /proc does not tell."""
    suffix = f":{port:04X}"
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(suffix) and fields[3] == "0A":  # LISTEN
                    listening.add(f"socket:[{fields[9]}]")
    held = set()
    for process in (pid, *descendants(pid)):
        try:
            descriptors = os.listdir(f"/proc/{process}/fd")
        except PermissionError:
            return False
        except OSError:  # it exited
            continue
        for descriptor in descriptors:
            with contextlib.suppress(OSError):
                held.add(os.readlink(f"/proc/{process}/fd/{descriptor}"))
    return bool(listening) and not listening & held


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (the state
    first, the start time 20th), None when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc's field 22),
    None when it is gone: with its PID, what tells a process from a later
    one the PID was reused for."""
    fields = _stat(pid)
    return (
        int(fields[19])
        if fields and len(fields) > 19 and fields[19].isdigit()
        else None
    )


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    return not fields or fields[0] != "Z"


def start_times(pids: Iterable[int], known: Mapping[str, int]) -> dict[str, int]:
    """A record's start time for each of `pids` that runs (keyed by the PID
    as a string, as JSON keeps it), the one in `known` where it has one."""
    return {
        str(pid): when
        for pid in pids
        if (when := known.get(str(pid)) or start_time(pid)) is not None
    }


def recorded_runs(pid: int, started: Mapping[str, int]) -> bool:
    """Whether the recorded process `pid` still runs: it is alive and, where
    `started` (a record's `start_times`) has its start time, started then,
    so it is not a later process the system gave the PID to. A PID the
    record has no time for (a record written before times were kept) is
    trusted."""
    fields = _stat(pid) if pid > 0 else None  # one read: state and start time
    if not fields:  # unreadable (hidepid=): alive tells, without a time to check
        return pid > 0 and alive(pid) and str(pid) not in started
    if fields[0] == "Z":
        return False
    recorded = started.get(str(pid))
    return recorded is None or fields[19:20] == [str(recorded)]


def group_is_ours(pid: int, runs_as_recorded: bool) -> bool:
    """Whether a record may stop the process group `pid` leads: its leader
    runs as recorded, or it ended. A leader that died may leave its group
    running (a SuperNode's SuperExec, the Ray head's raylet), and Linux
    gives no new process a PID that is still a group's ID, so that group is
    still the record's. A PID that now runs another program's process is
    not."""
    return bool(pid) and (runs_as_recorded or not alive(pid))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def reaped(pid: int, wait: float) -> bool:
    """Whether `pid` ended within `wait` s (reaped when it is our child)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True
        except ChildProcessError:  # not our child: poll instead
            if not alive(pid):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)


def end(
    pids: Sequence[int],
    grace: float,
    *,
    group: bool = False,
    first: signal.Signals = signal.SIGTERM,
) -> None:
    """Send `first` (SIGTERM) to every process in `pids` (each one's process
    group when `group`), give them `grace` s together to end, then SIGKILL
    those left and wait for them. Our children among them are reaped."""
    send = os.killpg if group else os.kill
    left = list(pids)
    for sig, wait in ((first, grace), (signal.SIGKILL, KILL_WAIT_SECONDS)):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                send(pid, sig)
        deadline = time.monotonic() + wait
        left = [p for p in left if not reaped(p, deadline - time.monotonic())]
        if not left:
            return


def command_line(pid: int) -> str:
    """The command line of process `pid`, its arguments joined by spaces
    (empty if it has ended)."""
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def end_named(
    pid: int, names: Sequence[str], grace: float, first: signal.Signals
) -> None:
    """`end` the processes below `pid` whose command line contains one of
    `names`, before anything else is stopped: they get `first` and `grace`
    s to finish what they were doing."""
    end(named_descendants(pid, names), grace, first=first)


def named_descendants(pid: int, names: Sequence[str]) -> list[int]:
    """The processes below `pid` whose command line contains one of `names`."""
    return [p for p in descendants(pid) if any(n in command_line(p) for n in names)]


# Signals that stop a command as Ctrl-C does, and what each means: SIGTERM (a
# supervisor, `kill`) and SIGHUP (the terminal or SSH session closed)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
STOP_CAUSES = {
    signal.SIGINT: "Ctrl-C (SIGINT)",
    signal.SIGTERM: "SIGTERM",
    signal.SIGHUP: "SIGHUP (its terminal or SSH session closed)",
}
TERMINALS = ("/dev/pts/", "/dev/tty", "/dev/console")  # device paths of terminals


class StopSignalInterrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt; it
    keeps the signal, so that the run it stopped can say which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signal = signal.Signals(signum)


def stop_cause(interrupt: KeyboardInterrupt) -> str:
    """What stopped a command, in words (`STOP_CAUSES`): the signal a
    `StopSignalInterrupt` keeps, else Ctrl-C (Python's own KeyboardInterrupt,
    as a terminal's Ctrl-C and Jupyter's stop button send SIGINT)."""
    if isinstance(interrupt, StopSignalInterrupt):
        return STOP_CAUSES[interrupt.signal]
    return STOP_CAUSES[signal.SIGINT]


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise `StopSignalInterrupt`, a
    KeyboardInterrupt (as Ctrl-C does), so a stopped command runs its
    `finally` blocks and stops what it started. Only the main thread can
    install a handler; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            silence_closed_terminal()
        raise StopSignalInterrupt(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """While inside, Ctrl-C, SIGTERM and SIGHUP are ignored instead of
    interrupting: for clean-up that must finish, such as stopping a
    finished run's processes and keeping their logs (a SIGHUP still
    silences the closed terminal). Only the main thread can install a
    handler; elsewhere nothing is deferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hold(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            silence_closed_terminal()

    signals = (signal.SIGINT, *STOP_SIGNALS)
    previous = {sig: signal.signal(sig, hold) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def silence_closed_terminal() -> None:
    """After SIGHUP: standard output and error that are a terminal (now
    closed) go to /dev/null, so what the clean-up still says cannot fail it
    (a write to a hung-up terminal raises EIO). A file or pipe stays. A
    hung-up terminal no longer passes `isatty`: its device path tells."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(TERMINALS):
                    os.dup2(null, fd)
    finally:
        os.close(null)


def stop(pid: int, grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop the process group `pid` leads (see `end`), then SIGKILL whatever
    it had started in other sessions (Flower's SuperExec starts ServerApps
    and ClientApps in sessions of their own), waiting until they are gone:
    a caller that looks next must not find one dying."""
    strays = descendants(pid)
    end([pid], grace, group=True)
    end(strays, KILL_WAIT_SECONDS, first=signal.SIGKILL)


def stop_child(process: subprocess.Popen, grace: float) -> None:
    """`end` for a child whose exit status is wanted: the `Popen` reaps it,
    so its `returncode` is the status it ended with."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

"""`pollen superexec`: Flower's SuperExec with warm ClientApp processes.

Flower's SuperExec starts a new `flwr-clientapp` process for every message a
SuperNode receives; each one imports torch and flwr and loads the data set
before it handles its one message (seconds on a small machine, for about a
second of training). `pollen superexec` keeps Flower's message path whole
and changes only where that process comes from:

- It runs Flower's own `flower-superexec` with the same flags (Runtime API
  address, TLS, SuperExec authentication, health server), its task poll on
  pollen's clock (`flower_superexec`).
  Flower starts a ClientApp by running the documented command
  `flwr-clientapp --runtime-api-address ADDR --token TOKEN ...`, found on
  PATH; here PATH first names a two-line launcher that hands those
  arguments to this process over a private Unix socket and exits with the
  task's exit status.
- This process (the warm parent) imported torch, numpy and Flower's
  ClientApp runtime once. For each task it forks a child, which runs
  Flower's `flwr-clientapp` entry point with the launcher's arguments:
  Flower pulls the message, installs the FAB, loads the ClientApp, runs it
  and pushes the reply, exactly as in a cold process.
- After a task, pollen's ClientApp leaves a hint (`warm_hint`): the FAB
  directory and the run's and node's config. The parent then imports that
  app and loads the node's data set and shard once, and keeps those modules
  aside (`module_stash`): a later child gets them back only for imports
  that resolve to the same files, so a run with another FAB (changed code,
  another version) always executes its own code.

Fork safety: the parent never starts a torch thread pool with more than one
thread and never touches CUDA; a child sets torch's thread count to the
default a fresh process would have (OMP_NUM_THREADS or the CPUs), starts
from the torch random state of a fresh process and reseeds numpy's and
Python's, dies with its parent (PR_SET_PDEATHSIG) and is reaped through a
pidfd. A child that crashes or is killed is a failed task to Flower (its
exit status reaches the launcher, which Flower started); the parent goes on.
At most `--max-tasks` children run at once; further tasks wait.

A ClientApp's first retry for a message object its SuperNode has not pulled
yet comes after `--poll-interval` (0.1 s) instead of Flower's 1 s
(`pollen.flower_waits`), and a task uses its FAB where it is installed
already instead of unzipping it again (`installed_fab`).

Linux only (fork, pidfd, prctl). `--cold` runs `flower-superexec` alone:
Flower's stock process per message, for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import random
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..flower_waits import add_poll_interval, shorten_clientapp_pulls
from . import flower_superexec
from .installed_fab import reuse_installed_fabs
from .module_stash import ModuleStash
from .processes import alive, end, stop_child
from .warm_hint import HINT_FILE_ENV, WarmHint

LAUNCHER = "flwr-clientapp"  # the command Flower's SuperExec runs per ClientApp task
SOCKET_ENV = "POLLEN_WARM_SOCKET"
WORKDIR_PREFIX = "pollen-superexec-"  # then the warm parent's pid
DEPENDENCY_INSTALL_FLAG = "--allow-runtime-dependency-installation"
OWN_PACKAGE = __name__.split(".")[0]
PR_SET_PDEATHSIG = 1
STOP_GRACE_SECONDS = 10.0

LAUNCHER_CODE = '''\
"""flwr-clientapp for pollen's warm executor: hand this task to the warm
parent named by $POLLEN_WARM_SOCKET and exit with the task's status."""
import json, os, signal, socket, sys

sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(os.environ["POLLEN_WARM_SOCKET"])
except (KeyError, OSError) as err:
    sys.exit(f"flwr-clientapp (pollen warm launcher): no warm executor: {err}")
sock.sendall(json.dumps(sys.argv[1:]).encode() + b"\\n")
reply = b""
while not reply.endswith(b"\\n"):
    chunk = sock.recv(64)
    if not chunk:
        sys.exit("flwr-clientapp (pollen warm launcher): the warm executor went away")
    reply += chunk
status = int(reply)
if status < 0:  # the task was killed by a signal: end the same way
    try:
        signal.signal(-status, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL and SIGSTOP keep their default
        pass
    os.kill(os.getpid(), -status)
sys.exit(status)
'''


@dataclass
class Task:
    """One forked (or, for runtime dependency installation, spawned) task."""

    pid: int
    pidfd: int
    conn: socket.socket
    hint_file: Path
    started: float = field(default_factory=time.monotonic)


@dataclass
class FreshState:
    """What a fresh process would start with, recorded before any warm-up.

    torch's thread count: a parent that ran parallel work on more than one
    OpenMP thread leaves children that hang in their first parallel region
    (GNU OpenMP, seen here), so the parent works on one thread and a child
    sets the count back. The count changes a model's updates in the last
    digits, so a child runs exactly as many threads as a cold process.
    """

    torch_threads: int
    torch_rng: Any

    @classmethod
    def record(cls) -> FreshState:
        import torch

        state = cls(torch.get_num_threads(), torch.get_rng_state())
        torch.set_num_threads(1)  # warm-up work in the parent starts no pool
        return state

    def apply(self) -> None:
        import numpy as np
        import torch

        torch.set_num_threads(self.torch_threads)
        torch.set_rng_state(self.torch_rng)
        np.random.seed()
        random.seed()


class WarmExecutor:
    """The warm parent: serves launcher requests by forking children."""

    def __init__(self, workdir: Path, max_tasks: int) -> None:
        self.workdir = workdir
        self.max_tasks = max_tasks
        self.socket_path = workdir / "warm.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.socket_path))
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.requests: dict[socket.socket, bytes] = {}
        self.waiting: deque[tuple[socket.socket, list[str]]] = deque()
        self.tasks: dict[int, Task] = {}
        self.stash = ModuleStash.empty()
        self.warm_key = ""
        self.launched = 0
        self.serving = self.listener  # the request being forked (closed in the child)
        self.stopping = False
        self.fresh = preload()

    def write_launcher(self) -> Path:
        """The `flwr-clientapp` that Flower's SuperExec finds first on PATH."""
        code = self.workdir / "launcher.py"
        code.write_text(LAUNCHER_CODE)
        launcher = self.workdir / LAUNCHER
        launcher.write_text(
            "#!/bin/sh\n"
            f'exec {shlex.quote(sys.executable)} -IS {shlex.quote(str(code))} "$@"\n'
        )
        launcher.chmod(0o755)
        return launcher

    # --- the loop ------------------------------------------------------------

    def serve(self, superexec: subprocess.Popen, parent_pid: int | None) -> int:
        """Serve tasks until Flower's SuperExec or the watched parent ends, or
        this process is told to stop; the SuperExec's exit status (as a
        shell reports it)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        while not self.stopping:
            for key, _ in self.selector.select(timeout=0.5):
                self._handle(key)
            self._launch_waiting()
            if superexec.poll() is not None:
                break
            if parent_pid is not None and not alive(parent_pid):
                print(f"pollen superexec: parent {parent_pid} ended; stopping",
                      file=sys.stderr)  # fmt: skip
                break
        self.shutdown(superexec)
        code = superexec.returncode or 0
        return code if code >= 0 else 128 - code  # killed by a signal: 128 + N

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _handle(self, key: selectors.SelectorKey) -> None:
        kind = key.data
        if kind == "accept":
            conn, _ = self.listener.accept()
            self.requests[conn] = b""
            self.selector.register(conn, selectors.EVENT_READ, "request")
        elif kind == "request":
            self._read_request(key.fileobj)
        elif isinstance(kind, Task):
            if key.fileobj is kind.conn:  # the launcher went away: stop its task
                with contextlib.suppress(OSError):
                    if not kind.conn.recv(1):
                        self.selector.unregister(kind.conn)
                        os.kill(kind.pid, signal.SIGTERM)
            else:
                self._reap(kind)

    def _read_request(self, conn: socket.socket) -> None:
        try:
            chunk = conn.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.selector.unregister(conn)
            self.requests.pop(conn, None)
            conn.close()
            return
        data = self.requests[conn] + chunk
        if not data.endswith(b"\n"):
            self.requests[conn] = data
            return
        self.selector.unregister(conn)
        del self.requests[conn]
        try:
            args = json.loads(data)
            if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
                raise ValueError("expected a list of strings")
        except ValueError as err:
            print(f"pollen superexec: bad launcher request: {err}", file=sys.stderr)
            _reply(conn, 2)
            return
        self.waiting.append((conn, args))

    def _launch_waiting(self) -> None:
        while self.waiting and len(self.tasks) < self.max_tasks:
            conn, args = self.waiting.popleft()
            self.serving = conn
            self.launched += 1
            hint_file = self.workdir / f"hint-{self.launched}.json"
            if DEPENDENCY_INSTALL_FLAG in args:
                pid = self._spawn_cold(args)
            else:
                pid = self._fork(args, hint_file)
            task = Task(pid, os.pidfd_open(pid), conn, hint_file)
            self.tasks[pid] = task
            self.selector.register(task.pidfd, selectors.EVENT_READ, task)
            self.selector.register(conn, selectors.EVENT_READ, task)

    def _spawn_cold(self, args: list[str]) -> int:
        """A stock `flwr-clientapp` process: a task that installs its own
        dependencies gets a fresh environment, not this one's modules."""
        command = str(Path(sys.executable).with_name(LAUNCHER))
        return os.posix_spawn(command, [LAUNCHER, *args], os.environ)

    def _fork(self, args: list[str], hint_file: Path) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(args, hint_file)  # never returns
        return pid

    def _reap(self, task: Task) -> None:
        _, status = os.waitpid(task.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self.selector.unregister(task.pidfd)
        os.close(task.pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(task.conn)
        _reply(task.conn, code)
        del self.tasks[task.pid]
        hint = WarmHint.read(task.hint_file)
        task.hint_file.unlink(missing_ok=True)
        print(f"pollen superexec: task {task.pid} exited {code} after "
              f"{time.monotonic() - task.started:.3f} s (app "
              f"{hint.seconds if hint else float('nan'):.3f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        if hint is not None and hint.key != self.warm_key:
            self.warm(hint)

    # --- the child -----------------------------------------------------------

    def _child(self, args: list[str], hint_file: Path) -> None:
        """Run Flower's `flwr-clientapp` with the launcher's arguments."""
        code = 1
        try:
            self.selector.close()
            self.listener.close()
            for task in self.tasks.values():
                os.close(task.pidfd)
            for conn in [*self.requests, *(c for c, _ in self.waiting),
                         *(t.conn for t in self.tasks.values()), self.serving]:  # fmt: skip
                conn.close()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            _die_with_parent()
            os.environ[HINT_FILE_ENV] = str(hint_file)
            self.fresh.apply()
            forget_own_package()
            self.stash.install()
            from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

            sys.argv = [LAUNCHER, *args]
            flwr_clientapp()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(bool(done.code))
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    # --- warm-up -------------------------------------------------------------

    def warm(self, hint: WarmHint) -> None:
        """Import the hinted app and load its data for this node, then set
        those modules aside for the children whose imports match them."""
        self.stash = ModuleStash.empty()
        gc.collect()
        self.warm_key = hint.key
        app_dir = Path(hint.app_dir)
        started = time.monotonic()
        own = {n: m for n, m in sys.modules.items() if _in_package(n, OWN_PACKAGE)}
        for name in own:
            del sys.modules[name]
        before = set(sys.modules)
        sys.path.insert(0, str(app_dir))
        try:
            module = importlib.import_module(client_app_module(app_dir))
            warm_up = getattr(module, "warm_up", None)
            if callable(warm_up):
                warm_up(hint.run_config, hint.node_config)
        except Exception as err:  # the tasks then load it themselves
            print(f"pollen superexec: warm-up of {app_dir} failed: {err!r}",
                  file=sys.stderr)  # fmt: skip
        finally:
            sys.path.remove(str(app_dir))
            self.stash = ModuleStash.take(set(sys.modules) - before)
            sys.modules.update(own)
        if threading.active_count() > 1:  # a fork copies none of them
            names = [t.name for t in threading.enumerate()][1:]
            print(f"pollen superexec: warning: the warm-up left threads {names}; "
                  "forking beside them is unsafe", file=sys.stderr)  # fmt: skip
        print(
            f"pollen superexec: warmed {app_dir.name} ({len(self.stash.modules)} "
            f"modules) in {time.monotonic() - started:.2f} s",
            file=sys.stderr,
        )

    # --- shutdown ------------------------------------------------------------

    def shutdown(self, superexec: subprocess.Popen) -> None:
        """Stop every running task, then Flower's SuperExec (SIGTERM, then
        SIGKILL after `STOP_GRACE_SECONDS` each); reap them all."""
        end(list(self.tasks), STOP_GRACE_SECONDS)
        for task in self.tasks.values():
            _reply(task.conn, -signal.SIGTERM)
        stop_child(superexec, STOP_GRACE_SECONDS)


def preload() -> FreshState:
    """Import what every ClientApp task needs, once, and record the state a
    fresh process starts with (before any warm-up changes it)."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp  # noqa: F401

    with contextlib.suppress(ImportError):  # progress bars' monitor thread: none
        import tqdm

        tqdm.tqdm.monitor_interval = 0
    return FreshState.record()


def client_app_module(app_dir: Path) -> str:
    """The module of the ClientApp a Flower app names in its pyproject.toml."""
    config = tomllib.loads((app_dir / "pyproject.toml").read_text())
    reference = config["tool"]["flwr"]["app"]["components"]["clientapp"]
    return reference.partition(":")[0]


def forget_own_package() -> None:
    """Drop this executor's own modules from `sys.modules`: the app a task
    runs may be a package of the same name (pollen's FAB is), and must be
    imported from its FAB, not found already loaded from here."""
    for name in [n for n in sys.modules if _in_package(n, OWN_PACKAGE)]:
        del sys.modules[name]


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _reply(conn: socket.socket, code: int) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"{code}\n".encode())
    conn.close()


def _die_with_parent() -> None:
    """SIGTERM this process when its parent (the warm executor) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# --- command line ------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pollen superexec",
        description="Flower's SuperExec for a SuperNode's ClientApps, with warm "
        "ClientApp processes; every flag `flower-superexec` takes is passed on.",
    )
    parser.add_argument(
        "--cold", action="store_true",
        help="run Flower's stock SuperExec (a fresh process per message)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tasks", type=int, default=4,
        help="ClientApp tasks running at once; more wait (default 4)",
    )  # fmt: skip
    parser.add_argument(
        "--parent-pid", type=int, default=None,
        help="stop when this process ends (as flower-superexec does)",
    )  # fmt: skip
    add_poll_interval(parser)
    return parser


def remove_orphaned_workdirs(folder: Path) -> None:
    """Remove the work folders (launcher, socket) that warm parents left in
    `folder` when they were killed (SIGKILL runs no clean-up).

    A work folder is named `pollen-superexec-<pid>-<random>` after the
    parent that made it; one whose parent no longer runs and that belongs
    to this user is removed. One whose pid was reused stays until a later
    start finds that process gone.
    """
    for path in folder.glob(f"{WORKDIR_PREFIX}*-*"):
        owner = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        try:
            mine = path.lstat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and owner.isdigit() and not alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def superexec_command(flower_args: Sequence[str], parent_pid: int | None) -> list[str]:
    """The `flower-superexec` command line for `flower_args`."""
    command = [*flower_superexec.command(), *flower_args]
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    return command


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args, flower_args = parser.parse_known_args(argv)
    if args.max_tasks < 1:
        parser.error(f"--max-tasks must be at least 1, got {args.max_tasks}")
    chooses_executor = any(
        a == "--executor" or a.startswith("--executor=") for a in flower_args
    )
    if chooses_executor and not args.cold:
        parser.error("--executor: the warm executor replaces Flower's subprocess "
                     "executor; pass --cold to choose Flower's executors")  # fmt: skip
    if args.cold:
        command = superexec_command(flower_args, args.parent_pid)
        os.execv(command[0], command)
    if not sys.platform.startswith("linux"):
        parser.error("the warm executor needs Linux (fork, pidfd); use --cold")
    if args.poll_interval:  # before any fork: every child inherits it
        shorten_clientapp_pulls(args.poll_interval)
    reuse_installed_fabs()
    remove_orphaned_workdirs(Path(tempfile.gettempdir()))
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    try:
        executor = WarmExecutor(workdir, args.max_tasks)
        launcher = executor.write_launcher()
        env = {
            **os.environ,
            "PATH": f"{launcher.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            SOCKET_ENV: str(executor.socket_path),
        }
        superexec = subprocess.Popen(
            superexec_command(flower_args, os.getpid()), env=env
        )
        print(f"pollen superexec: warm executor (pid {os.getpid()}, at most "
              f"{args.max_tasks} tasks at once) serving flower-superexec "
              f"(pid {superexec.pid})", file=sys.stderr, flush=True)  # fmt: skip
        return executor.serve(superexec, args.parent_pid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

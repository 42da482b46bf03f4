"""Flower's own processes as pollen starts them: their environment, the
one way a SuperLink is started and waited for (by `pollen run`'s private
simulation and by `pollen deploy` alike), and how `pollen supernode` and
`pollen superlink` hand over to Flower's own entry points."""

from __future__ import annotations

import argparse
import os
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from . import flower_simulation, flower_superexec, processes
from .entry_shims import write_entry_shim

SUPERLINK_START_SECONDS = 60.0
# Ray starts one idle Python worker per CPU for a simulation's first driver;
# Flower's ClientApp actors never run in them, so they only cost start-up CPU
# (1.2 s of 28 on 2 cores, docs/lab-notes/performance.md). A value the user sets wins.
RAY_SIMULATION_ENV = {"RAY_prestart_worker_first_driver": "0"}
# Ray's longest socket path below its temporary folder (RAY_TMPDIR): its
# session's plasma store, for a pid of up to 7 digits; an AF_UNIX path holds
# at most 107 characters on Linux (Ray refuses longer ones), 103 on macOS
RAY_SOCKET_TAIL = len(
    "/ray/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"
)
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
RAY_DIR_PREFIX = "pollen-ray-"
# Each Flower process posts a usage event to telemetry.flower.ai as it starts
# and ends, and waits up to 4 s at its exit for the post: every ClientApp
# task, ServerApp, SuperLink, SuperNode and `flwr run` of a run. The
# processes pollen starts post none (as its MLflow client sends no usage
# data), unless FLWR_TELEMETRY_ENABLED says otherwise; without a network the
# failed post still cost each warm task about 0.1 s of CPU here.
TELEMETRY_ENV = {"FLWR_TELEMETRY_ENABLED": "0"}


def wrapper_parser(command: str, what: str) -> argparse.ArgumentParser:
    """The parser of `pollen COMMAND`, Flower's `flower-COMMAND` changed as
    `what` says: pollen's own flags only; every other flag is Flower's."""
    return argparse.ArgumentParser(
        prog=f"pollen {command}",
        description=f"{what}; every flag `flower-{command}` takes is passed on.",
        allow_abbrev=False,  # `--port` and the like are Flower's
    )


def hand_over(
    command: str, flower_args: Sequence[str], flower_main: Callable[[], None]
) -> int:
    """Run Flower's `flower-COMMAND` entry point in this process, with the
    flags pollen did not parse."""
    sys.argv = [f"flower-{command}", *flower_args]
    flower_main()
    return 0


def without_telemetry() -> None:
    """This process's Flower code, and every process it starts, posts no
    telemetry unless the environment asks for it (before Flower is imported:
    it reads the setting once)."""
    for name, value in TELEMETRY_ENV.items():
        os.environ.setdefault(name, value)


def flower_env(home: Path) -> dict[str, str]:
    """The environment of a Flower process with its own home, using this
    Python's entry points, never installing dependencies at run time and
    posting no telemetry (unless the environment says otherwise).
    First on its PATH is `home/bin`, where this writes pollen's
    `flower-superexec` (polls on pollen's clock: `flower_superexec`) and,
    where the environment asks runs to share a Ray cluster's actors
    (`POLLEN_RAY_SHARE`: a comparison's cells on a cluster), its
    `flwr-simulation` (`flower_simulation`; every other simulation runs
    Flower's own): a SuperLink or SuperNode starts its SuperExec, and a
    SuperExec its simulation, by those names (`entry_shims`)."""
    shims = home / "bin"
    entries = [flower_superexec]
    if flower_simulation.requested_share(os.environ) > 1:
        entries.append(flower_simulation)
    for entry in entries:
        write_entry_shim(shims, entry.COMMAND, entry.__name__, entry.FLOWER_ENTRY)
    path = [str(shims), str(Path(sys.executable).parent), os.environ["PATH"]]
    return {
        **TELEMETRY_ENV,
        **os.environ,
        "PATH": os.pathsep.join(path),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }


def start_superlink(
    options: Sequence[str],
    *,
    host: str,
    port: int,
    address: str,
    env: dict[str, str],
    log: Path,
    own_log: bool = False,
    cwd: Path | None = None,
    ca: Path | None = None,
    started: Callable[[int], None] | None = None,
    pull_hold: float = 0.0,
) -> subprocess.Popen[bytes]:
    """Start `flower-superlink` listening on `host:port` (ServerApps in
    subprocesses, no dependency installation) with `options` added (with a
    `pull_hold`, `pollen superlink` holding an empty pull that long), and
    return once its health endpoint at `address` answers (over TLS trusting
    `ca`, when given). Its console output goes to `log`; with `own_log` it
    writes `log` itself instead (`--log-file`: Flower's format, with times).
    A SuperLink that exits or stays silent for `SUPERLINK_START_SECONDS` is
    stopped and reported (`processes.ProcessError`, with its log's end).
    `started` is told its pid at once, before the wait (a watchdog that
    stops it if this command is killed meanwhile)."""
    if problem := processes.port_problem(host, port):
        raise processes.ProcessError(f"flower-superlink cannot listen on {problem}")
    program = (
        [processes.entry_point("pollen"), "superlink", "--pull-hold", str(pull_hold)]
        if pull_hold
        else [processes.entry_point("flower-superlink")]
    )
    command = [
        *program, "--isolation", "subprocess",
        "--host", host, "--port", str(port),
        "--disable-runtime-dependency-installation", *options,
    ]  # fmt: skip
    if own_log:
        command += ["--log-file", str(log)]
    process = processes.start(command, env=env, log=None if own_log else log, cwd=cwd)
    if started is not None:
        started(process.pid)
    context = None if ca is None else ssl.create_default_context(cafile=ca)
    url = f"{'http' if ca is None else 'https'}://{address}/health"
    try:
        processes.wait_ready(
            process.pid, lambda: processes.answers_ok(url, context),
            name="flower-superlink", log=log, timeout=SUPERLINK_START_SECONDS,
        )  # fmt: skip
    except BaseException:  # not up, or Ctrl-C while waiting: nothing left running
        processes.stop(process.pid)
        raise
    return process


def make_ray_dir() -> Path:
    """A new folder for one simulation's Ray files (its RAY_TMPDIR: the
    session's logs and sockets), which whoever made it removes when the
    simulation ends; left to itself, Ray keeps every session in
    `$TMPDIR/ray` for good. In the temporary folder, or in /tmp where Ray's
    socket paths below that one would be too long (a deep $TMPDIR, macOS's)."""
    root = tempfile.gettempdir()
    made = os.path.join(root, RAY_DIR_PREFIX + "x" * 8)  # mkdtemp adds 8
    if len(made) + RAY_SOCKET_TAIL > SOCKET_PATH_MAX:
        root = "/tmp"
    return Path(tempfile.mkdtemp(prefix=RAY_DIR_PREFIX, dir=root))


def simulation_env(home: Path, ray_dir: Path) -> dict[str, str]:
    """The environment of a local simulation SuperLink with its own `home`
    (and so of its ServerApp and Ray): `flower_env` and Ray's settings, its
    files in `ray_dir` (`make_ray_dir`; a RAY_TMPDIR the user set wins)."""
    return {**RAY_SIMULATION_ENV, "RAY_TMPDIR": str(ray_dir), **flower_env(home)}


def start_simulation_superlink(
    home: Path,
    env: dict[str, str],
    log: Path,
    started: Callable[[int], None] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """A simulation SuperLink on a free loopback port, insecure, named the
    default connection ("pollen") in `home`'s Flower config, so `flwr run`
    with that home submits there; the process and its port.

    It runs in `home`, not in the shell's directory: Ray puts its driver's
    directory (the simulation process, started by the SuperLink) first on
    every ClientApp actor's module path, so a `pollen` package in the shell's
    directory (another checkout) would be imported there instead of the
    app's own."""
    port = processes.free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "pollen"\n\n'
        f'[superlink.pollen]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    process = start_superlink(
        ["--insecure", "--simulation"], host="127.0.0.1", port=port,
        address=f"127.0.0.1:{port}", env=env, log=log, own_log=True, cwd=home,
        started=started,
    )  # fmt: skip
    return process, port

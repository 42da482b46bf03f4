"""A local simulation federation kept warm across runs: one simulation
SuperLink and one Ray head that several `pollen run`s submit to in turn.

A `pollen run` simulation otherwise starts its own SuperLink and, through
Flower's Ray backend, its own Ray cluster (GCS, raylet, dashboard agent,
log monitor, ...): about 9 s of a 31-s two-round digits run on 2 cores
(docs/performance.md, "A warm simulation federation"). A run submitted to a
warm federation starts only its ServerApp process and its ClientApp
actors: Flower's backend calls `ray.init()` without an address, so the
`RAY_ADDRESS` in the SuperLink's environment makes every simulation join
the head started here. `pollen compare` runs its simulated cells on one;
`pollen run --warm-simulation DIR` submits to one started elsewhere (the
test suite's, or a script's through `warm_simulation`).

Runs are meant to follow one another: two at once would share the head's
CPUs. The federation's state file says where it is, so a `pollen run` in
another process can find and check it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..files import made_folder_problem, write_json
from . import processes
from .flower import make_ray_dir, simulation_env, start_simulation_superlink
from .ray_cluster import ADDRESS_ENV

STATE_FILE = "simulation.json"
# where `pollen warm up` keeps its federation by default, and where `pollen
# run` looks for one to use (in the shell's directory)
DEFAULT_DIR = Path(".pollen-warm")
FLWR_HOME = "flwr-home"  # the Flower home whose default connection is the SuperLink
RAY_START_SECONDS = 90.0
RAY_READY_LINE = "Ray runtime started"
# what a Ray head's log says when a subprocess it started could not bind its
# port (the port was free when pollen chose it, taken when Ray bound it)
PORT_TAKEN = b"Some Ray subprocesses exited unexpectedly"
HEAD_TRIES = 3  # starts on fresh ports before a taken port is an error


class WarmSimulationError(ValueError):
    """No usable warm simulation federation where one was named."""


@dataclass(frozen=True)
class WarmSimulation:
    """A running warm federation, as recorded in `DIR/simulation.json`."""

    directory: str
    ray_address: str
    ray_temp_dir: str
    ray_pid: int
    superlink_pid: int
    # each PID's start time (`processes.start_times`): a PID reused by another
    # process since is not this federation's (records made before: {})
    started: dict[str, int] = field(default_factory=dict)
    # the CPUs its Ray head offers the ClientApp actors (`--cpus`; 0: not
    # given, so this machine's cores count, as for records made before)
    cpus: int = 0

    @property
    def cores(self) -> int:
        """The CPUs its Ray head offers: what a run's actors may ask for."""
        return self.cpus or os.cpu_count() or 1

    @property
    def root(self) -> Path:
        return Path(self.directory)

    @property
    def flwr_home(self) -> Path:
        """The Flower home whose default connection is this SuperLink."""
        return self.root / FLWR_HOME

    @property
    def env(self) -> dict[str, str]:
        """The environment of `flwr run` (and of the SuperLink, and so of
        every simulation it starts): Ray joins the head."""
        return federation_env(self.flwr_home, self.ray_address, self.ray_temp_dir)

    def _ours(self, pid: int, name: str) -> bool:
        """Whether `pid` runs as this federation's `name` process (not a
        process its PID was reused for: its command and start time agree)."""
        return processes.recorded_runs(pid, self.started) and (
            name in processes.command_line(pid)
        )

    def own_group(self, pid: int, name: str) -> int | None:
        """`pid` when its process group is this federation's to stop (it
        runs as its `name` process, or it ended: `processes.group_is_ours`),
        None when the PID now runs another program's process."""
        return pid if processes.group_is_ours(pid, self._ours(pid, name)) else None

    def live(self) -> list[int]:
        """The PIDs of its Ray head and SuperLink that still run."""
        return [
            pid
            for pid, name in (
                (self.ray_pid, "ray"),
                (self.superlink_pid, "flower-superlink"),
            )
            if self._ours(pid, name)
        ]

    def running(self) -> bool:
        """Whether its Ray head and SuperLink both still run."""
        return len(self.live()) == 2

    @classmethod
    def read(cls, directory: Path) -> WarmSimulation:
        """The federation recorded in `directory`, running or not."""
        path = directory / STATE_FILE
        try:
            raw = json.loads(path.read_text())
            federation = cls(**raw)
        except FileNotFoundError:
            raise WarmSimulationError(
                f"no warm simulation in {directory} ({STATE_FILE} missing)"
            ) from None
        except (OSError, ValueError, TypeError) as err:
            raise WarmSimulationError(f"{path} is unreadable: {err}") from None
        pids = (federation.ray_pid, federation.superlink_pid)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in pids):
            raise WarmSimulationError(f"{path} is unreadable: its PIDs are {pids}")
        cpus = federation.cpus
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 0:
            raise WarmSimulationError(f"{path} is unreadable: its CPUs are {cpus!r}")
        return federation

    @classmethod
    def load(cls, directory: Path) -> WarmSimulation:
        """The running federation recorded in `directory`."""
        federation = cls.read(directory)
        if not federation.running():
            raise WarmSimulationError(
                f"the warm simulation in {directory} is not running any more"
            )
        return federation


def federation_env(home: Path, ray_address: str, ray_temp_dir: str) -> dict[str, str]:
    """A simulation SuperLink's environment (`simulation_env`) with Ray
    joining the head at `ray_address` (its files in `ray_temp_dir`)."""
    return {
        **simulation_env(home, Path(ray_temp_dir)),
        ADDRESS_ENV: ray_address,
        "RAY_TMPDIR": ray_temp_dir,  # the head's, over one the user set
        "RAY_USAGE_STATS_ENABLED": "0",
    }


@contextlib.contextmanager
def warm_simulation(
    directory: Path, cpus: int | None = None
) -> Iterator[WarmSimulation]:
    """`start_warm_simulation`, stopped (with every run still in it) when the
    block ends, however it ends."""
    federation = start_warm_simulation(directory, cpus)
    try:
        yield federation
    finally:
        stop_warm_simulation(federation)


def start_warm_simulation(directory: Path, cpus: int | None = None) -> WarmSimulation:
    """Start a Ray head and a simulation SuperLink that joins it and record
    them in `directory` (their logs stay there); they run until
    `stop_warm_simulation`, also after this process ends (`pollen warm up`).
    `cpus` caps the CPUs the head offers (default: the CPUs Ray finds), and
    so how many ClientApp actors (one CPU each) a run starts: fewer actors
    start faster, where several federations share the machine's cores."""
    if cpus is not None and (isinstance(cpus, bool) or cpus < 1):
        raise WarmSimulationError(
            f"a warm federation offers at least 1 CPU, got cpus={cpus!r} (Ray "
            "would place no ClientApp actor)"
        )
    directory = directory.resolve()
    home = directory / FLWR_HOME
    if problem := made_folder_problem(home):
        raise WarmSimulationError(f"cannot keep a federation in {directory}: {problem}")
    for _ in range(HEAD_TRIES - 1):  # another process may bind a port first
        with contextlib.suppress(_PortTaken):
            return _start(directory, home, cpus)
    try:
        return _start(directory, home, cpus)
    except _PortTaken:
        raise WarmSimulationError(
            f"the Ray head exited at start {HEAD_TRIES} times: a port it was "
            f"given was taken each time (see {directory / 'ray-head.log'})"
        ) from None


class _PortTaken(Exception):
    """The Ray head exited right after it started: a port it was given had
    been taken between `free_port` and its bind."""


def _start(directory: Path, home: Path, cpus: int | None) -> WarmSimulation:
    """One try at `start_warm_simulation` on fresh ports."""
    ray_temp_dir = str(make_ray_dir())
    head = link = None
    log = directory / "ray-head.log"
    try:
        gcs, client, agent = processes.distinct_free_ports(3)
        env = federation_env(home, f"127.0.0.1:{gcs}", ray_temp_dir)
        earlier = log.stat().st_size if log.exists() else 0
        head = start_ray_head((gcs, client, agent), env, log, cpus)
        link, _ = start_simulation_superlink(home, env, directory / "superlink.log")
        # Ray reports a subprocess that could not bind after its ready line
        # (the SuperLink's start gives it the second it takes), then exits
        if PORT_TAKEN in log.read_bytes()[earlier:]:
            raise _PortTaken
        federation = WarmSimulation(
            str(directory),
            env[ADDRESS_ENV],
            ray_temp_dir,
            head.pid,
            link.pid,
            processes.start_times((head.pid, link.pid), {}),
            cpus or 0,
        )
        write_json(directory / STATE_FILE, asdict(federation))
    except BaseException:
        _stop(link and link.pid, head and head.pid, ray_temp_dir)
        raise
    return federation


def stop_warm_simulation(federation: WarmSimulation) -> None:
    """Stop the SuperLink (with the runs in it), then the Ray head, those of
    them that still run as its own; forget it."""
    (federation.root / STATE_FILE).unlink(missing_ok=True)
    _stop(
        federation.own_group(federation.superlink_pid, "flower-superlink"),
        federation.own_group(federation.ray_pid, "ray"),
        federation.ray_temp_dir,
    )


def _stop(superlink: int | None, head: int | None, ray_temp_dir: str) -> None:
    try:
        if superlink is not None:
            processes.stop(superlink)
    finally:
        if head is not None:
            processes.stop(head)
        shutil.rmtree(ray_temp_dir, ignore_errors=True)


def warm_up(directory: Path, cpus: int | None) -> str:
    """`pollen warm up`: a federation in `directory` that outlives the
    command, unless one runs there already; what to tell the user."""
    with contextlib.suppress(WarmSimulationError):
        earlier = WarmSimulation.read(directory.resolve())
        if earlier.running():
            differs = (
                f"; it keeps them: `pollen warm down` first for --cpus {cpus}"
                if cpus is not None and cpus != earlier.cpus
                else ""
            )
            return (
                f"pollen: the warm simulation in {directory} runs already "
                f"({describe(earlier)}){differs}"
            )
        stop_warm_simulation(
            earlier
        )  # what is left of it: a head without its SuperLink
    federation = start_warm_simulation(directory, cpus)
    return (
        f"pollen: warm simulation up in {directory} ({describe(federation)}); "
        f"`pollen run` in this folder uses it, `pollen warm down` stops it"
    )


def warm_down(directory: Path) -> str:
    """`pollen warm down`: stop the federation recorded in `directory`, or
    what still runs of it (a Ray head whose SuperLink died)."""
    federation = WarmSimulation.read(directory.resolve())
    if not federation.live():
        stop_warm_simulation(federation)  # its record and Ray's files
        return f"pollen: the warm simulation in {directory} was not running; forgotten"
    stop_warm_simulation(federation)
    return f"pollen: warm simulation in {directory} stopped"


def describe(federation: WarmSimulation) -> str:
    offered = f"--cpus {federation.cpus}" if federation.cpus else "this machine's"
    return (
        f"SuperLink pid {federation.superlink_pid}, Ray head pid "
        f"{federation.ray_pid} at {federation.ray_address}, "
        f"{federation.cores} CPUs ({offered})"
    )


def start_ray_head(
    ports: tuple[int, int, int],
    env: dict[str, str],
    log: Path,
    cpus: int | None = None,
) -> subprocess.Popen[bytes]:
    """`ray start --head --block` on loopback (its GCS, client server and
    dashboard agent on `ports`), dashboard off, `cpus` CPUs (default: the
    CPUs Ray finds) and the GPUs Ray finds;
    returns once Ray says, in what it adds to `log`, that it started. Stopped
    again if it does not, or on Ctrl-C meanwhile."""
    gcs, client, agent = ports
    command = [
        processes.entry_point("ray"), "start", "--head", "--block",
        f"--port={gcs}", "--node-ip-address=127.0.0.1",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        "--include-dashboard=false", "--disable-usage-stats",
    ]  # fmt: skip
    if cpus is not None:
        command.append(f"--num-cpus={cpus}")
    own_env = {k: v for k, v in env.items() if k != ADDRESS_ENV}  # it is the head
    earlier = log.stat().st_size if log.exists() else 0  # an earlier head's lines
    head = processes.start(command, env=own_env, log=log)
    try:
        processes.wait_ready(
            head.pid, lambda: RAY_READY_LINE.encode() in log.read_bytes()[earlier:],
            name="ray head", log=log, timeout=RAY_START_SECONDS,
        )  # fmt: skip
    except BaseException:
        processes.stop(head.pid)
        raise
    return head

"""`pollen run`: submit the app with `flwr run` and wait for its results.

Without a CONNECTION the run is a simulation on a SuperLink of its own:
private Flower home, free port, no runtime dependency installation, stopped
(by PID) when the run ends; or, with `--warm-simulation DIR`, on a warm
federation that outlives it (`warm_simulation`). With a CONNECTION (from your Flower config, e.g.
a deployment) or `--deployment DIR` it is submitted there. Either way the
log is streamed until the ServerApp reports its results written (not
through Flower's shutdown), and the run's own `summary.json` says whether it
completed (`flwr run` itself exits 0 either way).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..runs.checkpoints import CheckpointError, check_resumable
from ..runs.claim import claim as claim_run_dir
from ..runs.interruption import record_stop_cause
from ..runs.results import RUN_COMPLETED, read_history
from ..settings import Settings
from . import cluster, processes
from .console import Console
from .fab import staged_app
from .flower import (
    flower_env,
    make_ray_dir,
    simulation_env,
    start_simulation_superlink,
)
from .model_checks import built_model, warn_about_memory
from .ray_cluster import named_cluster
from .run_config import (
    check_local_data,
    check_local_device,
    check_local_tracker,
    config_string,
    pairs_problem,
    prepare_run,
)
from .warm_simulation import DEFAULT_DIR as DEFAULT_WARM_DIR
from .warm_simulation import STATE_FILE, WarmSimulation, WarmSimulationError
from .watchdog import (
    SERVERAPP_GRACE,
    SERVERAPP_PROCESSES,
    Watchdog,
    interrupt_serverapp,
    keep_log,
)

CLIENT_CPUS = 1  # per ClientApp actor in a simulation, unless the user says
# The most SuperNodes a simulation starts unless the user says: more clients
# share them (node k serves clients k, k + n, ...). Flower's simulation polls
# every node for messages ten times a second and keeps a context per node, so
# nodes cost time and memory whether sampled or not; clients beyond this cost
# nothing until they train (docs/performance.md, "Cross-device scale").
SIMULATED_NODES = 100
FLWR_STOP_SECONDS = 5.0
POLL_SECONDS = 0.1  # how often the command looks up from waiting on its run
FLOWER_LOG = "flower.log"  # in the run directory: the whole stream of `flwr run`
# what Flower's `flwr run` says when the SuperLink stops answering
LOST_CONNECTION = "Connection to the SuperLink is unavailable"
DP_NOT_RESUMABLE = (
    "a dp=true run cannot be resumed (its privacy accounting covers the run as planned)"
)
# How long a run on a warm federation waits for its simulation process to
# shut down after its results are written (about 4 s: Flower stops Ray's job)
WARM_EXIT_SECONDS = 30.0
# The longest a `pollen run` simulation takes to stop on SIGTERM: `flwr run`,
# the ServerApp, then the SuperLink with what is left (SIGTERM grace, SIGKILL)
RUN_STOP_SECONDS = (
    FLWR_STOP_SECONDS + SERVERAPP_GRACE + processes.STOP_GRACE_SECONDS
    + processes.KILL_WAIT_SECONDS
)  # fmt: skip


class Interrupted(KeyboardInterrupt):
    """A run (or a comparison) stopped by Ctrl-C (Jupyter's stop button),
    SIGTERM or SIGHUP, once every process it started here has stopped.
    `dir` holds what it wrote; `resume_after` is the round a run's
    checkpoint continues after (the same settings with `resume` set to
    `dir`), None when there is none (stopped before its first round, under
    DP-SGD, a run on a SuperLink elsewhere, which goes on, or a comparison,
    which resumes when run again)."""

    def __init__(
        self, dir: Path, resume_after: int | None, message: str | None = None
    ) -> None:
        if message is None:
            message = (
                f"interrupted; {dir} resumes after round {resume_after}"
                if resume_after is not None
                else f"interrupted; nothing in {dir} to resume"
            )
        super().__init__(message)
        self.dir = dir
        self.resume_after = resume_after


class LaunchError(ValueError):
    """Where to run is asked for in a way that cannot work (a deployment
    that is not running, a bad `--federation-config`); nothing ran."""


class LocalSuperLink:
    """A simulation SuperLink owned by this command, in its own Flower home
    (`flower.start_simulation_superlink`), its Ray's files in a folder of its
    own (`flower.make_ray_dir`), both removed when it stops; paths in the run
    config are made absolute before the run starts."""

    def __init__(self, run_dir: Path, watchdog: Watchdog | None = None) -> None:
        self.run_dir = run_dir  # where its log is kept when it stops
        self.home = Path(tempfile.mkdtemp(prefix="pollen-flwr-home-"))
        self.ray_dir = make_ray_dir()
        self.log_path = self.home / "superlink.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.log(self.log_path, run_dir, "superlink.log")
            watchdog.temporary(self.home)
            watchdog.temporary(self.ray_dir)

    @property
    def env(self) -> dict[str, str]:
        return simulation_env(self.home, self.ray_dir)

    def remove_folders(self) -> None:
        """Remove the Flower home and Ray's folder, once nothing runs in them."""
        for folder in (self.home, self.ray_dir):
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> LocalSuperLink:
        watched = None if self.watchdog is None else self.watchdog.superlink
        try:  # the watchdog knows the SuperLink before it waits for it
            self.process, _ = start_simulation_superlink(
                self.home, self.env, self.log_path, started=watched
            )
        except BaseException:
            self.remove_folders()
            raise
        return self

    def interrupt(self) -> None:
        """Interrupt the run's ServerApp (`interrupt_serverapp`)."""
        if self.process is not None:
            interrupt_serverapp(self.process.pid)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Stop everything the SuperLink started. On Ctrl-C or SIGTERM the
        ServerApp's process goes first, with time to record the interruption
        (a second Ctrl-C cuts that short; the rest is stopped all the same).
        A stop signal while the processes are stopped and the log kept waits
        for that to finish: it came after the run ended (it used to cut the
        clean-up short and report the finished run as interrupted)."""
        if self.process is None:
            return
        try:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                interrupt_serverapp(self.process.pid)
        finally:
            with processes.stop_signals_deferred():
                processes.stop(self.process.pid)
                keep_log(self.log_path, self.run_dir, "superlink.log")
                self.remove_folders()


def run_on_warm(
    flwr_args: list[str],
    warm: WarmSimulation,
    console: Console,
    watchdog: Watchdog | None = None,
) -> bool:
    """`stream_flwr` on the warm federation, returning once this run's
    ServerApp process has ended too (within `WARM_EXIT_SECONDS`), so that
    runs on one federation do not overlap; on Ctrl-C that process, and only
    that one, is interrupted (the federation stays)."""
    earlier = set(processes.named_descendants(warm.superlink_pid, SERVERAPP_PROCESSES))
    if watchdog is not None:
        watchdog.warm_run(warm.superlink_pid, sorted(earlier))

    def ours() -> list[int]:
        found = processes.named_descendants(warm.superlink_pid, SERVERAPP_PROCESSES)
        return [pid for pid in found if pid not in earlier]

    said_completed = stream_flwr(
        flwr_args, warm.env, console,
        interrupt=lambda: processes.end(ours(), SERVERAPP_GRACE, first=signal.SIGINT),
        watchdog=watchdog,
    )  # fmt: skip
    deadline = time.monotonic() + WARM_EXIT_SECONDS
    for pid in ours():  # Flower's shutdown of the simulation (Ray's job)
        processes.reaped(pid, max(0.0, deadline - time.monotonic()))
    return said_completed


@dataclass(frozen=True)
class Target:
    """Where a run goes: a `connection` of the user's Flower config, the
    `pollen deploy` `deployment` or, with neither, a simulation on this
    machine, on the `warm` federation when there is one, else on a SuperLink
    of its own."""

    connection: str | None = None
    deployment: cluster.Deployment | None = None
    warm: WarmSimulation | None = None

    @property
    def simulated(self) -> bool:
        """Whether the run is a simulation on this machine."""
        return self.connection is None and self.deployment is None


@dataclass(frozen=True)
class Outcome:
    """How a run ended: where its results are (`here`: on this machine, not
    on a remote ServerApp's), whether it `completed` and, if not, the
    `error` that ended it (the ServerApp's, or what Flower's stream said
    when the run failed before writing its results). True exactly when it
    completed."""

    run_dir: Path
    completed: bool
    error: str | None = None
    here: bool = True

    def __bool__(self) -> bool:
        return self.completed


def run(
    app: Path,
    overrides: Sequence[str],
    *,
    connection: str | None = None,
    federation: Sequence[str] = (),
    deployment_dir: Path | None = None,
    warm_dir: Path | None = None,
    verbose: bool = False,
) -> Outcome:
    """Validate, submit and follow one run of `app`; how it ended (what its
    `summary.json` says, reported on the console). A simulation runs on a
    SuperLink of its own, or on the warm federation in `warm_dir`."""
    started = time.monotonic()
    settings, run_config, resumed_after = prepare_run(app, overrides)
    target = find_target(connection, deployment_dir, warm_dir)
    submitted = checked_federation(settings, federation, target)
    run_dir = Path(settings.resume or Path(settings.output_dir) / settings.run_name)
    token = None
    earlier = _read_bytes(run_dir / "summary.json")  # a resumed run's, say
    # a resumed run's directory holds the earlier run's rounds: not this run's
    history_before = _read_bytes(run_dir / "history.json")
    with contextlib.ExitStack() as held:
        # the watchdog cleans up if this command is killed outright
        watchdog = held.enter_context(Watchdog())
        if connection is None:  # the ServerApp writes on this machine: ours only
            claim = held.enter_context(claim_run_dir(run_dir, new=not settings.resume))
            watchdog.claim(run_dir, claim.made)
            token = claim.token
            run_config = config_string(replace(settings, run_token=token))
        log_path = _flower_log(run_dir, watchdog, verbose)
        try:
            with (
                log_path.open("w") as log,
                contextlib.closing(Console(log, verbose=verbose)) as console,
            ):
                try:
                    said_completed = _submit(app, run_config, run_dir, submitted,
                                             target, console, watchdog)  # fmt: skip
                except KeyboardInterrupt:  # every process of the run has stopped
                    if target.simulated:
                        _show_lost_rounds(console, run_dir, settings.rounds,
                                          history_before, resumed_after)  # fmt: skip
                    raise
        except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM or SIGHUP
            if token is not None:  # the ServerApp cannot tell which: say it
                record_stop_cause(run_dir, token, processes.stop_cause(stop))
            resume = resume_command(app, overrides, federation, run_dir)
            after = _report_stopped(target, run_dir, settings, resume)
            raise Interrupted(run_dir, after) from None
        finally:
            kept = _keep_flower_log(log_path, run_dir)
        wall_seconds = time.monotonic() - started
        here = _read_bytes(run_dir / "summary.json")
        if said_completed and (here is None or (token is None and here == earlier)):
            # a remote SuperLink's ServerApp wrote its results on its own machine
            print(
                f"pollen: run completed; results in {run_dir} on the ServerApp's machine"
            )
            return Outcome(run_dir, True, here=False)
        outcome = report_outcome(
            run_dir, wall_seconds, resumed=bool(settings.resume), token=token,
            error=console.failure(), log=kept or log_path, earlier=earlier,
        )  # fmt: skip
        if not outcome and target.deployment is not None:
            resume = resume_command(
                app, overrides, federation, run_dir, target.deployment.root
            )
            for line in lost_deployment(
                target.deployment, run_dir, settings, resume, outcome.error
            ):
                print(f"pollen: {line}", file=sys.stderr)
        return outcome


def _show_lost_rounds(
    console: Console,
    run_dir: Path,
    total_rounds: int,
    history_before: bytes | None,
    resumed_after: int,
) -> None:
    """After an interrupt, the round blocks this run recorded that Flower's
    stream lost (`Console.catch_up`): none when it recorded no round (its
    history is still the file it found, an interrupted resume's start-up),
    none up to the round a resume continues after."""
    if _read_bytes(run_dir / "history.json") == history_before:
        return
    console.catch_up(read_history(run_dir), total_rounds, after=resumed_after)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def find_target(
    connection: str | None, deployment_dir: Path | None, warm_dir: Path | None
) -> Target:
    """Where `pollen run` sends its run: `connection`, the deployment running
    in `deployment_dir`, or a simulation, on the warm federation in
    `warm_dir` or, without one, in the shell's directory (`warm_here`)."""
    deployment = warm = None
    if deployment_dir is not None:
        deployment = running_deployment(deployment_dir, connection)
    if warm_dir is not None:
        warm = running_warm_simulation(warm_dir, connection, deployment)
    elif connection is None and deployment is None:
        warm = warm_here()
    return Target(connection, deployment, warm)


def checked_federation(
    settings: Settings, federation: Sequence[str], target: Target
) -> list[str]:
    """The `--federation-config` values to submit, once this machine is
    checked for what runs on it: a simulation gets pollen's defaults
    (`simulation_federation`) and needs the device and GPU share it asks
    for; a ServerApp here (no connection) needs the data and the tracker."""
    federation = list(federation)
    if target.simulated:
        # the CPUs the simulation's Ray offers: a warm head's, else this machine's
        cores = target.warm.cores if target.warm is not None else os.cpu_count() or 1
        check_local_device(settings.device)
        federation = simulation_federation(
            federation, settings.num_clients, settings.device,
            cohorts=settings.client_execution == "cohort",
            cores=cores,
        )  # fmt: skip
        check_local_gpus(federation)
        given = _parse_federation(federation)
        nodes = int(given["num-supernodes"])
        actors = int(cores // float(given["client-resources-num-cpus"]))
        warn_about_memory(settings, built_model(settings), max(1, actors))
        if settings.min_available_nodes > nodes:
            raise LaunchError(
                f"invalid value for 'min-available-nodes': {settings.min_available_nodes}"
                f" above the simulation's {nodes} SuperNodes (num-supernodes): the "
                "run would wait node-wait for nodes that never come; allowed: at "
                f'most {nodes}, or more nodes (--federation-config "num-supernodes=N")'
            )
    if target.connection is None:  # the ServerApp reads the data on this machine
        check_local_data(settings)
        check_local_tracker(settings)
    return federation


def _flower_log(run_dir: Path, watchdog: Watchdog, verbose: bool) -> Path:
    """A temporary file for the whole stream of `flwr run`, kept as the run
    directory's `FLOWER_LOG` when the run ends (by the watchdog if this
    command is killed); said on the console unless `verbose` shows it too."""
    descriptor, name = tempfile.mkstemp(prefix="pollen-flower-", suffix=".log")
    os.close(descriptor)  # reopened by name to write the stream
    log_path = Path(name)
    watchdog.log(log_path, run_dir, FLOWER_LOG)
    watchdog.temporary(log_path)
    if not verbose:
        print(
            f"pollen: Flower's and Ray's lines go to {FLOWER_LOG} in the run's "
            "directory (--verbose: here too)",
            flush=True,
        )
    return log_path


def _keep_flower_log(log_path: Path, run_dir: Path) -> Path | None:
    """Move the stream of `flwr run` into the run directory; where it went,
    or None when the run wrote no directory here (it failed early, or is
    remote): then it stays at `log_path`, said on the console."""
    kept = keep_log(log_path, run_dir, FLOWER_LOG)
    if kept is not None:
        log_path.unlink()
    else:
        print(f"pollen: Flower's and Ray's lines are in {log_path}", file=sys.stderr)
    return kept


def lost_deployment(
    submitted: cluster.Deployment,
    run_dir: Path,
    settings: Settings,
    resume: str,
    error: str | None,
) -> list[str]:
    """What became of the deployment a run was `submitted` to and failed on
    with `error`, and how to go on: stopped (`pollen deploy down`: nothing
    of it runs), its SuperLink gone (killed or crashed) while its SuperNodes
    run on, or restarted since; then the command that resumes the run from
    its last checkpoint. Where the run's own SuperLink still runs and Flower
    lost the connection to it: a network fault. Nothing for a run that
    failed on its own, or a deployment whose record is gone."""
    try:
        deployment = cluster.Deployment.load(submitted.root)
    except cluster.DeployError:
        return []
    superlink, dir_flag = deployment.superlink_pid, shlex.quote(str(deployment.root))
    if deployment.ours(superlink) and superlink == submitted.superlink_pid:
        if LOST_CONNECTION not in (error or ""):
            return []
        return [
            f"the deployment's SuperLink (pid {superlink}) still runs: the "
            f"connection to it at {deployment.address} failed (a network fault?); "
            f"its log: {deployment.superlink_log}"
        ]
    if deployment.ours(superlink):
        lines = [
            f"the deployment's SuperLink was restarted during the run (pid "
            f"{submitted.superlink_pid}, now {superlink}): the run's ServerApp "
            "ended with the first"
        ]
    elif not deployment.running():
        lines = [
            f"the deployment in {deployment.root} was stopped during the run "
            "(`pollen deploy down`?): its ServerApp ended with its SuperLink; start "
            f"it again with `pollen deploy up --dir {dir_flag}` and the options it "
            f"had ({len(deployment.nodes)} nodes on {deployment.address}, "
            f"--superlink-state {deployment.superlink_state}, its --data-root and "
            "--node-config)"
        ]
    else:
        restart = (
            f"`pollen deploy restart superlink --dir {dir_flag}`"
            if deployment.superlink_state == "file"
            else "`pollen deploy down` and `up` (its state was in memory)"
        )
        lines = [
            f"the deployment's SuperLink (pid {superlink}) stopped during the run "
            f"(killed or crashed; its log: {deployment.superlink_log}) while its "
            f"SuperNodes run on; the run's ServerApp ended with it; restart it with "
            f"{restart}"
        ]
    return [*lines, resume_hint(run_dir, settings, resume)]


def resume_hint(run_dir: Path, settings: Settings, resume: str) -> str:
    """How a stopped run continues: the `resume` command after its last
    checkpoint, or why it cannot."""
    if settings.dp:
        return DP_NOT_RESUMABLE
    round = checkpointed_round(run_dir, settings)
    if round is None:
        return _stopped_without_checkpoint(run_dir, settings.rounds)
    return f"then resume after round {round} (checkpointed) with:\n  {resume}"


def checkpointed_round(run_dir: Path, settings: Settings) -> int | None:
    """The round a resume of `run_dir` with `settings` continues after; None
    when it has no usable checkpoint."""
    try:
        return check_resumable(run_dir, settings.to_run_config())
    except (CheckpointError, OSError, ValueError):
        return None


def _report_stopped(
    target: Target, run_dir: Path, settings: Settings, resume: str
) -> int | None:
    """Say what an interrupted `pollen run` leaves: a simulation here has
    recorded the interruption (`report_interrupted`, with the `resume`
    command); a run elsewhere goes on without this command. The round a
    resume continues after; None when there is none to resume here."""
    if target.simulated:
        return report_interrupted(run_dir, settings, resume)
    print(
        "pollen: stopped following the run; it goes on at the SuperLink "
        "(`flwr stop RUN_ID` ends it; the run id is in Flower's lines)",
        file=sys.stderr,
    )
    return None


def _submit(
    app: Path,
    run_config: str,
    run_dir: Path,
    federation: Sequence[str],
    target: Target,
    console: Console,
    watchdog: Watchdog | None = None,
) -> bool:
    """Stage the app, submit it, stream its log; whether it said it completed."""
    with staged_app(app) as staged:
        if watchdog is not None:
            watchdog.temporary(staged)
        flwr_args = ["run", str(staged), "--run-config", run_config]
        for value in federation:
            flwr_args += ["--federation-config", value]
        flwr_args.append("--stream")
        if target.deployment is not None:
            flwr_args.insert(2, cluster.CONNECTION)
            said_completed = stream_flwr(
                flwr_args, flower_env(target.deployment.flwr_home), console,
                watchdog=watchdog,
            )  # fmt: skip
        elif target.warm is not None:
            said_completed = run_on_warm(flwr_args, target.warm, console, watchdog)
        elif target.connection is None:
            with LocalSuperLink(run_dir, watchdog) as link:
                said_completed = stream_flwr(
                    flwr_args, link.env, console, interrupt=link.interrupt,
                    watchdog=watchdog,
                )  # fmt: skip
        else:
            flwr_args.insert(2, target.connection)
            said_completed = stream_flwr(
                flwr_args, dict(os.environ), console, watchdog=watchdog
            )
    return said_completed


def resume_command(
    app: Path,
    overrides: Sequence[str],
    federation: Sequence[str],
    run_dir: Path,
    deployment: Path | None = None,
) -> str:
    """The `pollen run` that continues the run in `run_dir`: the same
    settings (a resume must keep them), federation and `deployment` (its
    nodes keep the clients' state), and `resume`."""
    words = ["pollen", "run", shlex.quote(str(app))]
    if deployment is not None:
        words += ["--deployment", shlex.quote(str(deployment))]
    for value in [*overrides, f"resume='{run_dir}'"]:
        words += ["-c", _shell_word(value)]
    for value in federation:
        words += ["--federation-config", _shell_word(value)]
    return " ".join(words)


def _shell_word(text: str) -> str:
    """`text` as one shell word: in double quotes where that keeps it as it is
    (a run config's quoted strings read best so), else as `shlex` quotes it."""
    if shlex.quote(text) == text or any(c in text for c in '"$`\\!'):
        return shlex.quote(text)
    return f'"{text}"'


def report_interrupted(run_dir: Path, settings: Settings, command: str) -> int | None:
    """Say where an interrupted run stopped and how to continue it; the round
    a resume continues after (None: it cannot be resumed)."""
    if settings.dp:
        print(
            f"pollen: interrupted; {DP_NOT_RESUMABLE}; what it wrote is in {run_dir}",
            file=sys.stderr,
        )
        return None
    round = checkpointed_round(run_dir, settings)
    if round is None:
        print(
            f"pollen: {_stopped_without_checkpoint(run_dir, settings.rounds)}",
            file=sys.stderr,
        )
        return None
    print(
        f"pollen: interrupted after round {round} (checkpointed); resume with:\n"
        f"  {command}",
        file=sys.stderr,
    )
    if settings.clients_keep_state and not settings.checkpoint_every:
        print(
            "pollen: the clients' own state (local entries, h_k, c_k, personal "
            "models) is saved "
            "only with checkpoint-every; the resumed run starts it afresh",
            file=sys.stderr,
        )
    return round


def _stopped_without_checkpoint(run_dir: Path, rounds: int) -> str:
    """What a stopped run that left no checkpoint to resume from did: it
    had not started, had finished no round, or stopped after some (or
    during the wrap-up after its last: every round is recorded)."""
    if not run_dir.exists():
        return "interrupted before the run started"
    try:
        done = len(read_history(run_dir))
    except (OSError, ValueError):
        done = 0
    if done >= rounds:
        return (
            f"stopped during the wrap-up after the last round ({done} of "
            f"{rounds}): history.json holds every round; model.pt and curves.png "
            f"may be missing (what was written is in {run_dir})"
        )
    if done:
        return (
            f"interrupted after round {done} of {rounds}, with no checkpoint "
            f"to resume from (what was written is in {run_dir})"
        )
    return (
        "interrupted before a round was completed; nothing to resume "
        f"(what was written is in {run_dir})"
    )


def simulation_federation(
    federation: list[str],
    num_clients: int,
    device: str = "auto",
    cohorts: bool = False,
    cores: int | None = None,
) -> list[str]:
    """The `--federation-config` values of a simulation, with pollen's defaults
    for the keys the user did not set: one SuperNode per client up to
    `SIMULATED_NODES` (with `cohorts`, one per ClientApp actor the cores
    hold: each node then trains its share of a round as one cohort), and one
    CPU per ClientApp actor. Flower's default of 2 CPUs runs one client at a time
    with two torch threads; with one CPU each, Ray runs as many actors as
    there are cores, each with one thread (Ray sets `OMP_NUM_THREADS` from
    the actor's CPUs), which on 2 cores trains the `mlp` workload's rounds
    1.8x faster (docs/performance.md). `device='cuda'` needs a GPU share
    (`client-resources-num-gpus` > 0): without one Ray hides the GPU from the
    ClientApp actors, every client fails and the run ends at chance accuracy
    (seen on an H100, docs/lab-notes/performance.md). `cores`: the CPUs the simulation's
    Ray offers (a warm head's `--cpus`; default: this machine's)."""
    cores = cores or os.cpu_count() or 1
    given = _parse_federation(federation)
    check_federation(given, cores)
    if device == "cuda" and not given.get(GPU_SHARE):
        raise LaunchError(
            "invalid value for 'device': 'cuda' in a simulation without a GPU share; "
            f'give the ClientApps one, e.g. --federation-config "{GPU_SHARE}=0.25" '
            "(without it Ray hides the GPU from them), or use device='auto'"
        )
    defaults = {
        "num-supernodes": simulated_nodes(num_clients, cohorts, cores),
        "client-resources-num-cpus": CLIENT_CPUS,
    }
    if any(value.endswith(".toml") for value in federation):
        # Flower takes a .toml alone, not beside key=value words: pass its values
        federation = [f"{key}={json.dumps(value)}" for key, value in given.items()]
    return federation + [f"{k}={v}" for k, v in defaults.items() if k not in given]


def simulated_nodes(num_clients: int, cohorts: bool, cores: int | None = None) -> int:
    """A simulation's SuperNodes where the user set none: one per client up
    to `SIMULATED_NODES`, or with `cohorts` one per ClientApp actor the
    `cores` (default: this machine's) hold."""
    actors = max(1, (cores or os.cpu_count() or 1) // CLIENT_CPUS)
    return min(num_clients, actors if cohorts else SIMULATED_NODES)


GPU_SHARE = "client-resources-num-gpus"


def _parse_federation(federation: Sequence[str]) -> dict[str, object]:
    """`--federation-config` values as `flwr run` reads them."""
    from click import ClickException
    from flwr.common.config import parse_config_args  # what `flwr run` reads

    for value in federation:
        if not value.endswith(".toml") and (problem := pairs_problem(value)):
            raise LaunchError(f"invalid --federation-config {value!r}: {problem}")
    try:
        return parse_config_args(list(federation))
    except (OSError, ValueError, ClickException) as err:  # a .toml it cannot read
        raise LaunchError(f"invalid --federation-config {federation}: {err}") from err


def check_local_gpus(federation: Sequence[str]) -> None:
    """Refuse a GPU share (`client-resources-num-gpus` > 0) this machine
    cannot give: Ray then places no ClientApp actor, and Flower stops the
    simulation with "ActorPool is empty" after start-up. torch is imported
    only when a share is asked for."""
    share = _parse_federation(federation).get(GPU_SHARE) or 0
    if not isinstance(share, int | float) or share <= 0:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if share > gpus:
        raise LaunchError(
            f"invalid --federation-config value {GPU_SHARE}={share!r}; this machine "
            f"has {gpus} CUDA GPU(s), so Ray would start no ClientApp actor; "
            f"allowed here: a number in [0, {gpus}]"
        )


def check_federation(given: dict[str, object], cores: int) -> None:
    """Refuse simulation federation values Flower would only trip over after
    start-up: no SuperNodes (the run waits for nodes that never come), or
    ClientApp resources no actor can be given (Ray never places one; its
    head offers `cores` CPUs)."""
    rules = {
        "num-supernodes": (lambda v: v >= 1, "an integer >= 1", int),
        "client-resources-num-cpus": (
            lambda v: 0 < v <= cores, f"a number in (0, {cores}] (the CPUs the "
            "simulation's Ray offers: an actor needing more is never started)",
            (int, float),
        ),
        "client-resources-num-gpus": (lambda v: v >= 0, "a number >= 0", (int, float)),
    }  # fmt: skip
    for name, (valid, allowed, kinds) in rules.items():
        if name not in given:
            continue
        value = given[name]
        if isinstance(value, bool) or not isinstance(value, kinds) or not valid(value):
            raise LaunchError(
                f"invalid --federation-config value {name}={value!r}; allowed: {allowed}"
            )


def running_warm_simulation(
    directory: Path, connection: str | None, deployment: cluster.Deployment | None
) -> WarmSimulation:
    """The warm simulation federation recorded in `directory`, if it runs."""
    if connection is not None or deployment is not None:
        raise LaunchError("--warm-simulation runs a simulation: give no CONNECTION "
                          "or --deployment with it")  # fmt: skip
    try:
        return WarmSimulation.load(directory.expanduser().resolve())
    except WarmSimulationError as err:
        raise LaunchError(str(err)) from None


def warm_here() -> WarmSimulation | None:
    """The federation `pollen warm up` keeps in the shell's directory, if it
    runs: a simulation without `--warm-simulation` uses it (said on the
    console), else starts its own; not where `RAY_ADDRESS` names the Ray
    cluster to join (a comparison's cells on a cluster, say)."""
    directory = DEFAULT_WARM_DIR.resolve()
    if not (directory / STATE_FILE).exists():
        return None
    if (address := named_cluster(os.environ)) is not None:
        print(
            f"pollen: the warm federation in {DEFAULT_WARM_DIR} is not used: "
            f"RAY_ADDRESS={address} names the Ray cluster this run joins",
            flush=True,
        )
        return None
    try:
        warm = WarmSimulation.load(directory)
    except WarmSimulationError as err:
        print(f"pollen: {err}; this run starts a federation of its own", flush=True)
        return None
    print(
        f"pollen: simulating on the warm federation in {DEFAULT_WARM_DIR} "
        "(`pollen warm down` stops it)",
        flush=True,
    )
    return warm


def running_deployment(directory: Path, connection: str | None) -> cluster.Deployment:
    """The `pollen deploy` deployment recorded in `directory`, if it runs."""
    if connection is not None:
        raise LaunchError("give a CONNECTION or --deployment, not both")
    try:
        deployment = cluster.Deployment.load(directory.expanduser().resolve())
    except cluster.DeployError as err:
        raise LaunchError(str(err)) from None
    if not deployment.ours(deployment.superlink_pid):
        if deployment.running() and deployment.superlink_state == "file":
            raise LaunchError(
                f"the SuperLink of the deployment in {deployment.root} is not running "
                f"(its SuperNodes are); restart it with `pollen deploy restart "
                f"superlink --dir {shlex.quote(str(directory))}`"
            )
        raise LaunchError(
            f"the deployment in {deployment.root} is not running; start it with "
            f"`pollen deploy up --dir {directory}`"
        )
    return deployment


def stream_flwr(
    flwr_args: list[str],
    env: dict[str, str],
    console: Console,
    *,
    interrupt: Callable[[], None] | None = None,
    watchdog: Watchdog | None = None,
) -> bool:
    """`flwr run`, its output (both streams) handed to `console` line by line,
    until it exits or, sooner, until the ServerApp says it completed (that
    line is not passed on: `report_outcome` says where the results are):
    every result is written by then, and Flower's own shutdown of the
    simulation (stopping Ray, draining the log stream) would keep the command
    waiting about 4 s longer. Whether the ServerApp said so.

    On Ctrl-C (SIGTERM, SIGHUP) `interrupt` stops the ServerApp, which records
    the interruption, while its last lines still reach the console: what the
    console shows last is what the history holds."""
    process = subprocess.Popen(
        [processes.entry_point("flwr"), *flwr_args],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if watchdog is not None:
        watchdog.process_started(process.pid)
    assert process.stdout is not None
    stream, completed = process.stdout, threading.Event()
    ended = threading.Event()  # the stream ended, or said the run completed

    def forward() -> None:
        marker = RUN_COMPLETED.encode()
        for line in stream:
            if marker in line:
                completed.set()
                break
            console.line(line.decode(errors="replace").rstrip("\n"))
        ended.set()

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    try:
        while not ended.wait(POLL_SECONDS):
            pass
    except KeyboardInterrupt:
        if interrupt is not None:
            interrupt()  # the ServerApp records the interruption, and ends
            ended.wait(FLWR_STOP_SECONDS)  # its last lines reach the console
        raise
    finally:
        processes.stop_child(process, FLWR_STOP_SECONDS)
        reader.join(FLWR_STOP_SECONDS)
    return completed.is_set()


def report_outcome(
    run_dir: Path,
    wall_seconds: float,
    resumed: bool = False,
    *,
    token: str | None = None,
    error: str | None = None,
    log: Path | None = None,
    earlier: bytes | None = None,
) -> Outcome:
    """How the run ended, from its own record of how it ended; said
    on the console with where its results are, the command's wall time and,
    of it, the ServerApp's (start-up of Flower and Ray is the difference; a
    resumed run's ServerApp time covers every part, so it is given apart).

    With a `token` (the run directory's claim) only a `summary.json` that
    carries it counts: one left by an earlier run (a resume that failed
    before its first round) is not this run's outcome; without one (a run
    on a CONNECTION: the directory is not claimed here) neither is the
    summary the directory held before the run (`earlier`). A run without its
    own summary failed before writing it: the reason said is `error`, the
    stream's last error line, and `log` holds the rest."""
    summary_path = run_dir / "summary.json"
    text = _read_bytes(summary_path)
    try:
        summary = json.loads(text) if text is not None else {}
    except ValueError:
        summary = {}
    if token is not None and summary.get("run-token") != token:
        summary = {}
    if token is None and earlier is not None and text == earlier:
        summary = {}
    if not summary:
        error = error or "Flower gave no error line"
        print(
            f"pollen: run failed before writing its results: {error}"
            + (f" (Flower's lines: {log})" if log else ""),
            file=sys.stderr,
        )
        return Outcome(run_dir, False, error)
    if summary.get("status") != "completed":
        print(f"pollen: run failed: {summary.get('error')}", file=sys.stderr)
        print(f"pollen: results (partial) in {run_dir}", file=sys.stderr)
        return Outcome(run_dir, False, str(summary.get("error")))
    skipped = summary.get("skipped-rounds") or 0  # absent from older summaries
    print(
        f"pollen: completed {summary['rounds']} rounds"
        + (f" ({skipped} skipped, the model unchanged in them)" if skipped else "")
        + ", final accuracy "
        f"{100 * summary['final-accuracy']:.2f}% (best {100 * summary['best-accuracy']:.2f}%"
        f" at round {summary['best-round']}), {wall_seconds:.1f} s in all "
        + (f"(the ServerApp's time over every part of the run: "
           f"{summary['total-seconds']:.1f} s)" if resumed else
           f"({summary['total-seconds']:.1f} s of them in the ServerApp)")
    )  # fmt: skip
    print(f"pollen: results in {run_dir}")
    return Outcome(run_dir, True)

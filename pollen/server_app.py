"""ServerApp: settings -> composition -> a synchronous or asynchronous loop -> recorder.

The app only assembles: it opens the run directory (or the one a `resume`
continues), loads the data and the model, composes the strategy
(`strategies.compose`), learns who is connected (`strategies.membership`)
and hands them to one of the two loops of `runs.loops`: synchronous rounds
(`strategies.round.play_round`) or FedBuff's versions
(`strategies.asynchronous`). After each round the loop tests the global
model, records the round (`runs.recorder`: history, console, notifications,
so a run that dies keeps every finished round), steps the learning-rate
schedule and, every `checkpoint-every` rounds, saves the model, the server
state and the schedule (`runs.progress`). At the end it writes the model,
the curves and the run's summary.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from .files import write_atomic, write_json
from .flower_waits import shorten_serverapp_pulls
from .network_profile import NetworkProfile
from .protocol import STATE_DIR
from .runs.checkpoints import Checkpoint, load_resumable
from .runs.claim import check_claimed
from .runs.evaluation import GlobalEvaluation
from .runs.interruption import InterruptibleGrid, RunInterrupted, StopSignal
from .runs.loops import Federation, Loop, Records, asynchronous, synchronous
from .runs.lr_schedule import PlateauSchedule
from .runs.notify import Notifier
from .runs.progress import ELAPSED, Progress, ServerParts
from .runs.recorder import RoundRecorder
from .runs.results import (
    RUN_COMPLETED,
    RUN_MARKER,
    ResultsError,
    RoundRecord,
    create_run_dir,
    default_run_name,
    plot_curves,
    privacy_line,
    read_history,
    summarize,
)
from .runs.start import load_data, load_model
from .runs.tracking import NoTracker, Tracker, open_tracker
from .settings import Settings
from .strategies.clock import SimulatedClock
from .strategies.cohort_grid import CohortGrid
from .strategies.compose import build_strategy
from .strategies.membership import Membership
from .strategies.sampling import OneMessagePerNode, reply_clock
from .task import client_state
from .task.inputs import placed_model
from .task.shards import ServerData, shard_fingerprints
from .task.train import pick_device

app = ServerApp()
# The simulation's in-memory Grid looks for replies every `pull_interval` s
# (Flower's default 0.1; a wait each round, two where clients also evaluate
# their personal models); a lookup there is a dict read, so pollen looks
# every 0.01 s. A deployment's is an HTTP request: paced (`reply_clock`).
REPLY_POLL_SECONDS = 0.01


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one federated training job and write its results directory."""
    started = time.monotonic()
    shorten_serverapp_pulls()  # a reply's objects: retried after 0.1 s, not 1 s
    stop = StopSignal()
    stop.install()
    try:
        _run(grid, context, started, stop)
    finally:
        stop.settle()


def _run(grid: Grid, context: Context, started: float, stop: StopSignal) -> None:
    settings = Settings.from_run_config(context.run_config)
    notifier = Notifier.from_settings(settings.notify_url, settings.notify_every)
    run = _open(settings, notifier, started)
    run_dir, run_name, history = run.run_dir, run.name, run.history
    restored = len(history)
    print(f"pollen: results go to {run_dir}", flush=True)
    if notifier.enabled:
        print(f"pollen: notifications go to {notifier.describe()}", flush=True)
    notifier.run_started(
        run_name, settings.strategy, settings.data_set, settings.rounds
    )
    tracker: Tracker = NoTracker()
    recorder: RoundRecorder | None = None
    try:
        tracker = open_tracker(settings, run_dir, run_name, history)
        recorder = RoundRecorder(
            settings, history, run_dir, notifier, run_name, tracker
        )
        _train(grid, run, recorder, stop)
    except BaseException as err:
        status = "interrupted" if stop.asked else "failed"
        summary = summarize(
            history, status, run.elapsed(), _reason(err), settings.run_token,
            _privacy_or_none(recorder),
        )  # fmt: skip
        # a resume that fails before its first round leaves the run as it was
        if len(history) > restored or not (run_dir / "summary.json").exists():
            write_json(run_dir / "summary.json", summary)
        tracker.finish(run_dir, status)
        if isinstance(err, RunInterrupted):  # Flower is exiting already
            notifier.run_interrupted(run_name, len(history))
            notifier.close()
            print(f"pollen: run interrupted after {len(history)} rounds", flush=True)
            return
        _tell_failure(notifier, run_name, err)
        raise
    _completed(run, tracker, recorder.privacy())


def _open(settings: Settings, notifier: Notifier, started: float) -> _OpenRun:
    """The run's directory (or the one a resume continues), the history and
    the seconds it continues from; a directory it cannot open is notified."""
    try:
        run_dir, run_name, checkpoint = _open_run_dir(settings)
    except BaseException as err:  # e.g. a resume its checkpoint refuses
        unopened = settings.run_name or Path(settings.resume).name
        _tell_failure(notifier, unopened or settings.output_dir, err)
        raise
    history: list[RoundRecord] = []
    before = 0.0  # seconds the processes before this one spent reaching its start
    if checkpoint:  # a resumed run starts from the rounds its checkpoint covers
        history = [r for r in read_history(run_dir) if r.round <= checkpoint.round]
        # an older checkpoint lacks the record: its rounds' time, start-up aside
        before = checkpoint.extra.get(ELAPSED, sum(r.seconds for r in history))

    def elapsed() -> float:
        return before + time.monotonic() - started

    return _OpenRun(settings, run_dir, run_name, checkpoint, history, notifier, elapsed)


def _completed(
    run: _OpenRun, tracker: Tracker, privacy: dict[str, object] | None
) -> None:
    """A run that finished every round: its summary (with the privacy spent
    under every accountant, under DP), tracker and notification."""
    history, settings = run.history, run.settings
    write_json(
        run.run_dir / "summary.json",
        summarize(
            history, "completed", run.elapsed(), run_token=settings.run_token,
            privacy=privacy,
        ),
    )  # fmt: skip
    if privacy:
        print(privacy_line(privacy), flush=True)
    tracker.finish(run.run_dir, "completed")
    last = history[-1] if history else None
    run.notifier.run_finished(
        run.name, len(history), last and last.accuracy, last and last.loss,
        last and last.dp_epsilon,
    )  # fmt: skip
    run.notifier.close()
    print(f"{RUN_COMPLETED} {run.run_dir}", flush=True)


def _privacy_or_none(recorder: RoundRecorder | None) -> dict[str, object] | None:
    """The privacy spent, for the summary of a run that failed: never an
    error of its own that would hide the one that ended the run."""
    try:
        return recorder.privacy() if recorder else None
    except Exception as err:
        log(WARNING, "pollen: the privacy spent could not be counted: %s", err)
        return None


def _tell_failure(notifier: Notifier, run_name: str, err: BaseException) -> None:
    notifier.run_failed(run_name, _reason(err))
    notifier.close()


def _open_run_dir(settings: Settings) -> tuple[Path, str, Checkpoint | None]:
    """A new run directory, or with `resume` the existing one it continues and
    the checkpoint it continues from (checked before anything is written);
    either way `settings.json` then holds this run's settings."""
    if settings.resume:
        run_dir = Path(settings.resume).expanduser().resolve()
        if not (run_dir / RUN_MARKER).is_file():
            raise ResultsError(
                f"invalid value for 'resume': {settings.resume!r}; {run_dir} is not "
                f"a pollen run directory (no {RUN_MARKER})"
            )
        check_claimed(run_dir, settings.run_token)
        checkpoint = load_resumable(run_dir, settings.to_run_config())
        # what the run now is: a resume may raise rounds (reports group by it)
        record = {**settings.to_run_config(), "run-name": run_dir.name}
        write_json(run_dir / RUN_MARKER, record)
        return run_dir, run_dir.name, checkpoint
    run_name = settings.run_name or default_run_name(
        settings.strategy, settings.data_set
    )
    if settings.run_token:  # `pollen run` made the directory: it must be ours
        run_dir = Path(settings.output_dir) / run_name
        check_claimed(run_dir, settings.run_token)
    else:
        run_dir = create_run_dir(settings.output_dir, run_name)
    write_json(run_dir / RUN_MARKER, {**settings.to_run_config(), "run-name": run_name})
    client_state.tag_new_run(run_dir)
    return run_dir, run_name, None


def _reason(err: BaseException) -> str:
    """Why the run ended, in one line: the exception, or for Flower's own
    exit (`SystemExit`: it lost its SuperLink, or the run was stopped with
    `flwr stop`) what that means; it read "SystemExit: 0"."""
    if isinstance(err, SystemExit):
        return (
            f"Flower ended the ServerApp's process (exit code {err.code}), as it "
            "does when its SuperLink stops answering or the run is stopped"
        )
    return f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class _OpenRun:
    """A run whose directory is open: its settings, name, the checkpoint it
    resumes from, the history so far and its seconds so far."""

    settings: Settings
    run_dir: Path
    name: str
    checkpoint: Checkpoint | None
    history: list[RoundRecord]
    notifier: Notifier
    elapsed: Callable[[], float]

    @property
    def resumed_round(self) -> int:
        """The round the run continues after (0 for a new run)."""
        return self.checkpoint.round if self.checkpoint else 0


def _train(
    grid: Grid, run: _OpenRun, recorder: RoundRecorder, stop: StopSignal
) -> None:
    """Assemble the run's parts, play its rounds (or versions), save the model."""
    settings, run_dir = run.settings, run.run_dir
    simulation = isinstance(grid, InMemoryGrid)  # no public API tells: see docs
    grid = InterruptibleGrid(grid, stop)  # Ctrl-C stops the next exchange
    data = load_data(settings, run_dir)
    device = pick_device(settings.device)
    model = load_model(settings, data.dataset)
    client_config, state_store = _client_state(run, grid.run.run_id, simulation)
    membership = _membership(grid, settings, data, client_config, simulation)
    strategy, personal = build_strategy(settings, model)
    parts = ServerParts(strategy, personal, PlateauSchedule.from_settings(settings))
    arrays = ArrayRecord({k: v.clone() for k, v in model.state_dict().items()})
    evaluation = GlobalEvaluation(
        settings, data.dataset, placed_model(settings, model, device), device
    )
    if run.checkpoint is not None:
        entries = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        arrays = parts.restore(run.checkpoint, entries, settings.model)
    done = run.resumed_round  # the rounds a resumed run's checkpoint holds
    progress = Progress(done, arrays, client_config, done, parts.state())
    polled = OneMessagePerNode(grid, reply_clock(REPLY_POLL_SECONDS, simulation))
    if settings.client_execution == "cohort":
        polled = CohortGrid(polled)  # one training message per node
    federation = Federation(polled, membership, _clock(settings), simulation)
    records = Records(evaluation, recorder, run_dir, run.elapsed)
    play = asynchronous if settings.mode == "async" else synchronous
    try:
        progress = play(Loop(settings, federation, parts, records), progress)
    finally:  # what clients spilled to free memory no other run reads
        if spilled := state_store.remove_spills(grid.run.run_id):
            log(INFO, client_state.SPILLED_LINE, spilled)
    _save_model(progress.arrays, run_dir)
    title = f"{settings.strategy} on {data.dataset.name}"
    plot_curves(run.history, run_dir / "curves.png", title)


def _client_state(
    run: _OpenRun, run_id: int, simulation: bool
) -> tuple[dict[str, str | int], client_state.ClientStateStore]:
    """The client-state keys every message carries and the store of what
    clients spill; a resumed simulation forgets the state clients wrote
    after its checkpoint (what deployed nodes do when queried)."""
    client_config = client_state.server_config(
        run.run_dir, run.name, run.resumed_round, run.settings.checkpoint_every > 0
    )
    state_store = client_state.ClientStateStore(client_config[STATE_DIR])
    if simulation and run.resumed_round:
        state_store.forget_abandoned(run_id, run.resumed_round)
    return client_config, state_store


def _membership(
    grid: Grid,
    settings: Settings,
    data: ServerData,
    client_config: dict[str, str | int],
    simulation: bool,
) -> Membership:
    """Who is connected, and which client each node serves; logged once."""
    # a simulation's nodes are not queried: no fingerprint to check theirs by
    fingerprints = (
        {} if simulation else shard_fingerprints(settings, range(settings.num_clients))
    )
    membership = Membership(
        grid, settings.num_clients, ConfigRecord(client_config),
        min_available=settings.min_available_nodes, wait=settings.node_wait,
        shards={c: (size, fingerprints.get(c, "")) for c, size in enumerate(data.sizes)},
        simulated=simulation,
    )  # fmt: skip
    roster = membership.refresh()
    log(INFO, "pollen: %d clients on %d nodes", settings.num_clients, roster.num_nodes)
    return membership


def _save_model(arrays: ArrayRecord, run_dir: Path) -> None:
    """The final global model as a torch state dict (model.pt)."""
    buffer = io.BytesIO()
    torch.save(arrays.to_torch_state_dict(), buffer)
    write_atomic(run_dir / "model.pt", buffer.getvalue())


def _clock(settings: Settings) -> SimulatedClock | None:
    """The simulated clock of the run's network profile (None without one)."""
    if not settings.network_profile:
        return None
    profile = NetworkProfile.load(Path(settings.network_profile))
    return SimulatedClock(profile, settings.num_clients)

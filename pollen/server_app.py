"""ServerApp: settings -> data -> model -> strategy -> rounds -> results on disk.

Each round the loop asks `Membership` who can take part, plays the round
(`strategies.round.play_round`: train, check, aggregate, update, personal
evaluation) and gets its outcome back; the global model is then evaluated
on the test split (`runs.evaluation`) and the recorder writes the history,
prints the round, steps the learning rate the next round's config carries
and notifies (`runs.recorder`), so a run that dies keeps every finished
round. Every `checkpoint-every` rounds the global model, the server state
and the scheduler are saved; `resume` continues a run from its latest
checkpoint, in its own directory.
"""

from __future__ import annotations

import copy
import io
import time
from collections.abc import Callable
from dataclasses import replace
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from .files import write_atomic, write_json
from .flower_waits import shorten_serverapp_pulls
from .network_profile import NetworkProfile
from .protocol import LR
from .runs.checkpoints import Checkpoint, load_resumable, save_checkpoint
from .runs.claim import check_claimed
from .runs.evaluation import GlobalEvaluation, check_clients_finite
from .runs.interruption import InterruptibleGrid, RunInterrupted, StopSignal
from .runs.notify import Notifier
from .runs.recorder import RoundRecorder
from .runs.results import (
    RUN_COMPLETED,
    RUN_MARKER,
    ResultsError,
    RoundRecord,
    create_run_dir,
    default_run_name,
    plot_curves,
    plot_label_heatmap,
    read_history,
    summarize,
)
from .runs.tracking import NoTracker, Tracker, open_tracker
from .settings import Settings, SettingsError
from .strategies.asynchronous import BufferedAsync
from .strategies.clock import SimulatedClock
from .strategies.compose import build_strategy
from .strategies.membership import Membership
from .strategies.personal import PersonalEvaluation
from .strategies.round import RoundOutcome, RoundTiming, play_round
from .strategies.sampling import OneMessagePerNode
from .strategies.strategy import Strategy, to_numpy
from .task import client_state
from .task.inputs import settings_model
from .task.lora import FrozenBackboneClassifier
from .task.partition import format_label_counts
from .task.privacy import check_private_model
from .task.shards import ServerData, server_data, shard_fingerprints
from .task.sharing import count_parameters
from .task.train import pick_device

app = ServerApp()
# The simulation's in-memory Grid looks for replies every `pull_interval` s
# (Flower's default 0.1; a wait each round, two where clients also evaluate
# their personal models); a lookup there is a dict read.
REPLY_POLL_SECONDS = 0.01
# A checkpoint's record of the run's seconds so far (ServerApp time, over
# every process that ran it), which a resumed run's total time continues.
ELAPSED = "elapsed-seconds"


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
    restored = len(history)

    def elapsed() -> float:
        return before + time.monotonic() - started

    print(f"pollen: results go to {run_dir}", flush=True)
    if notifier.enabled:
        print(f"pollen: notifications go to {notifier.describe()}", flush=True)
    notifier.run_started(
        run_name, settings.strategy, settings.data_set, settings.rounds
    )
    tracker: Tracker = NoTracker()
    try:
        tracker = open_tracker(settings, run_dir, run_name, history)
        _train(grid, settings, run_dir, history, notifier, run_name, checkpoint,
               elapsed, tracker, stop)  # fmt: skip
    except BaseException as err:
        status = "interrupted" if stop.asked else "failed"
        summary = summarize(
            history, status, elapsed(), _reason(err), settings.run_token
        )
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
    write_json(
        run_dir / "summary.json",
        summarize(history, "completed", elapsed(), run_token=settings.run_token),
    )
    tracker.finish(run_dir, "completed")
    last = history[-1] if history else None
    notifier.run_finished(
        run_name, len(history), last and last.accuracy, last and last.loss,
        last and last.dp_epsilon,
    )  # fmt: skip
    notifier.close()
    print(f"{RUN_COMPLETED} {run_dir}", flush=True)


def _tell_failure(notifier: Notifier, run_name: str, err: BaseException) -> None:
    notifier.run_failed(run_name, _reason(err))
    notifier.close()


def _open_run_dir(settings: Settings) -> tuple[Path, str, Checkpoint | None]:
    """A new run directory, or with `resume` the existing one it continues and
    the checkpoint it continues from (checked before anything is written)."""
    if settings.resume:
        run_dir = Path(settings.resume).expanduser().resolve()
        if not (run_dir / RUN_MARKER).is_file():
            raise ResultsError(
                f"invalid value for 'resume': {settings.resume!r}; {run_dir} is not "
                f"a pollen run directory (no {RUN_MARKER})"
            )
        check_claimed(run_dir, settings.run_token)
        checkpoint = load_resumable(run_dir, settings.to_run_config())
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
    return run_dir, run_name, None


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _train(
    grid: Grid,
    settings: Settings,
    run_dir: Path,
    history: list[RoundRecord],
    notifier: Notifier,
    run_name: str,
    checkpoint: Checkpoint | None,
    elapsed: Callable[[], float],
    tracker: Tracker,
    stop: StopSignal,
) -> None:
    simulation = isinstance(grid, InMemoryGrid)
    grid = InterruptibleGrid(grid, stop)  # Ctrl-C stops the next exchange
    data = server_data(settings)
    dataset = data.dataset
    _describe_data(settings, data, run_dir)
    device = pick_device(settings.device)
    model = settings_model(settings, dataset)
    print(_model_line(settings, model), flush=True)
    if settings.sharing != "all":
        print(
            f"pollen: sharing {settings.sharing} keeps every other trained entry on "
            "the clients; the global model's accuracy below uses their initial "
            "values, the personal-model lines are the ones to read",
            flush=True,
        )
    if settings.dp:
        check_private_model(model, settings.model)
    resume_round = checkpoint.round if checkpoint else 0
    state_config = client_state.server_config(
        run_dir, run_name, resume_round, settings.checkpoint_every > 0
    )
    state_store = client_state.ClientStateStore(state_config[client_state.STATE_DIR])
    run_id = grid.run.run_id
    if simulation and resume_round:  # what nodes do when queried (deployment)
        state_store.forget_abandoned(run_id, resume_round)
    # a simulation's nodes are not queried: no fingerprint to check theirs by
    fingerprints = (
        {} if simulation else shard_fingerprints(settings, range(settings.num_clients))
    )
    membership = Membership(
        grid, settings.num_clients, ConfigRecord(state_config),
        min_available=settings.min_available_nodes, wait=settings.node_wait,
        shards={c: (size, fingerprints.get(c, "")) for c, size in enumerate(data.sizes)},
        simulated=simulation,
    )  # fmt: skip
    roster = membership.refresh()
    log(INFO, "pollen: %d clients on %d nodes", settings.num_clients, roster.num_nodes)
    strategy, personal = build_strategy(settings, model)
    arrays = ArrayRecord({k: v.clone() for k, v in model.state_dict().items()})
    evaluation = GlobalEvaluation(settings, dataset, model.to(device), device)
    recorder = RoundRecorder(settings, history, run_dir, notifier, run_name, tracker)
    first_round = 1
    if checkpoint is not None:
        arrays = _resume(checkpoint, settings, model, strategy, personal, recorder)
        first_round = checkpoint.round + 1
    clock = _clock(settings)
    grid = OneMessagePerNode(grid, REPLY_POLL_SECONDS)

    def train_config() -> ConfigRecord:
        return ConfigRecord({LR: recorder.lr, **state_config})

    checkpointed = first_round - 1  # the newest round a checkpoint holds
    # the server's state after the last finished round, for a checkpoint on
    # Ctrl-C: the next round may have changed it before it was interrupted
    last_state = _server_state(strategy, personal, recorder)

    def finish(server_round: int, outcome: RoundOutcome) -> ArrayRecord:
        """Evaluate, record and (when due) checkpoint one round or version."""
        nonlocal checkpointed, last_state
        check_clients_finite(server_round, outcome.diverged, settings)
        evaluating = time.monotonic()
        loss, accuracy = evaluation(server_round, outcome.arrays)
        if outcome.sim_seconds is not None and settings.mode != "async":
            # a synchronous round waits for the server's own evaluation too
            server_seconds = time.monotonic() - evaluating
            outcome = replace(outcome, sim_seconds=outcome.sim_seconds + server_seconds)
        recorder.record(server_round, outcome, loss, accuracy)
        last_state = _server_state(strategy, personal, recorder)
        if settings.checkpoint_every and (
            server_round % settings.checkpoint_every == 0
            or server_round == settings.rounds
        ):
            _save_checkpoint(settings, run_dir, server_round, outcome.arrays,
                             last_state, elapsed())  # fmt: skip
            checkpointed = server_round
            # clients may now forget their state from before this round
            state_config[client_state.KEEP_FROM] = server_round
        return outcome.arrays

    recorder.start_clock()
    try:
        if settings.mode == "async":
            concurrency = _concurrency(settings)
            engine = BufferedAsync(
                grid, strategy, concurrency=concurrency,
                buffer_size=settings.buffer_size or max(1, concurrency // 2),
                seed=settings.seed, timeout=settings.round_timeout,
                clock=clock if simulation else None,
            )  # fmt: skip
            versions = engine.versions(
                arrays,
                first_round,
                settings.rounds,
                train_config,
                membership.participants,
            )
            for version, outcome in enumerate(versions, first_round):
                personal.record_trained(update.client for update in outcome.updates)
                if version == settings.rounds:  # the last: nothing left in flight
                    drain_started = time.monotonic()
                    unused = engine.drain()
                    recorder.exclude(time.monotonic() - drain_started)
                    outcome = _personal_at_end(
                        grid, personal, version, outcome, unused,
                        ConfigRecord(state_config), membership, settings.round_timeout,
                    )  # fmt: skip
                arrays = finish(version, outcome)
        else:
            timing = RoundTiming(
                settings.round_deadline, clock, simulation and clock is not None
            )
            for server_round in range(first_round, settings.rounds + 1):
                configs = (train_config(), ConfigRecord(state_config))
                outcome = play_round(
                    grid, strategy, personal, server_round, arrays, configs,
                    membership.participants(), settings.round_timeout, timing,
                )  # fmt: skip
                arrays = finish(server_round, outcome)
    except RunInterrupted:  # checkpoint the last finished round, if it can resume
        last = history[-1].round if history else 0
        if last > checkpointed and not settings.dp:  # dp runs cannot resume
            _save_checkpoint(settings, run_dir, last, arrays, last_state, elapsed())
        raise
    finally:  # what clients spilled to free memory no other run reads
        if spilled := state_store.remove_spills(run_id):
            log(INFO, client_state.SPILLED_LINE, spilled)
    buffer = io.BytesIO()
    torch.save(arrays.to_torch_state_dict(), buffer)
    write_atomic(run_dir / "model.pt", buffer.getvalue())
    plot_curves(
        history, run_dir / "curves.png", f"{settings.strategy} on {dataset.name}"
    )


def _describe_data(settings: Settings, data: ServerData, run_dir: Path) -> None:
    """The console's data line and, for an image data set, the clients'
    label counts (labels.png; printed with print-labels)."""
    dataset, counts = data.dataset, data.label_counts
    if counts is None:  # generated: the examples exist only where clients train
        print(
            f"pollen: {dataset.name}: {dataset.source}, {settings.num_clients} "
            f"clients ({settings.partition}), {sum(data.sizes)} training samples, "
            f"{len(dataset.y_test)} test samples of the first clients",
            flush=True,
        )
        return
    print(
        f"pollen: {dataset.name} from {dataset.source}: {len(dataset.y_train)} train / "
        f"{len(dataset.y_test)} test, {settings.num_clients} clients "
        f"({settings.partition}), {int(counts.sum())} training samples used",
        flush=True,
    )
    if settings.print_labels:
        print(format_label_counts(counts), flush=True)
    plot_label_heatmap(
        counts,
        run_dir / "labels.png",
        f"{dataset.name}: {settings.partition} partition",
    )


def _clock(settings: Settings) -> SimulatedClock | None:
    """The simulated clock of the run's network profile (None without one)."""
    if not settings.network_profile:
        return None
    profile = NetworkProfile.load(Path(settings.network_profile))
    return SimulatedClock(profile, settings.num_clients)


def _concurrency(settings: Settings) -> int:
    """Async clients training at once: `concurrency`, or as many as a
    synchronous round samples."""
    return settings.concurrency or settings.sample_size


def _personal_at_end(
    grid: Grid,
    personal: PersonalEvaluation,
    version: int,
    outcome: RoundOutcome,
    unused: list[int],
    config: ConfigRecord,
    membership: Membership,
    timeout: float,
) -> RoundOutcome:
    """The last version's outcome with the clients still in flight when it
    was made (`unused`, drained by now) recorded, and the clients' personal
    models evaluated (async mode asks for personal metrics only at the end:
    a busy node cannot answer)."""
    failures = [f"client {c}: training ended before its reply was used"
                for c in unused]  # fmt: skip
    participants = membership.participants()
    asked = personal.configure(version, outcome.arrays, config, participants)
    if asked is None:
        return replace(outcome, failures=outcome.failures + failures)
    evaluated = personal.aggregate(
        asked, grid.send_and_receive(asked.messages, timeout=timeout)
    )
    return replace(
        outcome,
        failures=outcome.failures + failures + evaluated.failures,
        evaluating=evaluated.clients,
        eval_bytes=evaluated.bytes_down,
        personal=evaluated.results,
    )


def _model_line(settings: Settings, model: torch.nn.Module) -> str:
    counts = count_parameters(model)
    line = (
        f"pollen: model {settings.model}: {counts['total']:,} parameters, "
        f"{counts['trainable']:,} trainable"
    )
    if counts["lora-a"]:
        line += f", LoRA A {counts['lora-a']:,}, LoRA B {counts['lora-b']:,}"
    if isinstance(model, FrozenBackboneClassifier):
        line += f"; backbone weights: {model.source}"
    return line


def _server_state(
    strategy: Strategy, personal: PersonalEvaluation, recorder: RoundRecorder
) -> tuple[dict[str, np.ndarray], dict]:
    """A copy of the server's state beyond the model (strategy, which clients
    trained, the lr scheduler), as a checkpoint of this moment holds it."""
    arrays = {**strategy.state_arrays(), **personal.state_arrays()}
    return (
        {name: np.array(value, copy=True) for name, value in arrays.items()},
        copy.deepcopy(recorder.scheduler.state_dict()),
    )


def _save_checkpoint(
    settings: Settings,
    run_dir: Path,
    server_round: int,
    arrays: ArrayRecord,
    state: tuple[dict[str, np.ndarray], dict],
    elapsed: float,
) -> None:
    strategy_state, scheduler_state = state
    checkpoint = Checkpoint(
        round=server_round,
        model=to_numpy(arrays),
        strategy_state=strategy_state,
        extra={
            "settings": settings.to_run_config(),
            "lr-scheduler": scheduler_state,
            ELAPSED: elapsed,
        },
    )
    path = save_checkpoint(run_dir, checkpoint, settings.checkpoint_keep)
    log(INFO, "pollen: checkpoint of round %d in %s", server_round, path)


def _resume(
    checkpoint: Checkpoint,
    settings: Settings,
    model: torch.nn.Module,
    strategy: Strategy,
    personal: PersonalEvaluation,
    recorder: RoundRecorder,
) -> ArrayRecord:
    """Restore model, server state and scheduler from `checkpoint` (the
    history up to it is read back by `main`, the clients' state by the clients)."""
    if set(checkpoint.model) != set(model.state_dict()):
        raise SettingsError(
            f"resume: the entries of the checkpoint's model are not those of "
            f"model {settings.model!r}"
        )
    strategy.load_state_arrays(checkpoint.strategy_state)
    personal.load_state_arrays(checkpoint.strategy_state)
    recorder.scheduler.load_state_dict(checkpoint.extra["lr-scheduler"])
    print(f"pollen: resuming after round {checkpoint.round}", flush=True)
    return ArrayRecord(
        {k: Array(np.ascontiguousarray(v)) for k, v in checkpoint.model.items()}
    )

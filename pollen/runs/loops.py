"""The server's two loops, synchronous rounds and FedBuff's versions.

Both turn a `Progress` (`runs.progress`) into the next one, round by round:
the synchronous loop plays each round (`strategies.round.play_round`), the
asynchronous one asks FedBuff's loop for each model version
(`strategies.asynchronous.BufferedAsync`). After each the same step follows
(`finish_round`): stop a run whose clients diverged, test the global model
(`runs.evaluation`), record the round with the learning rate it trained
with (`runs.recorder`), step the learning-rate schedule on the test loss
(the next round's rate) and checkpoint when due. A run stopped by Ctrl-C
checkpoints its last finished round first, where it can resume. A run
whose every round was skipped (no reply used) fails, naming the first
client's error, rather than end "completed" at its initial accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from flwr.serverapp import Grid

from ..settings import Settings
from ..strategies.asynchronous import POLL_SECONDS, AsyncOptions, BufferedAsync
from ..strategies.clock import SimulatedClock
from ..strategies.membership import Membership
from ..strategies.replies import error_line
from ..strategies.round import RoundOutcome, RoundTiming, play_round
from ..strategies.sampling import Participants, reply_clock
from ..task import client_state
from .evaluation import GlobalEvaluation, check_clients_finite
from .interruption import RunInterrupted
from .progress import Progress, ServerParts, save_progress
from .recorder import RoundRecorder
from .results import RoundRecord


@dataclass(frozen=True)
class Federation:
    """What the rounds talk to: the grid, who is connected, and the
    simulated clock of a network profile (None without one)."""

    grid: Grid
    membership: Membership
    clock: SimulatedClock | None
    simulation: bool  # Flower's simulation engine runs the clients


@dataclass(frozen=True)
class Records:
    """What follows a round: the global model's test, the recorder, and the
    run directory and clock that checkpoints are written with."""

    evaluation: GlobalEvaluation
    recorder: RoundRecorder
    run_dir: Path
    elapsed: Callable[[], float]  # the run's seconds so far


@dataclass(frozen=True)
class Loop:
    """Everything a loop drives, assembled by the ServerApp."""

    settings: Settings
    federation: Federation
    parts: ServerParts
    records: Records


# One round (or version) played from the progress before it: its outcome.
Play = Callable[[int, Progress], RoundOutcome]


def synchronous(loop: Loop, progress: Progress) -> Progress:
    """Synchronous rounds until `rounds`, each with its deadline and, under
    a network profile, its simulated time."""
    settings, federation = loop.settings, loop.federation
    clock = federation.clock
    timing = RoundTiming(
        settings.round_deadline, clock, federation.simulation and clock is not None
    )

    def play(server_round: int, progress: Progress) -> RoundOutcome:
        configs = (
            progress.train_config(loop.parts.schedule.lr),
            progress.eval_config(loop.parts.schedule.lr),
        )
        participants = federation.membership.participants()
        outcome = play_round(
            federation.grid, loop.parts.strategy, loop.parts.personal,
            server_round, progress.arrays, configs,
            participants, settings.round_timeout, timing,
        )  # fmt: skip
        return with_unreachable(outcome, participants)

    return _drive(loop, progress, play)


def asynchronous(loop: Loop, progress: Progress) -> Progress:
    """FedBuff's model versions until `rounds`; at the last, the clients
    still in flight are waited for and their personal models evaluated."""
    federation, personal = loop.federation, loop.parts.personal
    engine = BufferedAsync(
        federation.grid,
        loop.parts.strategy,
        AsyncOptions.from_settings(loop.settings),
        first=progress.round + 1,
        clock=federation.clock,
        poll=reply_clock(POLL_SECONDS, federation.simulation),
        simulated=federation.simulation,
    )

    made_at = 0.0  # when the engine made its last version (0: none yet)

    def play(version: int, progress: Progress) -> RoundOutcome:
        nonlocal made_at
        server_seconds = time.monotonic() - made_at if made_at else 0.0
        participants = federation.membership.participants()
        outcome = engine.next_version(
            progress.arrays,
            version,
            progress.train_config(loop.parts.schedule.lr),
            participants,
            server_seconds,  # its evaluation, records and checkpoint since
        )
        outcome = with_unreachable(outcome, participants)
        made_at = time.monotonic()
        personal.record_trained(update.client for update in outcome.updates)
        if version < loop.settings.rounds:
            return outcome
        drain_started = time.monotonic()  # the last: nothing left in flight
        unused = engine.drain()
        loop.records.recorder.exclude(time.monotonic() - drain_started)
        return _last_version(loop, outcome, unused, progress)

    return _drive(loop, progress, play)


def with_unreachable(outcome: RoundOutcome, participants: Participants) -> RoundOutcome:
    """`outcome` with a failure for each connected node that did not answer
    (its clients were not sampled), first."""
    if not participants.unreachable:
        return outcome
    return replace(outcome, failures=[*participants.unreachable, *outcome.failures])


def _last_version(
    loop: Loop, outcome: RoundOutcome, unused: list[int], progress: Progress
) -> RoundOutcome:
    """The last version's outcome with the clients still in flight when it
    was made (`unused`, drained by now) recorded, and the clients' personal
    models evaluated (async mode asks for personal metrics only at the end:
    a busy node cannot answer)."""
    federation = loop.federation
    failures = [f"client {c}: training ended before its reply was used"
                for c in unused]  # fmt: skip
    evaluated = loop.parts.personal.run(
        federation.grid, loop.settings.rounds, outcome.arrays,
        progress.eval_config(loop.parts.schedule.lr),
        federation.membership.participants(),
        loop.settings.round_timeout, final=True,
    )  # fmt: skip
    return replace(
        outcome,
        failures=outcome.failures + failures + evaluated.failures,
        evaluating=evaluated.clients,
        eval_bytes=evaluated.bytes_down,
        personal=evaluated.results,
    )


def _drive(loop: Loop, progress: Progress, play: Play) -> Progress:
    """Play and finish each round after `progress` until `rounds`; on
    Ctrl-C, checkpoint the last finished round (where the run can resume)."""
    loop.records.recorder.start_clock()
    try:
        for server_round in range(progress.round + 1, loop.settings.rounds + 1):
            outcome = play(server_round, progress)
            progress = finish_round(loop, server_round, outcome, progress)
    except RunInterrupted:
        if progress.round > progress.checkpointed and not loop.settings.dp:
            # dp runs cannot resume
            save_progress(
                loop.settings, loop.records.run_dir, progress, loop.records.elapsed()
            )
        raise
    check_trained(loop.records.recorder.history)
    return progress


class NothingTrained(RuntimeError):
    """Every round of a run was skipped: the model is as it started."""


def check_trained(history: Sequence[RoundRecord]) -> None:
    """Refuse to call a run complete in which no round (or version) used a
    reply: every one failed or was rejected. `NothingTrained` names the
    first failure, the cause to fix (a run whose every client fails would
    otherwise end "completed" at its initial accuracy)."""
    if not history or not all(record.skipped for record in history):
        return
    first = next((f for record in history for f in record.failures), None)
    raise NothingTrained(
        f"no round used a reply: all {len(history)} rounds were skipped and the "
        "model is as it started; the first failure: "
        + (error_line(first) if first else "none recorded (too few replies)")
    )


def finish_round(
    loop: Loop, server_round: int, outcome: RoundOutcome, progress: Progress
) -> Progress:
    """Evaluate, record, step the learning rate and (when due) checkpoint
    one round or version: the progress after it."""
    settings, records, schedule = loop.settings, loop.records, loop.parts.schedule
    check_clients_finite(server_round, outcome.diverged, settings)
    evaluating = time.monotonic()
    loss, accuracy = records.evaluation(server_round, outcome.arrays)
    if outcome.sim_seconds is not None and settings.mode != "async":
        # a synchronous round waits for the server's own evaluation too
        server_seconds = time.monotonic() - evaluating
        outcome = replace(outcome, sim_seconds=outcome.sim_seconds + server_seconds)
    records.recorder.record(server_round, outcome, loss, accuracy, schedule.lr)
    if settings.shares_model:  # else the model, so its loss, never changes
        schedule.step(loss)
    progress = replace(
        progress,
        round=server_round,
        arrays=outcome.arrays,
        state=loop.parts.state(),
    )
    every = settings.checkpoint_every
    if not every or (server_round % every and server_round != settings.rounds):
        return progress
    save_progress(settings, records.run_dir, progress, records.elapsed())
    # clients may now forget their state from before this round
    client_config = {**progress.client_config, client_state.KEEP_FROM: server_round}
    return replace(progress, checkpointed=server_round, client_config=client_config)

"""After each round: record it, print it, notify.

The recorder turns a round's outcome, the global model's test numbers and
the learning rate the round trained with (the server loop's schedule steps
it, `runs.lr_schedule`) into a history row (`results.RoundRecord`), rewrites
the history (a run that dies keeps every finished round), prints the round's
console lines, sends a notification when one is due, and hands the row to
the run's tracker (`pollen.runs.tracking`: TensorBoard or MLflow, when
asked for). Under DP-SGD it keeps each client's reported epsilon and records
the largest: the privacy the federation has spent so far; at the end,
`privacy` gives that client's releases (and central DP's) under every
accountant, for the summary. A run that stays
at chance accuracy while its test loss rises is warned once, with the
likely cause (before anything is non-finite, which stops the run).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from ..common.accountants import epsilons
from ..extensions import data_set_info
from ..protocol import DP_EPSILON, DP_NOISE_MULTIPLIER, DP_SAMPLE_RATE, DP_STEPS
from ..settings import Settings
from ..strategies.round import RoundOutcome
from .evaluation import divergence_hint
from .notify import Notifier
from .results import RoundRecord, round_lines, seconds_left, write_history
from .tracking import NoTracker, Tracker

# Rounds of a rising test loss at chance accuracy before a run is warned
STALL_ROUNDS = 3
CHANCE_MARGIN = 1.5  # "at chance": accuracy at most this many times 1 / classes


def stalled_at_chance(history: Sequence[RoundRecord], classes: int) -> bool:
    """Whether the last `STALL_ROUNDS` rounds stayed at chance accuracy while
    the test loss rose in each of them: a run on its way to diverging (or a
    learning rate too high to learn), though nothing is non-finite yet."""
    if len(history) <= STALL_ROUNDS:
        return False
    last = history[-STALL_ROUNDS - 1 :]
    rising = all(a.loss < b.loss for a, b in itertools.pairwise(last))
    return rising and all(r.accuracy <= CHANCE_MARGIN / classes for r in last[1:])


class RoundRecorder:
    """History, console, tracking and notifications of one run."""

    def __init__(
        self,
        settings: Settings,
        history: list[RoundRecord],
        run_dir: Path,
        notifier: Notifier,
        run_name: str,
        tracker: Tracker | None = None,
    ) -> None:
        self.settings = settings
        self.history = history
        self.run_dir = run_dir
        self.notifier = notifier
        self.run_name = run_name
        self.dp_epsilon: dict[int, float] = {}
        # each DP-SGD client's last report: noise multiplier, sample rate, steps
        self.dp_releases: dict[int, tuple[float, float, int]] = {}
        self._last = time.monotonic()
        self._warned_stall = False
        self.tracker = tracker or NoTracker()

    def start_clock(self) -> None:
        """Round times count from here (after set-up and any resume)."""
        self._last = time.monotonic()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` out of the current round's time: waiting for
        clients whose updates are not used (the end of an async run)."""
        self._last += seconds

    def record(
        self,
        server_round: int,
        outcome: RoundOutcome,
        loss: float,
        accuracy: float,
        lr: float,
    ) -> RoundRecord:
        """Write, print and notify round `server_round`, trained with `lr`."""
        now = time.monotonic()
        record = RoundRecord(
            round=server_round,
            accuracy=accuracy,
            loss=loss,
            lr=lr,
            seconds=round(now - self._last, 4),
            bytes_up=outcome.bytes_up,
            bytes_down=outcome.bytes_down,
            clients=outcome.clients,
            failures=outcome.failures,
            clipped=outcome.clipped,
            skipped=outcome.skipped,
            eval_bytes=outcome.eval_bytes,
            personal=outcome.personal,
            dp_epsilon=self._privacy_spent(outcome),
            sim_seconds=outcome.sim_seconds,
            late=outcome.late,
            staleness=outcome.staleness,
            attackers=sorted(set(outcome.clients) & self.settings.attacking_clients),
            unselected=outcome.unselected,
            aggregation=outcome.aggregation,
        )
        self._last = now
        self.history.append(record)
        write_history(self.run_dir, self.history)
        left = seconds_left(self.history, self.settings.rounds)
        print(round_lines(record, self.settings.rounds, left), flush=True)
        self.tracker.round(record)
        self._warn_if_stalled()
        self.notifier.round_finished(
            self.run_name, server_round, self.settings.rounds, record.accuracy,
            record.loss, record.dp_epsilon,
        )  # fmt: skip
        return record

    def _warn_if_stalled(self) -> None:
        """Once per run: accuracy at chance while the test loss keeps rising.
        Not where clients keep entries of their own: the server then tests a
        model whose local entries are still initial, which may sit at chance
        in a healthy run."""
        classes = data_set_info(self.settings.data_set).classes
        if (
            self._warned_stall
            or self.settings.keeps_own_model  # the server's model lacks their part
            or not stalled_at_chance(self.history, classes)
        ):
            return
        self._warned_stall = True
        print(
            f"pollen: warning: accuracy has stayed at chance ({100 / classes:.0f}% "
            f"for {classes} classes) while the test loss rose for {STALL_ROUNDS} "
            f"rounds; likely cause: {divergence_hint(self.settings)}",
            flush=True,
        )

    def _privacy_spent(self, outcome: RoundOutcome) -> float | None:
        """The largest epsilon any client has reported so far (None without
        DP): a skipped round's replies count too, their clients trained."""
        for update in outcome.updates:
            epsilon = update.metrics.get(DP_EPSILON)
            if isinstance(epsilon, float):
                spent = self.dp_epsilon.get(update.client, 0.0)
                self.dp_epsilon[update.client] = max(spent, epsilon)
                releases = [update.metrics.get(k) for k in _RELEASE_METRICS]
                if all(isinstance(v, int | float) for v in releases):
                    z, q, steps = releases
                    self.dp_releases[update.client] = (z, q, int(steps))
        return max(self.dp_epsilon.values()) if self.dp_epsilon else None

    def privacy(self) -> dict[str, object] | None:
        """The privacy spent, under every accountant (`summary.json`'s
        `privacy`; None without DP): DP-SGD's for the client that spent
        most, central DP's for every release so far. Each accountant takes
        up to a few seconds here, once a run."""
        settings = self.settings
        spent: dict[str, object] = {}
        if self.dp_releases:
            client = max(self.dp_releases, key=lambda c: self.dp_epsilon[c])
            z, q, steps = self.dp_releases[client]
            spent["example-level"] = {
                "client": client, "noise-multiplier": z, "sample-rate": q,
                "steps": steps, "epsilon": epsilons(
                    noise_multiplier=z, sample_rate=q, steps=steps,
                    delta=settings.dp_delta, counting=settings.accountant,
                ),
            }  # fmt: skip
        central = next(
            (r.aggregation for r in reversed(self.history)
             if "releases" in r.aggregation),
            None,
        )  # fmt: skip
        if central:
            z, releases = central["noise-multiplier"], int(central["releases"])
            spent["user-level"] = {
                "noise-multiplier": z, "releases": releases, "epsilon": epsilons(
                    noise_multiplier=z, sample_rate=1.0, steps=releases,
                    delta=settings.dp_delta, counting=settings.accountant,
                ),
            }  # fmt: skip
        if not spent:
            return None
        return {"accountant": settings.accountant, "delta": settings.dp_delta, **spent}


_RELEASE_METRICS = (DP_NOISE_MULTIPLIER, DP_SAMPLE_RATE, DP_STEPS)

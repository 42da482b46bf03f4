"""Async (FedBuff) mode evaluates personal models once, at the end
(docs/network.md), whatever `personal-eval-every` divides: with 3 and
rounds=10 they were never evaluated, and summary.json's final-personal was
null."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from pollen.runs.loops import _last_version
from pollen.strategies.personal import PersonalEvaluation
from pollen.strategies.round import RoundOutcome
from pollen.strategies.sampling import Participants, Roster
from tests.test_round import EchoGrid, LocalBias

pytestmark = pytest.mark.usefixtures("task_identity")
ROSTER = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)


def test_async_run_evaluates_personal_models_at_the_end_whatever_every_is():
    personal = PersonalEvaluation(LocalBias(), every=3)
    personal.record_trained([0, 1])
    arrays = ArrayRecord(
        {"w": Array(np.zeros(2, np.float32)), "b": Array(np.ones(1, np.float32))}
    )
    grid = EchoGrid()
    membership = SimpleNamespace(participants=lambda: Participants(ROSTER))
    loop = SimpleNamespace(
        federation=SimpleNamespace(grid=grid, membership=membership),
        settings=SimpleNamespace(rounds=10, round_timeout=10.0),
        parts=SimpleNamespace(personal=personal, schedule=SimpleNamespace(lr=0.01)),
    )
    progress = SimpleNamespace(eval_config=lambda lr: ConfigRecord())
    outcome = RoundOutcome(
        arrays=arrays,
        clients=[0, 1],
        updates=[],
        bytes_down=0,
        bytes_up=0,
        skipped=False,
        failures=[],
        clipped=[],
        evaluating=[],
        eval_bytes=0,
        personal={},
    )
    last = _last_version(loop, outcome, [], progress)
    assert last.evaluating == [0, 1]
    assert set(last.personal) == {0, 1}

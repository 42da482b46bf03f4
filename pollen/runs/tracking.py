"""Experiment tracking: each round's numbers, also where researchers look.

`tracker` names where a run's rounds go besides its own files: `none`,
`tensorboard` (`runs.tracking_tensorboard`) or `mlflow`
(`runs.tracking_mlflow`). A tracker is opened with the rounds a resumed run
restored from its checkpoint (so a tracker switched on at a resume starts
complete), gets every round as it is recorded, and is finished with the
run's status once its files are written. Both trackers are optional extras:
nothing is imported unless it is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..settings import Settings
from .results import RoundRecord


class Tracker(Protocol):
    """Where a run's rounds go besides its own files."""

    def round(self, record: RoundRecord) -> None: ...

    def finish(self, run_dir: Path, status: str) -> None:
        """The run ended with `status` (completed, failed, interrupted); its
        files in `run_dir` are written."""


class NoTracker:
    """`tracker = "none"`: nothing beyond the run's own files."""

    def round(self, record: RoundRecord) -> None:
        return None

    def finish(self, run_dir: Path, status: str) -> None:
        return None


def open_tracker(
    settings: Settings, run_dir: Path, run_name: str, restored: Sequence[RoundRecord]
) -> Tracker:
    """The tracker `settings.tracker` names, holding the `restored` rounds."""
    if settings.tracker == "tensorboard":
        from .tracking_tensorboard import TensorBoardTracker

        return TensorBoardTracker(settings, run_dir, restored)
    if settings.tracker == "mlflow":
        from .tracking_mlflow import MlflowTracker

        return MlflowTracker(settings, run_dir, run_name, restored)
    return NoTracker()

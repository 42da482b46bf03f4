"""`tracker = "tensorboard"`: TensorBoard event files in the run directory.

`<run>/tensorboard/` holds the settings once as a text table, then one
scalar series per quantity of `results.round_scalars` with the round as the
step; `tensorboard --logdir results/` shows every run side by side. A
resumed run writes on from its checkpoint's round: the events of the rounds
it replays are purged first, and a run that starts tracking at its resume
writes the restored rounds first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..settings import Settings
from .results import RoundRecord, round_scalars

TENSORBOARD_DIR = "tensorboard"


class TensorBoardTracker:
    """Event files in `<run>/tensorboard/`, one scalar series per quantity."""

    def __init__(
        self, settings: Settings, run_dir: Path, restored: Sequence[RoundRecord]
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise RuntimeError(
                "tracker='tensorboard' needs the tensorboard package: "
                "pip install 'pollen-fl[tensorboard]'"
            ) from err
        log_dir = run_dir / TENSORBOARD_DIR
        new = not log_dir.exists()
        first_round = restored[-1].round + 1 if restored else 1
        self.writer = SummaryWriter(str(log_dir), purge_step=first_round)
        if new:
            rows = "\n".join(
                f"| {key} | {value} |"
                for key, value in settings.to_run_config().items()
            )
            self.writer.add_text("settings", "| key | value |\n|---|---|\n" + rows)
            for record in restored:
                self.round(record)

    def round(self, record: RoundRecord) -> None:
        for name, value in round_scalars(record).items():
            self.writer.add_scalar(name, value, record.round)
        self.writer.flush()  # a run that fails keeps its rounds

    def finish(self, run_dir: Path, status: str) -> None:
        self.writer.close()

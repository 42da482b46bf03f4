"""Experiment tracking: each round's numbers, also where researchers look.

`tracker = "tensorboard"` writes TensorBoard event files into the run
directory's `tensorboard/` (`tensorboard --logdir results/` shows every run
side by side): the settings once as text, then per round, with the round as
the step, the global model's accuracy and loss, the learning rate, the
round's seconds (and simulated seconds under a network profile), MB up and
down, the clients asked and the replies dropped, the clients' mean accuracy
on their own shards where they evaluated their own models, and the DP
epsilon spent. A resumed run writes on from its checkpoint's round: the
events of the rounds it replays are purged first. Off by default; the
`tensorboard` extra installs what it needs, and nothing is imported unless
it is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..settings import Settings
from .results import RoundRecord

TENSORBOARD_DIR = "tensorboard"
MB = 1e6


class Tracker(Protocol):
    """Where a run's rounds go besides its own files."""

    def round(self, record: RoundRecord) -> None: ...

    def close(self) -> None: ...


class NoTracker:
    """`tracker = "none"`: nothing beyond the run's own files."""

    def round(self, record: RoundRecord) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardTracker:
    """Event files in `<run>/tensorboard/`, one scalar series per quantity."""

    def __init__(self, settings: Settings, run_dir: Path, first_round: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise RuntimeError(
                "tracker='tensorboard' needs the tensorboard package: "
                "pip install 'pollen-fl[tensorboard]'"
            ) from err
        self.writer = SummaryWriter(
            str(run_dir / TENSORBOARD_DIR), purge_step=first_round
        )
        if first_round == 1:
            rows = "\n".join(
                f"| {key} | {value} |"
                for key, value in settings.to_run_config().items()
            )
            self.writer.add_text("settings", "| key | value |\n|---|---|\n" + rows)

    def round(self, record: RoundRecord) -> None:
        step = record.round
        scalars = {
            "accuracy": record.accuracy,
            "loss": record.loss,
            "lr": record.lr,
            "seconds": record.seconds,
            "mb-up": record.bytes_up / MB,
            "mb-down": record.bytes_down / MB,
            "clients": len(record.clients),
            "failures": len(record.failures),
            "sim-seconds": record.sim_seconds,
            "dp-epsilon": record.dp_epsilon,
        }
        own = record.personal_stats("local")
        if own is not None:
            scalars["personal-own-accuracy"] = own[0]
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tracker(settings: Settings, run_dir: Path, first_round: int) -> Tracker:
    """The tracker `settings.tracker` names, writing from `first_round` on."""
    if settings.tracker == "tensorboard":
        return TensorBoardTracker(settings, run_dir, first_round)
    return NoTracker()

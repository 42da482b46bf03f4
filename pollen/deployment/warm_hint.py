"""What a warm ClientApp child tells its parent: which app it ran and for
which run, so the parent can preload that app's modules and data once.

The contract between the app (the FAB's copy of this module, imported fresh
in the child) and the executor (the installed copy) is one environment
variable naming a file and the JSON written there; a hint that does not
parse is ignored, never trusted: it only decides what is preloaded, and a
preloaded module is used only where it is the file the task imports anyway
(`pollen.deployment.module_stash`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import write_json

if TYPE_CHECKING:
    from flwr.app import Context, Message

HINT_FILE_ENV = "POLLEN_WARM_HINT_FILE"


@dataclass(frozen=True)
class WarmHint:
    """The app directory (the installed FAB) a task ran, its context, and
    the seconds the app's handler took (the task's own work)."""

    app_dir: str
    run_config: dict[str, Any]
    node_config: dict[str, Any]
    seconds: float = float("nan")

    @classmethod
    def read(cls, path: Path) -> WarmHint | None:
        """The hint in `path`; None where there is none or it is malformed."""
        try:
            raw = json.loads(path.read_text())
            hint = cls(raw["app_dir"], raw["run_config"], raw["node_config"],
                       float(raw.get("seconds", "nan")))  # fmt: skip
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not (
            isinstance(hint.app_dir, str)
            and isinstance(hint.run_config, dict)
            and isinstance(hint.node_config, dict)
        ):
            return None
        return hint

    @property
    def key(self) -> str:
        """Equal for hints that warm the same modules and data."""
        return json.dumps([self.app_dir, self.run_config, self.node_config],
                          sort_keys=True)  # fmt: skip


def report(app_dir: Path, run_config: dict, node_config: dict, seconds: float) -> None:
    """Write the hint for the app in `app_dir` (the directory its
    pyproject.toml is in) where a warm executor asked for one; else nothing."""
    path = os.environ.get(HINT_FILE_ENV)
    if not path:
        return
    hint = {
        "app_dir": str(app_dir),
        "run_config": dict(run_config),
        "node_config": dict(node_config),
        "seconds": seconds,
    }
    write_json(Path(path), hint)


def hint_mod(app_dir: Path) -> Callable:
    """A ClientApp mod that reports each message's hint after handling it."""

    def mod(
        msg: Message, context: Context, call_next: Callable[..., Message]
    ) -> Message:
        started = time.perf_counter()
        reply = call_next(msg, context)
        seconds = time.perf_counter() - started
        report(app_dir, context.run_config, context.node_config, seconds)
        return reply

    return mod

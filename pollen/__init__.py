"""pollen: composable federated learning on Flower.

From Python, `pollen.run` runs one federation and returns its `Run`,
`pollen.compare` runs a grid and `pollen.report` reports a folder of runs,
both returning a `Comparison` (`pollen.api`). The names are loaded on first
use, so the Flower apps and the command, which import pollen's modules, do
not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import (
        Comparison,
        Interrupted,
        Run,
        RunFailed,
        SettingsError,
        compare,
        report,
        run,
    )

__all__ = [
    "Comparison", "Interrupted", "Run", "RunFailed", "SettingsError", "compare",
    "report", "run",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pollen' has no attribute {name!r}")

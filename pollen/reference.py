"""The configuration reference, rendered from the settings declaration.

Every run-config key is declared once, in `pollen.settings.Settings`: its
default, help text and allowed values. This module turns that declaration
(and the `flwr run .` defaults in pyproject.toml) into the Markdown table of
docs/configuration.md, so the page is never written by hand and cannot drift
from the code: `pollen.pages` writes `render()` into the page
(`python -m pollen.pages --write`), and tests/test_docs.py compares them.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

from .settings import Settings

Value = bool | int | float | str

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def app_defaults(pyproject: Path = PYPROJECT) -> dict[str, Value]:
    """The `[tool.flwr.app.config]` defaults of a Flower App (what `flwr run .`
    gives a key no override sets); empty when there is no such file."""
    if not pyproject.is_file():
        return {}
    document = tomllib.loads(pyproject.read_text())
    return dict(
        document.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    )


def _value(value: Value | None) -> str:
    """A default as it is written in a run config (TOML), in code format."""
    if value is None:
        return ""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    else:
        text = repr(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    """Plain text made safe inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")


def render(defaults: Mapping[str, Value] | None = None) -> str:
    """The reference: one Markdown table row per run-config key, in declaration
    order. `defaults` are the `flwr run .` defaults (see `app_defaults`)."""
    defaults = app_defaults() if defaults is None else defaults
    lines = [
        "| key | `flwr run .` default | `Settings` default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for key, default, help_text, allowed in Settings.describe():
        lines.append(
            f"| `{key}` | {_value(defaults.get(key))} | {_value(default)} "
            f"| {_cell(allowed)} | {_cell(help_text)} |"
        )
    return "\n".join(lines) + "\n"

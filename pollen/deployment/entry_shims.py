"""Executables that stand in for Flower's entry points on the PATH of the
Flower processes pollen starts (`flower.flower_env`).

A SuperLink or SuperNode starts its SuperExec, and a SuperExec its
simulation, by command name (`flower-superexec`, `flwr-simulation`): an
executable of that name first on their PATH runs pollen's version of the
entry point (Flower's own, with a guarded change: `flower_superexec`,
`flower_simulation`) with this Python. Where pollen cannot be imported (the
process runs with another PYTHONPATH) the shim runs Flower's entry point
unchanged: a SuperLink whose SuperExec died at its start would wait for it
for ever.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def write_entry_shim(directory: Path, command: str, module: str, flower: str) -> Path:
    """An executable `command` in `directory` that runs `module`'s `main`
    with this Python, or Flower's entry point `flower` ("module:function")
    where `module` cannot be imported; written once, replaced atomically
    when it differs."""
    flower_module, _, flower_main = flower.partition(":")
    text = (
        f"#!{sys.executable}\ntry:\n    from {module} import main\n"
        "except ImportError:\n"
        f"    from {flower_module} import {flower_main} as main\n"
        "main()\n"
    )
    shim = directory / command
    if shim.is_file() and shim.read_text() == text:
        return shim
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{command}.{os.getpid()}"
    partial.write_text(text)
    partial.chmod(0o755)
    partial.replace(shim)
    return shim

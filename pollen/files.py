"""Files written whole or not at all.

A reader (another process, a resumed run, `pollen report`) never sees half a
file: every result, record and cache is written to a temporary file in the
same folder and renamed over its target, which POSIX makes atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _current_umask() -> int:
    """The process's umask (read once, at import, before any thread starts)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def write_atomic(path: Path, data: bytes | str, private: bool = False) -> None:
    """Write via a temporary file in the same folder and an atomic rename.

    The file gets the permissions a plainly created one would (0666 less the
    umask: results a container writes stay readable on the host), or 0600
    when `private`."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600 if private else 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")

"""Files written whole or not at all, and arrays read without pickle.

A reader (another process, a resumed run, `pollen report`) never sees half a
file: every result, record and cache is written to a temporary file in the
same folder and renamed over its target, which POSIX makes atomic. Arrays
(checkpoints, client state, partition caches, data files) are `.npz`
archives read with `allow_pickle=False`: unpickling a file could run code.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, unquote

import numpy as np


def _current_umask() -> int:
    """The process's umask (read once, at import, before any thread starts)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def readable_folder_problem(path: Path, key: str) -> str | None:
    """What keeps `path` from being a folder to read from (named as the
    setting `key`), or None; cheap, for checks before anything heavy."""
    try:
        if path.exists() and not path.is_dir():
            return f"{key} {str(path)!r} is a file; {key} must be a folder"
        readable = not path.is_dir() or os.access(path, os.R_OK | os.X_OK)
    except PermissionError:
        readable = False
    if readable:
        return None
    return f"cannot read {path}: permission denied; {key} must be a folder this user can read"


def made_folder_problem(path: Path) -> str | None:
    """Make folder `path` (and its parents) if it is not there; why it
    cannot be (a file in the way, no permission), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return str(err)
    return None


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


def sync_folder(folder: Path) -> None:
    """Flush `folder`'s files and then its entries to the disk: what a rename
    of it (or in it) must follow before anything older is deleted, so that
    a power loss leaves the old copy or the whole new one."""
    for path in folder.iterdir():
        if path.is_file():
            _fsync(path, os.O_RDONLY)
    _fsync(folder, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


class NpzError(ValueError):
    """A file that is not a pickle-free .npz; the message says what it is."""


def write_npz(target: Path | BinaryIO, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed npz like `np.savez`'s, with percent-encoded member names,
    into a file path or an open binary file.

    Written by hand rather than with `np.savez(path, **arrays)`, whose keyword
    arguments would clash with names such as "file" or "allow_pickle".
    """
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            member = quote(name, safe="") + ".npy"
            with archive.open(member, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the .npz at `path` (names percent-decoded, as
    `write_npz` encodes them), without unpickling anything.

    `FileNotFoundError` where there is no file; `NpzError` for a single .npy
    array, an array of pickled objects, or a truncated or corrupted file.
    """
    try:
        with path.open("rb") as f:
            loaded = np.load(f, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise NpzError(f"{path} is a single .npy array, not an .npz")
            with loaded as npz:
                return {unquote(name): _plain(npz, name, path) for name in npz.files}
    except (FileNotFoundError, NpzError):
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise NpzError(
            f"cannot read {path}: truncated or not a .npz, or its data is "
            f"corrupted ({err})"
        ) from err


def _plain(npz: np.lib.npyio.NpzFile, name: str, path: Path) -> np.ndarray:
    """One array of an open .npz; an object array is refused, not unpickled,
    and so is a member that is no .npy array (numpy hands its raw bytes)."""
    try:
        value = npz[name]
    except ValueError as err:
        if "allow_pickle" not in str(err):
            raise
        raise NpzError(
            f"cannot read {path}: {name} holds pickled Python objects ({err}); "
            "unpickling could run code, so only plain arrays are read"
        ) from err
    if not isinstance(value, np.ndarray):
        raise NpzError(f"cannot read {path}: its member {name!r} is not an array")
    return value

"""The app folder that `flwr run` packs into a FAB, without the virtual environment.

Flower builds a run's FAB (the app's code and config, sent to the SuperLink)
by listing every file under the app folder and only then filtering them by
`.gitignore` and its include patterns. With the project's `.venv` inside the
folder (uv's default) that listing visits ~50,000 files: 7.5 s of every run's
start-up on a 2-core machine. `staged_app` copies the files a FAB can hold,
found by a walk that never enters hidden folders, virtual environments,
`__pycache__` or folders the app's `.gitignore` ignores, into a temporary
folder, and `flwr run` packs that one instead. Flower still applies its own
rules to the copy, so the FAB holds the same files as one built in place,
except the project's documentation and benchmarks (`UNRUN_FOLDERS`): no
ServerApp or ClientApp reads them, and they were 0.6 of the 1.67 MB that
the SuperLink and every SuperNode receive at a run's start, over the
shaped links of `pollen compare --network` too. (Flower's own
`fab-exclude` would do this in pyproject.toml, but Flower refuses a pattern
that matches no file, so the Docker image's `/app`, which holds neither
folder, could no longer be run.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pathspec

# What Flower's FAB can hold (flwr.common.constant.FAB_INCLUDE_PATTERNS), and
# the .gitignore it reads to leave files out.
FAB_SUFFIXES = frozenset({".py", ".toml", ".md", ".yaml", ".yml", ".json", ".jsonl"})
FAB_NAMES = frozenset({"LICENSE", ".gitignore"})
# Top-level folders of the project that a run never reads.
UNRUN_FOLDERS = frozenset({"docs", "benchmarks"})


def fab_files(app: Path) -> list[Path]:
    """The files under `app` that a FAB may contain, relative to `app`."""
    ignore_file = app / ".gitignore"
    ignored = pathspec.GitIgnoreSpec.from_lines(
        ignore_file.read_text().splitlines() if ignore_file.is_file() else []
    )
    found: list[Path] = []
    for folder, subfolders, names in os.walk(app):
        here = Path(folder).relative_to(app)
        subfolders[:] = [
            name
            for name in subfolders
            if not name.startswith(".")
            and name != "__pycache__"
            and not (Path(folder) / name / "pyvenv.cfg").exists()
            and not ignored.match_file(f"{(here / name).as_posix()}/")
            and not (here == Path(".") and name in UNRUN_FOLDERS)
        ]
        for name in names:
            path = Path(folder) / name
            if (
                (path.suffix in FAB_SUFFIXES or name in FAB_NAMES)
                and not path.is_symlink()
                and not ignored.match_file((here / name).as_posix())
            ):
                found.append(here / name)
    return found


@contextmanager
def staged_app(app: Path) -> Iterator[Path]:
    """A temporary copy of `app`'s FAB files, removed on exit."""
    stage = Path(tempfile.mkdtemp(prefix="pollen-app-"))
    try:
        for relative in fab_files(app):
            (stage / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(app / relative, stage / relative)
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)

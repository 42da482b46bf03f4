"""The staged app folder packs into the same FAB as the app folder itself."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from pollen.deployment.fab import UNRUN_FOLDERS, fab_files, staged_app

PROJECT = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str = "x = 1\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fab_contents(app: Path) -> dict[str, bytes]:
    """Every file of the FAB built from `app`, except Flower's build metadata."""
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as fab:
        return {
            name: fab.read(name)
            for name in fab.namelist()
            if not name.startswith(".info")
        }


def _make_app(root: Path) -> None:
    root.mkdir()
    (root / "pyproject.toml").write_text((PROJECT / "pyproject.toml").read_text())
    _write(root / ".gitignore", "results/\n*.log\nsecret.py\n")
    _write(root / "pollen" / "__init__.py", "")
    _write(root / "pollen" / "task" / "models.py")
    _write(root / "configs" / "a.toml", "seed = 1\n")
    _write(root / "README.md", "# app\n")
    _write(root / "LICENSE", "Apache-2.0\n")
    _write(root / "secret.py")  # ignored by .gitignore
    _write(root / "results" / "run" / "history.json", "[]")  # ignored folder
    _write(root / "run.log")  # not a FAB file type and ignored
    _write(root / "data" / "mnist.npz", "binary")  # not a FAB file type
    _write(root / ".venv" / "pyvenv.cfg", "home = /usr\n")  # hidden venv
    _write(root / ".venv" / "lib" / "site.py")
    _write(root / "env" / "pyvenv.cfg", "home = /usr\n")  # venv under any name
    _write(root / "env" / "lib" / "site.py")
    _write(root / "pollen" / "__pycache__" / "models.json", "{}")
    _write(root / "docs" / "index.md", "# docs\n")  # no run reads them
    _write(root / "benchmarks" / "speed.py")
    _write(root / "pollen" / "docs" / "notes.md", "kept: not top-level\n")


def test_staged_app_packs_the_same_fab(tmp_path: Path) -> None:
    app = tmp_path / "app"
    _make_app(app)
    with staged_app(app) as staged:
        staged_fab = _fab_contents(staged)
    in_place = _fab_contents(app)
    assert {"docs/index.md", "benchmarks/speed.py"} <= set(in_place)
    assert staged_fab == {
        k: v for k, v in in_place.items() if not k.startswith(("docs/", "benchmarks/"))
    }
    assert {"pollen/task/models.py", "pollen/docs/notes.md", "configs/a.toml"} <= set(
        staged_fab
    )
    assert not staged.exists()  # removed on exit


def test_fab_files_never_enter_environments_or_ignored_folders(tmp_path: Path) -> None:
    app = tmp_path / "app"
    _make_app(app)
    listed = {path.as_posix() for path in fab_files(app)}
    assert listed == {
        ".gitignore", "LICENSE", "README.md", "pyproject.toml", "configs/a.toml",
        "pollen/__init__.py", "pollen/task/models.py", "pollen/docs/notes.md",
    }  # fmt: skip


def test_project_fab_is_unchanged_by_staging_but_for_docs_and_benchmarks() -> None:
    """This project, with its .venv inside: the same FAB either way, less
    the folders no run reads."""
    with staged_app(PROJECT) as staged:
        staged_fab = _fab_contents(staged)
    in_place = _fab_contents(PROJECT)
    unrun = {name for name in in_place if name.split("/")[0] in UNRUN_FOLDERS}
    assert "docs/index.md" in unrun and "benchmarks/cohort.py" in unrun
    assert staged_fab == {k: v for k, v in in_place.items() if k not in unrun}
    assert (
        "pollen/client_app.py" in staged_fab
        and "configs/mnist-fedavg.toml" in staged_fab
    )


def _uv() -> str:
    """The uv that `make` installs into .tools/ (or one on PATH)."""
    local = PROJECT / ".tools" / "bin" / "uv"
    found = str(local) if local.is_file() else shutil.which("uv")
    if found is None:
        pytest.skip("no uv: `make run` or `make test` installs it into .tools/")
    return found


def test_the_wheel_and_the_fab_build_from_a_clean_checkout(tmp_path: Path) -> None:
    """`uv build --wheel` and `flwr build` in a fresh clone: the wheel is the
    distribution `pollen-fl` (`pollen` on the package index is another
    project) holding the `pollen` package and command; the FAB is the app."""
    if not (PROJECT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT), str(clone)], check=True)
    env = {**os.environ, "UV_SYSTEM_CERTS": "1"}
    subprocess.run(
        [_uv(), "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(clone)],
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith("pollen_fl-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        scripts = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = archive.read(scripts).decode()
    assert "Name: pollen-fl" in metadata and "pollen/cli.py" in names
    assert "pollen = pollen.cli:main" in entry_points
    subprocess.run(
        [str(Path(sys.executable).parent / "flwr"), "build", "--app", str(clone)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (fab,) = tmp_path.glob("*.fab")
    assert fab.name.startswith("pollen.pollen-fl.")
    with zipfile.ZipFile(fab) as bundle:
        assert "pollen/server_app.py" in bundle.namelist()

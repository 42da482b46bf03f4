"""A warm ClientApp task uses its FAB where it is already installed.

Flower's `flwr-clientapp` installs the run's FAB at the start of every task
(`flwr.cli.install.install_from_fab`): it unzips the whole FAB into a
temporary folder, checks every file's hash against the FAB's manifest,
reads its `pyproject.toml`, and only then finds the app already installed
in `<FLWR_HOME>/apps/<publisher>.<name>.<version>.<hash[:8]>` and returns
that folder. For pollen's FAB (about 200 files) that took 0.1 to 0.35 s of
a warm task's 0.7 to 1.1 s on a two-node deployment here, every round
(docs/lab-notes/deployment.md).

`reuse_installed_fabs` changes, in this process and the children it forks
(the warm executor's), only the `install_from_fab` that Flower's ClientApp
runtime (`flwr.supernode.runtime.run_clientapp`) calls: it reads the FAB's
`pyproject.toml` alone from the zip, names the folder Flower would return,
and returns it when it holds every file of the FAB at its size (a folder
another task is still copying into is not complete). Anything else (a new
FAB, an incomplete folder, a FAB it cannot read) goes to Flower's own
installation, which checks and installs as before. Flower trusts an
installed folder the same way: it never checks one again.

The upstream change it stands for: in `validate_and_install`'s caller,
return an existing install folder before extracting. A patch of
`pollen.flower_patches`, guarded by version: any other Flower installs as it
ships, with one warning line.
"""

from __future__ import annotations

import hashlib
import io
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..flower_patches import INSTALLED_FABS, guard

MANIFEST_DIR = ".info/"  # the FAB's manifest, removed before installing


def installed_folder(fab: bytes, apps: Path) -> Path | None:
    """The complete folder under `apps` that Flower installed `fab` into,
    or None (not installed, incomplete, or a FAB this cannot read)."""
    from flwr.common.config import get_metadata_from_config
    from flwr.common.constant import FAB_HASH_TRUNCATION

    fab_hash = hashlib.sha256(fab).hexdigest()
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            config = tomllib.loads(archive.read("pyproject.toml").decode())
        fab_id, version = get_metadata_from_config(config)
    except (
        zipfile.BadZipFile,
        KeyError,
        TypeError,
        UnicodeDecodeError,
        tomllib.TOMLDecodeError,
    ):
        return None
    publisher, _, name = fab_id.partition("/")
    folder = apps / f"{publisher}.{name}.{version}.{fab_hash[:FAB_HASH_TRUNCATION]}"
    for member in members:
        if member.filename.startswith(MANIFEST_DIR):
            continue
        try:
            if (folder / member.filename).stat().st_size != member.file_size:
                return None
        except OSError:
            return None
    return folder


def install_once(install: Callable[..., Path]) -> Callable[..., Path]:
    """`install` (Flower's `install_from_fab`), returning the installed
    folder without unzipping when the FAB is installed already."""

    def install_from_fab(
        fab_file: Path | bytes,
        install_dir: Path | None = None,
        skip_prompt: bool = False,
    ) -> Path:
        if isinstance(fab_file, bytes) and install_dir is None and skip_prompt:
            from flwr.common.constant import APP_DIR
            from flwr.supercore.utils import get_flwr_home

            folder = installed_folder(fab_file, get_flwr_home() / APP_DIR)
            if folder is not None:
                return folder
        return install(fab_file, install_dir, skip_prompt)

    return install_from_fab


def reuse_installed_fabs() -> bool:
    """In this process (and the children it forks), a ClientApp task uses
    its FAB's installed folder; False (and one warning line) when this
    Flower is not one the change was tested with."""
    if not guard(INSTALLED_FABS):
        return False
    from flwr.supernode.runtime import run_clientapp as runtime

    runtime.install_from_fab = install_once(runtime.install_from_fab)
    return True

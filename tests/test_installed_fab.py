"""A warm ClientApp task uses its FAB's installed folder
(`pollen.deployment.installed_fab`): the folder Flower's own installation
returns, and only when it is complete."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.cli import install as flower
from flwr.cli.build import build_fab_from_disk

from pollen.deployment import installed_fab
from pollen.deployment.fab import staged_app
from tests.conftest import PROJECT


@pytest.fixture(scope="module")
def fab() -> bytes:
    """pollen's own FAB, as `pollen run` sends it."""
    with staged_app(PROJECT) as app:
        return build_fab_from_disk(app)


def test_the_folder_is_the_one_flowers_installation_returns(fab, tmp_path):
    folder = flower.install_from_fab(fab, tmp_path, skip_prompt=True)
    assert installed_fab.installed_folder(fab, tmp_path / "apps") == folder
    # Flower returns the same folder for the FAB installed already
    assert flower.install_from_fab(fab, tmp_path, skip_prompt=True) == folder


def test_a_missing_or_incomplete_folder_is_not_used(fab, tmp_path):
    apps = tmp_path / "apps"
    assert installed_fab.installed_folder(fab, apps) is None
    folder = flower.install_from_fab(fab, tmp_path, skip_prompt=True)
    module = folder / "pollen" / "cli.py"
    text = module.read_bytes()
    module.write_bytes(text[: len(text) // 2])  # still being copied
    assert installed_fab.installed_folder(fab, apps) is None
    module.unlink()
    assert installed_fab.installed_folder(fab, apps) is None
    module.write_bytes(text)
    assert installed_fab.installed_folder(fab, apps) == folder


def test_another_or_unreadable_fab_is_not_found(fab, tmp_path):
    flower.install_from_fab(fab, tmp_path, skip_prompt=True)
    apps = tmp_path / "apps"
    other = fab[:-1] + bytes([fab[-1] ^ 1])  # another hash, same files
    assert installed_fab.installed_folder(other, apps) is None
    assert installed_fab.installed_folder(b"not a zip", apps) is None


def test_flowers_installation_runs_only_for_a_fab_not_installed(
    fab, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    calls: list[Path | None] = []

    def flower_install(fab_file, install_dir=None, skip_prompt=False):
        calls.append(install_dir)
        return flower.install_from_fab(fab_file, install_dir, skip_prompt)

    install = installed_fab.install_once(flower_install)
    first = install(fab, skip_prompt=True)  # not installed: Flower installs it
    assert install(fab, skip_prompt=True) == first  # installed: used as it is
    assert calls == [None]
    install(fab, tmp_path / "elsewhere", skip_prompt=True)  # not the runtime's call
    assert calls == [None, tmp_path / "elsewhere"]
    assert first.parent == tmp_path / "home" / "apps"

"""`pollen list` and `pollen config`: generated from the catalogue and the
settings declaration, so every name declared there is listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen import cli, listing
from pollen.catalog import AGGREGATORS, DATA_SETS, LOCAL_OBJECTIVES, MODELS, PRESETS
from pollen.settings import Settings
from tests.user_package import on_path, write_distribution


def test_every_declared_name_is_listed() -> None:
    text = listing.listing()
    for names in (PRESETS, AGGREGATORS, LOCAL_OBJECTIVES, MODELS, DATA_SETS):
        for name in names:
            assert f"  {name} " in text or f"  {name}\n" in text, name
    assert "ditto-lambda=0.1" in text and "head-epochs=2" in text  # preset settings


def test_keys_section_lists_every_key_with_its_default() -> None:
    lines = listing.listing("keys").splitlines()[1:]
    assert [line.split()[0] for line in lines] == [k for k, *_ in Settings.describe()]


def test_config_describes_a_key_and_suggests_for_a_typo(capsys) -> None:
    assert cli.main(["config", "trim-fraction"]) == 0
    out = capsys.readouterr().out
    assert "type: float" in out and "default: 0.2" in out and "[0, 0.5)" in out
    assert cli.main(["config", "trim-fraktion"]) == cli.EXIT_BAD_INPUT
    assert "did you mean trim-fraction" in capsys.readouterr().err


@pytest.mark.parametrize("section", list(listing.SECTIONS))
def test_each_section_prints(section: str, capsys) -> None:
    assert cli.main(["list", section]) == 0
    assert capsys.readouterr().out.startswith(f"{section}:\n")


def test_a_preset_shows_the_client_settings_its_parts_assume() -> None:
    scaffold = next(
        line for line in listing.strategies().splitlines() if "scaffold " in line
    )
    assert scaffold.endswith("local-objective=scaffold; auto momentum=0")
    assert "auto momentum" not in listing.strategies().splitlines()[0]  # fedavg
    assert (
        "auto, by part (before the data set's): scaffold 0, scaffold-sam 0"
        in listing.describe_key("momentum")
    )


def test_a_default_is_the_one_a_run_gets_and_the_declared_one_where_it_differs() -> (
    None
):
    """pollen's pyproject.toml gives client-frac 0.5 (the quick run), the
    declaration 0.25 (what an app that does not set it gets)."""
    from pollen.reference import app_defaults

    assert app_defaults()["client-frac"] == 0.5
    assert "  default: 0.5 (an app whose pyproject.toml does not set it: 0.25)" in (
        listing.describe_key("client-frac").splitlines()
    )
    assert "  default: 10" in listing.describe_key("rounds").splitlines()
    assert (
        "  client-frac               0.5 (an app whose pyproject.toml does not set it: "
        "0.25): fraction of clients sampled per round"
    ) in listing.listing("keys")


def test_a_name_two_packages_register_is_listed_as_ambiguous_naming_both(
    tmp_path: Path, capsys
) -> None:
    """`pollen list` showed the one last on the path; it names both now, and
    lists on: a clash the user does not use must not stop the listing."""
    for package in ("alphaparts", "betaparts"):
        write_distribution(
            tmp_path,
            package,
            f"[pollen.models]\ntwin = {package}.nets:twin\nmlp = {package}.nets:mlp\n",
        )
    with on_path(tmp_path):
        assert cli.main(["list", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines].count("mlp") == 2  # and the built-in
    assert lines[-3].split(None, 1) == [
        "mlp",
        "ambiguous: alphaparts.nets:mlp by alphaparts, betaparts.nets:mlp by "
        "betaparts (installed packages'; not used: the built-in of this name wins)",
    ]
    assert lines[-2].split(None, 1) == [
        "twin",
        "ambiguous: alphaparts.nets:twin by alphaparts, betaparts.nets:twin by "
        "betaparts (installed packages'; refused by name: give an import path)",
    ]

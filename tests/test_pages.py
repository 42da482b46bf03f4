"""The generated pages (`pollen.pages`): a measured table's file is checked
field by field, rendered as its section of the results page and as its
row of the README, and the CLI reference is every command's `--help`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pollen import pages
from pollen.cli import build_parser

TABLE = {
    "title": "NIID-Bench: Fashion-MNIST, two classes per client",
    "kind": "accuracy",
    "setting": "10 clients, 50 rounds.",
    "columns": ["strategy", "final accuracy"],
    "rows": [["FedAvg", "73.8 ± 5.3 %"], ["FedProx", "75.4 ± 2.6 %"]],
    "machine": "a 2-core VM",
    "date": "2026-11-28",
    "command": "pollen compare configs/grids/niid-bench-fmnist.toml",
    "notes": ["Published: 78.1 %."],
    "readme": ["NIID-Bench", "FedProx 75.4 %"],
}


def write(folder: Path, name: str, table: dict) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(table))
    return path


def test_a_measured_table_renders_as_its_section_and_its_readme_row(
    tmp_path: Path,
) -> None:
    write(tmp_path, "accuracy-niid", TABLE)
    write(tmp_path, "speed-x", {**TABLE, "kind": "speed", "title": "Rounds",
                                "readme": None, "notes": []})  # fmt: skip
    tables = pages.measured(tmp_path)
    assert [t.name for t in tables] == ["accuracy-niid", "speed-x"]
    assert pages.render_results(tables) == "\n".join([
        "## Accuracy", "",
        "### NIID-Bench: Fashion-MNIST, two classes per client", "",
        "10 clients, 50 rounds.", "",
        "| strategy | final accuracy |", "| --- | --- |",
        "| FedAvg | 73.8 ± 5.3 % |", "| FedProx | 75.4 ± 2.6 % |", "",
        "Measured on a 2-core VM, 2026-11-28: "
        "`pollen compare configs/grids/niid-bench-fmnist.toml`", "",
        "- Published: 78.1 %.", "",
        "## Speed", "", "### Rounds", "", "10 clients, 50 rounds.", "",
        "| strategy | final accuracy |", "| --- | --- |",
        "| FedAvg | 73.8 ± 5.3 % |", "| FedProx | 75.4 ± 2.6 % |", "",
        "Measured on a 2-core VM, 2026-11-28: "
        "`pollen compare configs/grids/niid-bench-fmnist.toml`", "",
    ])  # fmt: skip
    assert pages.render_readme_table(tables).splitlines() == [
        "| what | result |",
        "|---|---|",
        "| [NIID-Bench](docs/results.md#niid-bench-fashion-mnist-two-classes-per-client)"
        " | FedProx 75.4 % |",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kind": "latency"},
            "kind 'latency'; allowed: ['accuracy', 'privacy', 'speed']",
        ),
        ({"date": "28 Nov 2026"}, "allowed: YYYY-MM-DD"),
        ({"rows": [["FedAvg"]]}, "row 1 has 1 cells, the columns 2"),
        ({"rows": []}, "rows must be a non-empty list"),
        ({"setting": "two\nlines"}, "setting must be one line"),
        ({"rows": [["a|b", "c"]]}, "holds '|'"),
        ({"title": "FedAvg / FedProx"}, "a different anchor on GitHub and on the site"),
        ({"title": "The _mixed_ network"}, "no Markdown"),
        ({"title": "See [FedAvg](algorithms.md)"}, "no Markdown"),
        ({"title": "Speed"}, "is a heading of the page itself"),
        ({"readme": ["only what"]}, "readme must be [what, result]"),
        ({"source": "x"}, "unknown keys ['source']"),
        ({"order": "1"}, "order '1'; allowed: an integer"),
    ],
)
def test_a_bad_table_file_is_refused_naming_what_is_wrong(
    tmp_path: Path, change: dict, message: str
) -> None:
    path = write(tmp_path, "bad", {**TABLE, **change})
    with pytest.raises(pages.PageError, match=re.escape(message)) as caught:
        pages.Measured.read(path)
    assert str(path) in str(caught.value)


def test_tables_come_by_kind_then_their_order_then_their_file_name(
    tmp_path: Path,
) -> None:
    for name, keys in [
        ("speed-a", {"kind": "speed", "order": 1}),
        ("accuracy-z", {}),  # no order: after those with one
        ("accuracy-y", {}),
        ("accuracy-b", {"order": 5}),
    ]:
        write(tmp_path, name, {**TABLE, **keys, "title": name})  # fmt: skip
    assert [t.name for t in pages.measured(tmp_path)] == [
        "accuracy-b", "accuracy-y", "accuracy-z", "speed-a"
    ]  # fmt: skip


def test_two_tables_with_one_title_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "accuracy-a", TABLE)
    write(tmp_path, "accuracy-b", {**TABLE, "title": TABLE["title"].upper()})
    with pytest.raises(pages.PageError, match=r"\['accuracy-a', 'accuracy-b'\]"):
        pages.measured(tmp_path)


def test_a_missing_key_and_broken_json_are_named(tmp_path: Path) -> None:
    table = {k: v for k, v in TABLE.items() if k != "command"}
    with pytest.raises(pages.PageError, match=r"missing keys \['command'\]"):
        pages.Measured.read(write(tmp_path, "a", table))
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(pages.PageError, match="not readable as JSON"):
        pages.Measured.read(tmp_path / "b.json")


def test_the_cli_reference_holds_every_command_and_its_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = pages.render_cli()
    headings = re.findall(r"^## `(.*)`$", page, re.M)
    assert headings[:3] == ["pollen", "pollen run", "pollen deploy"]
    assert {"pollen deploy up", "pollen warm down", "pollen compare"} <= set(headings)
    assert len(headings) == len(set(headings))  # an alias is not listed twice
    (run_help,) = re.findall(r"## `pollen run`\n\n```text\n(.*?)```", page, re.S)
    for action in build_parser()._subparsers._group_actions[0].choices["run"]._actions:
        assert all(flag in run_help for flag in action.option_strings)
    monkeypatch.setenv("COLUMNS", "40")  # the page is the same in any terminal
    assert pages.render_cli() == page


def test_a_generated_part_replaces_only_what_is_below_its_marker() -> None:
    page = f"# Title\n\nIntro.\n\n{pages.MARKER}\n\nold table\n"
    assert pages.with_generated_part(page, "new\n") == (
        f"# Title\n\nIntro.\n\n{pages.MARKER}\n\nnew\n"
    )
    with pytest.raises(pages.PageError, match="has no line"):
        pages.with_generated_part("# Title\n", "new")
    readme = f"a\n{pages.README_START}\nold\n{pages.README_END}\nb\n"
    assert pages.with_readme_table(readme, "| t |") == (
        f"a\n{pages.README_START}\n| t |\n{pages.README_END}\nb\n"
    )

"""Network profiles: the presets load and say where their numbers come from,
groups choose the nodes they promise, and every bad field fails on load with
one line naming the file, the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen.common.links import LinkShape
from pollen.network_profile import (
    PRESETS_DIR,
    NetworkProfile,
    NodeProfile,
    ProfileError,
    resolve,
)
from pollen.settings import Settings, SettingsError
from tests.conftest import PROJECT

PRESETS = sorted((PROJECT / PRESETS_DIR).glob("*.toml"))
DEFAULT = """
[default]
delay-ms = 10
jitter-ms = 1
up-mbit = 100
down-mbit = 100
loss-pct = 0
slowdown = 1
"""


def _preset(name: str) -> NetworkProfile:
    return NetworkProfile.load(PROJECT / PRESETS_DIR / f"{name}.toml")


def _write(tmp_path: Path, text: str, name: str = "profile.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> str:
    """The one-line message loading `text` fails with."""
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        NetworkProfile.load(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


def test_the_required_presets_exist() -> None:
    names = {path.stem for path in PRESETS}
    assert {"datacenter", "home-broadband", "mobile-4g", "mixed"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_and_cites_its_source(path: Path) -> None:
    profile = NetworkProfile.load(path)
    assert profile.name == path.stem
    assert profile.description.strip()
    assert profile.source.strip()
    assert len(profile.nodes(8)) == 8


def test_datacenter_nodes_are_all_equal_and_fast() -> None:
    nodes = _preset("datacenter").nodes(8)
    assert len(set(nodes)) == 1
    link = nodes[0].link
    assert link.delay_ms < 1 and link.up_mbit >= 1000 and link.down_mbit >= 1000
    assert nodes[0].slowdown == 1


def test_mixed_on_eight_nodes_has_two_slow_nodes_last() -> None:
    nodes = _preset("mixed").nodes(8)
    slow = [i for i, node in enumerate(nodes) if node.slowdown > 1]
    assert slow == [6, 7]
    assert all(nodes[i].slowdown == 10 for i in slow)
    fast, straggler = nodes[0], nodes[7]
    assert fast.slowdown == 1
    assert straggler.link.up_mbit < fast.link.up_mbit
    assert straggler.link.down_mbit < fast.link.down_mbit
    assert straggler.link.delay_ms > fast.link.delay_ms


def test_mixed_matches_the_presets_it_is_made_of() -> None:
    """The fast nodes are home-broadband's, the slow ones mobile-4g's links."""
    mixed = _preset("mixed").nodes(4)
    assert mixed[0] == _preset("home-broadband").nodes(1)[0]
    assert mixed[3].link == _preset("mobile-4g").nodes(1)[0].link


def test_a_fraction_takes_the_last_nodes_and_at_least_one(tmp_path: Path) -> None:
    path = _write(tmp_path, DEFAULT + "[[group]]\nfraction = 0.25\nslowdown = 3\n")
    profile = NetworkProfile.load(path)

    def slow(num_nodes: int) -> list[int]:
        return [i for i, p in enumerate(profile.nodes(num_nodes)) if p.slowdown == 3]

    assert slow(8) == [6, 7]
    assert slow(2) == [1]  # round(0.5) is 0: at least one
    assert slow(1) == [0]
    assert slow(10) == [8, 9]  # round(2.5) is 2 (half to even)


def test_a_group_by_nodes_and_keys_it_leaves_out(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        DEFAULT + '[[group]]\nname = "far"\nnodes = [0, 3, 9]\ndelay-ms = 80\n',
    )
    profile = NetworkProfile.load(path)
    nodes = profile.nodes(4)  # index 9 is beyond this federation: ignored
    far = NodeProfile(LinkShape(80, 1, 100, 100, 0), 1.0)
    near = NodeProfile(LinkShape(10, 1, 100, 100, 0), 1.0)
    assert nodes == [far, near, near, far]
    assert profile.groups[0].name == "far"


def test_a_later_group_wins(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        DEFAULT
        + "[[group]]\nnodes = [1, 2]\nslowdown = 2\n"
        + "[[group]]\nnodes = [2, 3]\nslowdown = 5\n",
    )
    slowdowns = [p.slowdown for p in NetworkProfile.load(path).nodes(4)]
    assert slowdowns == [1, 2, 5, 5]


def test_an_empty_profile_is_unshaped(tmp_path: Path) -> None:
    profile = NetworkProfile.load(_write(tmp_path, ""))
    assert profile.nodes(2) == [NodeProfile(), NodeProfile()]


def test_as_dict_records_every_node() -> None:
    profile = _preset("mixed")
    record = profile.as_dict(4)
    assert record["name"] == "mixed"
    assert record["source"] == profile.source
    assert [n["slowdown"] for n in record["nodes"]] == [1, 1, 1, 10]
    assert record["nodes"][0]["link"] == str(profile.default.link)


# a profile's text -> what its one-line error says
BAD = [
    ('speed = "fast"\n', "unknown key 'speed'; allowed: description"),
    (
        "[default]\ndelay = 10\n",
        "[default]: unknown key 'delay'; allowed: delay-ms",
    ),
    (
        DEFAULT + "[[group]]\nnodes = [0]\nrate = 3\n",
        "group 1: unknown key 'rate'; allowed: name",
    ),
    ('[default]\ndelay-ms = "10ms"\n', "delay-ms must be a number, got '10ms'"),
    ("[default]\nup-mbit = true\n", "up-mbit must be a number, got True"),
    ("[default]\ndown-mbit = -1\n", "down-mbit must be a finite number >= 0"),
    (
        "[default]\ndelay-ms = nan\n",
        "delay-ms must be a finite number >= 0, got nan",
    ),
    ("[default]\nup-mbit = inf\n", "up-mbit must be a finite number >= 0, got inf"),
    ("[default]\nslowdown = 0.5\n", "slowdown must be >= 1"),
    (
        "[default]\ndelay-ms = 1\njitter-ms = 2\n",
        "jitter-ms must be at most delay-ms",
    ),
    ("[default]\nloss-pct = 100\n", "loss-pct must be below 100"),
    (DEFAULT + "[[group]]\nfraction = 0\n", "group 1: fraction must be in (0, 1]"),
    (
        DEFAULT + "[[group]]\nfraction = 1.5\n",
        "fraction must be in (0, 1], got 1.5",
    ),
    (DEFAULT + '[[group]]\nfraction = "1/4"\n', "fraction must be a number"),
    (DEFAULT + "[[group]]\nslowdown = 2\n", "give exactly one of fraction"),
    (
        DEFAULT + "[[group]]\nfraction = 0.5\nnodes = [1]\n",
        "give exactly one of fraction",
    ),
    (DEFAULT + "[[group]]\nnodes = []\n", "nodes must be a non-empty list"),
    (DEFAULT + "[[group]]\nnodes = [-1]\n", "nodes must be a non-empty list"),
    (DEFAULT + "[[group]]\nnodes = [1.5]\n", "node indices >= 0, got [1.5]"),
    (DEFAULT + "[[group]]\nnodes = [true]\n", "node indices >= 0, got [True]"),
    (DEFAULT + "[[group]]\nnodes = 3\n", "nodes must be a non-empty list"),
    (DEFAULT + "[[group]]\nnodes = [0]\nname = 7\n", "name must be a string"),
    ("description = 3\n", "description must be a string, got 3"),
    ("source = false\n", "source must be a string, got False"),
    ("default = 3\n", "[default] must be a table"),
    ("[group]\nnodes = [0]\n", "group must be an array of tables ([[group]])"),
    (
        DEFAULT + "[[group]]\nnodes = [0]\n[[group]]\nfraction = 2\n",
        "group 2: fraction",
    ),
    ("[default\ndelay-ms = 1\n", "is not TOML"),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[e for _, e in BAD])
def test_a_bad_field_fails_on_load_naming_it(
    tmp_path: Path, text: str, expected: str
) -> None:
    message = _error(tmp_path, text)
    assert expected in message, message


def test_a_group_error_names_the_key_it_inherited(tmp_path: Path) -> None:
    """A group's jitter is checked against its own delay, default or not."""
    message = _error(tmp_path, DEFAULT + "[[group]]\nnodes = [0]\ndelay-ms = 0.5\n")
    assert "group 1: jitter-ms must be at most delay-ms (0.5), got 1.0" in message


def test_a_missing_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.toml"
    with pytest.raises(ProfileError, match="cannot read network profile") as info:
        NetworkProfile.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_resolve_a_preset_name_and_a_path(tmp_path: Path) -> None:
    assert resolve("mixed", PROJECT) == (PROJECT / PRESETS_DIR / "mixed.toml").resolve()
    path = _write(tmp_path, DEFAULT, "mine.toml")
    assert resolve(str(path), PROJECT) == path.resolve()
    with pytest.raises(ProfileError, match="no such file"):
        resolve(str(path.with_suffix("")), PROJECT)  # a path, never a preset


def test_resolve_an_unknown_name_lists_the_presets() -> None:
    with pytest.raises(ProfileError) as info:
        resolve("dial-up", PROJECT)
    message = str(info.value)
    assert "'dial-up'" in message and "not a file and not a preset" in message
    for path in PRESETS:
        assert path.stem in message


def test_resolve_a_missing_toml_path(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such file"):
        resolve(str(tmp_path / "absent.toml"), PROJECT)


def test_settings_reject_a_bad_profile_with_its_message(tmp_path: Path) -> None:
    path = _write(tmp_path, "[default]\nslowdown = 0.5\n")
    with pytest.raises(SettingsError) as info:
        Settings.from_run_config({"network-profile": str(path)})
    message = str(info.value)
    assert message.startswith("network-profile: ")
    assert str(path) in message and "slowdown must be >= 1" in message


def test_settings_accept_a_preset_file() -> None:
    path = PROJECT / PRESETS_DIR / "mixed.toml"
    settings = Settings.from_run_config({"network-profile": str(path)})
    assert settings.network_profile == str(path)


def test_the_docs_table_gives_every_preset_s_numbers() -> None:
    """docs/network.md's preset table stays true to configs/networks/."""
    page = (PROJECT / "docs" / "network.md").read_text()
    presets = page.split("### Presets", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[list[float]]] = {}
    for line in presets.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("`") and cells[2][0].isdigit():
            values = [float(cell) for cell in cells[2:]]
            rows.setdefault(cells[0].strip("`"), []).append(values)
    assert set(rows) == {path.stem for path in PRESETS}
    for name, documented in rows.items():
        profile = _preset(name)
        nodes = [profile.default, *(group.profile for group in profile.groups)]
        actual = [
            [n.link.delay_ms, n.link.jitter_ms, n.link.up_mbit, n.link.down_mbit,
             n.link.loss_pct, n.slowdown]
            for n in nodes
        ]  # fmt: skip
        assert documented == actual, name


HUGE = "1" + "0" * 400  # a TOML integer tomllib accepts but no float can hold


# --- an integer no float can hold (an OverflowError traceback) ---------------


@pytest.mark.parametrize(
    "text",
    [
        f"[default]\nup-mbit = {HUGE}\n",
        f"[default]\ndelay-ms = -{HUGE}\n",
        f"[default]\nslowdown = {HUGE}\n",
        f"message-overhead = {HUGE}\n",
        f"[[group]]\nfraction = {HUGE}\n",
    ],
    ids=["up-mbit", "negative-delay", "slowdown", "message-overhead", "fraction"],
)
def test_a_huge_integer_is_a_one_line_profile_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "big.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        NetworkProfile.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_settings_refuse_a_huge_integer_with_a_settings_error(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text(f"[default]\nup-mbit = {HUGE}\n")
    with pytest.raises(SettingsError, match=r"network-profile: .*up-mbit"):
        Settings.from_run_config({"network-profile": str(path)})


# --- a recorded link keeps every digit (it kept 6 significant ones) ----------


def test_as_dict_records_a_link_without_losing_digits() -> None:
    profile = NetworkProfile.from_document(
        {"default": {"delay-ms": 1234567, "up-mbit": 18.4123456, "down-mbit": 69.4}},
        "precise",
    )
    recorded = profile.as_dict(1)["nodes"][0]["link"]
    assert LinkShape.parse(recorded) == profile.default.link, recorded


# --- a group's name is recorded ------------------------------------------------


def test_as_dict_records_which_group_each_node_is_in() -> None:
    """docs/network.md: `name` is "a group's name in messages and records"
    (it was in neither)."""
    profile = NetworkProfile.from_document(
        {"group": [{"name": "slow", "fraction": 0.5, "slowdown": 2}]}, "p"
    )
    assert [n["group"] for n in profile.as_dict(4)["nodes"]] == [
        None,
        None,
        "slow",
        "slow",
    ]


# --- the error states the key's own range (it said >= 0 for both) ------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[default]\nslowdown = -1\n", "slowdown must be >= 1"),
        ("[default]\n[[group]]\nfraction = -0.5\n", "fraction must be in (0, 1]"),
        ("[default]\n[[group]]\nfraction = nan\n", "fraction must be in (0, 1]"),
    ],
    ids=["slowdown", "fraction", "fraction-nan"],
)
def test_the_error_states_what_is_allowed(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        NetworkProfile.load(path)
    assert expected in str(info.value), str(info.value)


# --- fraction x N rounds half to even as written, not after a float error ----


def test_a_half_rounds_to_even_as_documented() -> None:
    """0.35 x 90 = 31.5, which rounds (half to even) to 32 nodes; the float
    product 31.499999999999996 rounds to 31."""
    profile = NetworkProfile.from_document(
        {"group": [{"fraction": 0.35, "slowdown": 2}]}, "p"
    )
    slow = [i for i, node in enumerate(profile.nodes(90)) if node.slowdown == 2]
    assert len(slow) == 32 and slow[0] == 58, (len(slow), slow[0])

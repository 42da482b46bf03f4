"""Checkpoints: exact round trips, crash safety, pruning and clear errors."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pollen.files import NpzError, read_npz, write_json
from pollen.runs import checkpoints
from pollen.runs.checkpoints import (
    Checkpoint,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def make_checkpoint(round: int, **extra) -> Checkpoint:
    model = {
        "features.0.weight": np.full((3, 2), round, dtype=np.float32),
        "features.1.running_mean": np.arange(3, dtype=np.float64) / 3,
        "features.1.num_batches_tracked": np.array(round * 10, dtype=np.int64),
    }
    state = {
        "m/features.0.weight": np.full((3, 2), -round, dtype=np.float32),
        "v/features.0.weight": np.ones((3, 2), dtype=np.float64) / 7,
    }
    return Checkpoint(round, model, state, {"lr": 0.1 / (round + 1), **extra})


def assert_same_arrays(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array)


def test_round_trip_keeps_names_values_dtypes_and_extra(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(
        3, model="cnn", scheduler={"step": 3, "milestones": [5, 8]}, nan=None
    )
    checkpoint.model["odd name/with:everything%20.npy"] = np.array([True, False])
    checkpoint.model["file"] = np.array([1, 2], dtype=np.uint8)  # np.savez kwarg
    checkpoint.model["allow_pickle"] = np.arange(4, dtype=np.int16).reshape(2, 2).T
    path = save_checkpoint(tmp_path, checkpoint, keep=3)

    assert (
        path == tmp_path / "checkpoints" / "round-00003" == checkpoint_dir(tmp_path, 3)
    )
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "model.npz",
        "strategy.npz",
    ]
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 3
    assert_same_arrays(loaded.model, checkpoint.model)
    assert_same_arrays(loaded.strategy_state, checkpoint.strategy_state)
    assert loaded.model["features.1.num_batches_tracked"].shape == ()
    assert loaded.extra == checkpoint.extra


def test_empty_strategy_state(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, Checkpoint(0, {"w": np.zeros(2)}), keep=1)
    loaded = load_checkpoint(tmp_path, 0)
    assert loaded.strategy_state == {}
    assert loaded.extra == {}


def test_latest_explicit_round_and_keep(tmp_path: Path) -> None:
    for r in range(1, 6):
        save_checkpoint(tmp_path, make_checkpoint(r), keep=2)
    assert list_checkpoints(tmp_path) == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "round-00004",
        "round-00005",
    ]
    assert load_checkpoint(tmp_path).round == 5
    loaded = load_checkpoint(tmp_path, round=4)
    assert_same_arrays(loaded.model, make_checkpoint(4).model)
    with pytest.raises(CheckpointError, match=r"round 2 .*rounds with one: 4, 5"):
        load_checkpoint(tmp_path, round=2)


def test_the_checkpoint_just_written_is_never_pruned(tmp_path: Path) -> None:
    for r in (3, 4, 5):
        save_checkpoint(tmp_path, make_checkpoint(r), keep=3)
    save_checkpoint(tmp_path, make_checkpoint(1), keep=2)
    assert list_checkpoints(tmp_path) == [1, 5]


def test_resaving_a_round_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_checkpoint(2, tag="first"), keep=2)
    replacement = make_checkpoint(7, tag="second")
    replacement = Checkpoint(2, replacement.model, {}, replacement.extra)
    save_checkpoint(tmp_path, replacement, keep=2)

    assert list_checkpoints(tmp_path) == [2]
    loaded = load_checkpoint(tmp_path, 2)
    assert loaded.extra["tag"] == "second"
    assert_same_arrays(loaded.model, replacement.model)
    assert loaded.strategy_state == {}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["round-00002"]


def test_failed_save_leaves_the_previous_copy_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, make_checkpoint(2, tag="first"), keep=1)

    def fail(path: Path, obj: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("pollen.runs.checkpoints.write_json", fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, make_checkpoint(2, tag="second"), keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["round-00002"]
    assert load_checkpoint(tmp_path).extra["tag"] == "first"


def test_leftover_temporary_directory_is_ignored_then_cleaned(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_checkpoint(1), keep=5)
    root = tmp_path / "checkpoints"
    # a crash while writing round 2: everything there but the rename
    crashed = root / ".round-00002.tmp"
    save_checkpoint(tmp_path, make_checkpoint(2), keep=5).rename(crashed)
    (root / ".round-00009.tmp").mkdir()  # and one that died early
    assert list_checkpoints(tmp_path) == [1]
    assert load_checkpoint(tmp_path).round == 1
    with pytest.raises(CheckpointError, match="round 2"):
        load_checkpoint(tmp_path, 2)

    save_checkpoint(tmp_path, make_checkpoint(3), keep=5)
    assert sorted(p.name for p in root.iterdir()) == ["round-00001", "round-00003"]


def test_crash_while_replacing_a_round_keeps_the_old_copy(tmp_path: Path) -> None:
    # a crash between moving the old copy aside and renaming the new one in
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, make_checkpoint(4, tag="old"), keep=2)
    os.replace(root / "round-00004", root / ".round-00004.old")
    (root / ".round-00004.tmp").mkdir()
    assert list_checkpoints(tmp_path) == [4]
    assert load_checkpoint(tmp_path).extra["tag"] == "old"

    save_checkpoint(tmp_path, make_checkpoint(5), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["round-00004", "round-00005"]
    assert load_checkpoint(tmp_path, 4).extra["tag"] == "old"


def test_no_checkpoints(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match="checkpoint-every > 0") as error:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "checkpoints") in str(error.value)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("every", "why"),
    [
        (1, "the run stopped before it wrote one (checkpoint-every=1)"),
        (0, "the run has checkpoint-every=0, which writes none"),
    ],
)
def test_no_checkpoint_says_why_from_the_runs_settings(
    tmp_path: Path, every: int, why: str
) -> None:
    """A run that checkpoints every round but stopped in its first is not
    told to set checkpoint-every > 0."""
    write_json(tmp_path / "settings.json", {"checkpoint-every": every, "rounds": 5})
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert str(error.value).endswith(f"; {why}")


def test_missing_meta_json(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_checkpoint(1), keep=2)
    (path / "meta.json").unlink()
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"round-00001 has no meta\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"round-00001/meta\.json is missing"):
        load_checkpoint(tmp_path, 1)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "JSON object"),
        ('{"format-version": 99, "round": 1, "extra": {}}', "version 99"),
        ('{"format-version": 1, "round": 2, "extra": {}}', "says round 2"),
        ('{"format-version": 1, "round": 1, "extra": []}', "'extra'"),
    ],
)
def test_invalid_meta_json(tmp_path: Path, content: str, message: str) -> None:
    path = save_checkpoint(tmp_path, make_checkpoint(1), keep=2)
    (path / "meta.json").write_text(content)
    with pytest.raises(CheckpointError, match=message) as error:
        load_checkpoint(tmp_path)
    assert "meta.json" in str(error.value)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"this is not an npz archive\n" * 10)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _single_npy(path: Path) -> None:
    np.save(path.with_suffix(".npy"), np.zeros(3))
    path.with_suffix(".npy").replace(path)


def _object_array(path: Path) -> None:
    # crafted with pickle, as a hostile or foreign file could be
    np.savez(path, w=np.array([{"x": 1}, None], dtype=object), allow_pickle=True)


def _flipped_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0xFF  # inside the array data: the zip's CRC check catches it
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage", [_truncate, _garbage, _empty, _single_npy, _object_array, _flipped_byte]
)
@pytest.mark.parametrize("file", ["model.npz", "strategy.npz"])
def test_damaged_npz(tmp_path: Path, damage, file: str) -> None:
    path = save_checkpoint(tmp_path, make_checkpoint(1), keep=2)
    damage(path / file)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert str(path / file) in str(error.value)


def test_missing_npz(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_checkpoint(1), keep=2)
    (path / "model.npz").unlink()
    with pytest.raises(CheckpointError, match=r"model\.npz is missing"):
        load_checkpoint(tmp_path)


def test_save_refuses_object_arrays_and_writes_nothing(tmp_path: Path) -> None:
    model = {"w": np.zeros(2), "bad": np.array([1, "a", None], dtype=object)}
    with pytest.raises(CheckpointError, match=r"model\['bad'\].*object"):
        save_checkpoint(tmp_path, Checkpoint(1, model), keep=1)
    state = {"s": np.zeros(1, dtype=[("a", "f4"), ("b", "O")])}
    with pytest.raises(CheckpointError, match="strategy_state"):
        save_checkpoint(tmp_path, Checkpoint(1, {}, state), keep=1)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("checkpoint", "keep", "error"),
    [
        (Checkpoint(1, {}, extra={"f": object()}), 1, CheckpointError),
        (Checkpoint(1, {}, extra=[1]), 1, CheckpointError),  # type: ignore[arg-type]
        (Checkpoint(1, {1: np.zeros(1)}), 1, CheckpointError),  # type: ignore[dict-item]
        (Checkpoint(-1, {}), 1, ValueError),
        (Checkpoint(1, {}), 0, ValueError),
    ],
)
def test_save_refuses_bad_arguments(
    tmp_path: Path, checkpoint: Checkpoint, keep: int, error: type
) -> None:
    with pytest.raises(error):
        save_checkpoint(tmp_path, checkpoint, keep=keep)
    assert list_checkpoints(tmp_path) == []


def test_meta_json_is_plain_json(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_checkpoint(2, model="mlp"), keep=1)
    meta = json.loads((path / "meta.json").read_text())
    assert meta == {
        "format-version": 1,
        "round": 2,
        "extra": {"lr": 0.1 / 3, "model": "mlp"},
    }


def test_a_saved_checkpoint_is_on_the_disk_before_the_older_one_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep=1 deletes the previous checkpoint right after the new one is in
    place: the new one's files and folders are flushed first (nothing was,
    so a power loss could leave an empty meta.json and no older copy)."""
    events: list[str] = []
    fsync, remove = os.fsync, checkpoints._remove
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("sync"), fsync(fd))[1])
    monkeypatch.setattr(
        checkpoints, "_remove", lambda path: (events.append("remove"), remove(path))[1]
    )
    model = {"w": np.ones(3, np.float32)}
    save_checkpoint(tmp_path, Checkpoint(1, model, {}, {}), keep=1)
    events.clear()
    save_checkpoint(tmp_path, Checkpoint(2, model, {}, {}), keep=1)
    assert "sync" in events and events.index("sync") < events.index("remove")


def test_a_checkpoint_with_an_empty_meta_json_is_not_complete(tmp_path: Path) -> None:
    model = {"w": np.ones(3, np.float32)}
    save_checkpoint(tmp_path, Checkpoint(1, model, {}, {}), keep=2)
    newest = save_checkpoint(tmp_path, Checkpoint(2, model, {}, {}), keep=2)
    (newest / "meta.json").write_bytes(b"")
    assert list_checkpoints(tmp_path) == [1]


def test_an_npz_member_that_is_no_array_is_refused(tmp_path: Path) -> None:
    """numpy hands a member without the .npy header back as raw bytes."""
    path = tmp_path / "model.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("w.npy", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.")
    with pytest.raises(NpzError, match="'w' is not an array"):
        read_npz(path)

"""Bad data and settings: each is refused with a clear error before training,
and the files involved are left as they were (see docs/robustness.md)."""

from __future__ import annotations

import gzip
import io
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pollen.runs.checkpoints import (
    Checkpoint,
    CheckpointError,
    check_resumable,
    load_resumable,
    save_checkpoint,
)
from pollen.settings import Settings
from pollen.task import data as data_module
from pollen.task.data import CACHE_DIR, DataError, load_dataset
from pollen.task.partition import PartitionError, partition_indices
from pollen.task.shards import client_shard, client_test_shard
from tests.conftest import resumable_extra


def fake_mnist() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.integers(0, 256, (50, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, 50).astype(np.uint8),
        "x_test": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, 20).astype(np.uint8),
    }


def write_npz(root: Path, name: str, arrays: dict[str, np.ndarray]) -> Path:
    path = root / f"{name}.npz"
    np.savez_compressed(path, **arrays)
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (or `root` itself) with its bytes."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def new_process() -> Callable[[], None]:
    """Forget the datasets loaded in this process, as a new process would."""
    data_module._load_cached.cache_clear()
    return data_module._load_cached.cache_clear


# --- the decoded cache ------------------------------------------------------


def _flip_pixels(cache: Path) -> None:
    raw = bytearray((cache / "x_train.npy").read_bytes())
    raw[-100] ^= 0xFF  # pixel data: still a valid .npy, silently wrong
    (cache / "x_train.npy").write_bytes(bytes(raw))


def _labels_out_of_range(cache: Path) -> None:
    np.save(cache / "y_train.npy", np.full(50, 99, np.int64))


def _float_pixels(cache: Path) -> None:
    np.save(cache / "x_train.npy", np.zeros((50, 28, 28), np.float32))


def _truncated(cache: Path) -> None:
    (cache / "x_test.npy").write_bytes((cache / "x_test.npy").read_bytes()[:200])


def _meta_not_an_object(cache: Path) -> None:
    (cache / "source.json").write_text("[1, 2]")


CACHE_DAMAGE = [
    _flip_pixels,
    _labels_out_of_range,
    _float_pixels,
    _truncated,
    _meta_not_an_object,
]


@pytest.mark.parametrize("damage", CACHE_DAMAGE)
def test_damaged_cache_is_rebuilt_from_the_source(
    tmp_path: Path, new_process: Callable[[], None], damage
) -> None:
    arrays = fake_mnist()
    source = write_npz(tmp_path, "mnist", arrays)
    load_dataset("mnist", tmp_path, download=False)
    cache = tmp_path / CACHE_DIR / "mnist"
    damage(cache)
    before = snapshot(source)

    new_process()
    with pytest.warns(UserWarning, match=r"decoded cache .*mnist is damaged"):
        ds = load_dataset("mnist", tmp_path, download=False)
    assert ds.source == str(source)  # decoded again, not read from the cache
    assert np.array_equal(ds.x_train[:, 0].numpy(), arrays["x_train"])
    assert np.array_equal(ds.y_train.numpy(), arrays["y_train"])
    assert snapshot(source) == before

    new_process()  # the rebuilt cache is whole again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_dataset("mnist", tmp_path, download=False)
    assert again.source.startswith(str(cache))
    assert torch.equal(again.x_train, ds.x_train)


def test_damaged_cache_without_its_source_is_a_clear_error(
    tmp_path: Path, new_process: Callable[[], None]
) -> None:
    source = write_npz(tmp_path, "mnist", fake_mnist())
    load_dataset("mnist", tmp_path, download=False)
    source.unlink()
    _flip_pixels(tmp_path / CACHE_DIR / "mnist")
    before = snapshot(tmp_path)

    new_process()
    with pytest.raises(
        DataError,
        match=r"no data for 'mnist' .*decoded cache .*is damaged: x_train\.npy does "
        "not match the CRC-32",
    ):
        load_dataset("mnist", tmp_path, download=False)
    assert snapshot(tmp_path) == before


# --- npz files ---------------------------------------------------------------


def _single_npy(path: Path) -> None:
    np.save(path.with_suffix(".npy"), np.zeros(3, np.uint8))
    path.with_suffix(".npy").replace(path)


def _flipped_bytes(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(300, 2000, 7):  # inside x_train's deflate stream
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _pickled_labels(path: Path) -> None:
    arrays = {**fake_mnist(), "y_train": np.array([{}] * 50, dtype=object)}
    np.savez(path, **arrays, allow_pickle=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: a.update(y_train=a["y_train"].astype(np.float32)),
            "y_train has dtype float32; expected ints",
        ),
        (
            lambda a: a.update(y_test=a["y_test"].astype(np.int64) - 1),
            r"y_test has labels -1\.\.8; mnist has classes 0\.\.9",
        ),
        (
            lambda a: a.update(x_train=a["x_train"][:0], y_train=a["y_train"][:0]),
            "train split is empty",
        ),
        (
            lambda a: a.update(x_test=np.zeros((20, 28, 28, 3), np.uint8)),
            r"x_test has shape \[20, 28, 28, 3\]; mnist needs \[N, 28, 28\]",
        ),
    ],
    ids=["float-labels", "negative-labels", "empty-split", "rgb-for-gray"],
)
def test_malformed_npz_arrays(tmp_path: Path, change, message: str) -> None:
    arrays = fake_mnist()
    change(arrays)
    source = write_npz(tmp_path, "mnist", arrays)
    before = snapshot(source)
    with pytest.raises(DataError, match=message):
        load_dataset("mnist", tmp_path, download=False)
    assert snapshot(source) == before
    assert not (tmp_path / CACHE_DIR).exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_flipped_bytes, r"cannot read .*mnist\.npz: .*corrupted"),
        (
            _single_npy,
            r"mnist\.npz is a single \.npy array, not an \.npz; a Keras-layout \.npz",
        ),
        (_pickled_labels, r"cannot read .*Object arrays cannot be loaded"),
    ],
)
def test_corrupted_npz(tmp_path: Path, damage, message: str) -> None:
    source = write_npz(tmp_path, "mnist", fake_mnist())
    damage(source)
    before = snapshot(source)
    with pytest.raises(DataError, match=message):
        load_dataset("mnist", tmp_path, download=False)
    assert snapshot(source) == before
    assert not (tmp_path / CACHE_DIR).exists()


# --- image folders -----------------------------------------------------------


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


NAMES = ["train/cat/0.jpg", "train/cat/1.jpg", "train/dog/0.jpg", "test/cat/0.jpg"]
NAMES += ["test/dog/0.jpg"]
BAD = "train/cat/1.jpg"
JPEG_DAMAGE = {
    "truncated": (lambda d: d[: len(d) // 2], "Truncated File Read"),
    "garbage": (lambda d: b"not an image" * 20, "not an image format Pillow reads"),
}


def plain_tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"cifar10/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_gz(path: Path, files: dict[str, bytes]) -> Path:
    path.write_bytes(gzip.compress(plain_tar(files)))
    return path


@pytest.mark.parametrize("kind", JPEG_DAMAGE)
def test_corrupted_jpeg_in_archive_names_the_member(tmp_path: Path, kind: str) -> None:
    damage, message = JPEG_DAMAGE[kind]
    files = {name: jpeg(i) for i, name in enumerate(NAMES)}
    files[BAD] = damage(files[BAD])
    archive = tar_gz(tmp_path / "cifar10.tar.gz", files)
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=message) as error:
        load_dataset("cifar10", tmp_path, download=False)
    assert f"cannot decode image {archive}:cifar10/{BAD}" in str(error.value)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", JPEG_DAMAGE)
def test_corrupted_jpeg_in_folder_names_the_file(tmp_path: Path, kind: str) -> None:
    damage, message = JPEG_DAMAGE[kind]
    for i, name in enumerate(NAMES):
        path = tmp_path / "cifar10" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(damage(jpeg(i)) if name == BAD else jpeg(i))
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=message) as error:
        load_dataset("cifar10", tmp_path, download=False)
    assert f"cannot decode image {tmp_path / 'cifar10' / BAD}" in str(error.value)
    assert snapshot(tmp_path) == before


TEN = [f"class-{c}" for c in range(10)]  # cifar10's count, any names


def ten_classes(drop: str | None = None, only_train: str | None = None) -> dict:
    """An image folder of 10 classes, one image per split each; `drop`'s
    images left out (its folder stays, empty), `only_train` absent from test/."""
    return {
        f"{split}/{c}/0.jpg": jpeg(i)
        for split in ("train", "test")
        for i, c in enumerate(TEN)
        if c != drop and not (split == "test" and c == only_train)
    }


def write_folder(root: Path, files: dict[str, bytes], empty: list[str]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    for folder in empty:
        (root / folder).mkdir(parents=True, exist_ok=True)


def tar_with_folders(path: Path, files: dict[str, bytes], empty: list[str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for folder in empty:
            info = tarfile.TarInfo(f"cifar10/{folder}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(f"cifar10/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


FOLDER_FAULTS = {
    # an empty class folder in both splits: the later labels must not shift
    "empty class": (ten_classes(drop="class-4"), ["train/class-4", "test/class-4"],
                    r"class folder 'class-4' holds no images"),
    "class in train only": (ten_classes(only_train="class-7"), [],
                            r"train and test class folders differ \('class-7'"),
    "nine classes": (ten_classes(drop="class-9"), [],
                     r"9 class folders .*cifar10 has 10 classes"),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["folder", "archive"])
@pytest.mark.parametrize("fault", FOLDER_FAULTS)
def test_class_folders_that_would_renumber_labels_are_refused(
    tmp_path: Path, fault: str, kind: str
) -> None:
    files, empty, message = FOLDER_FAULTS[fault]
    if kind == "folder":
        write_folder(tmp_path / "cifar10", files, empty)
    else:
        tar_with_folders(tmp_path / "cifar10.tar.gz", files, empty)
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=message):
        load_dataset("cifar10", tmp_path, download=False)
    assert snapshot(tmp_path) == before
    good = ten_classes()  # the same folder complete: labels 0..9 in name order
    if kind == "folder":
        write_folder(tmp_path / "good" / "cifar10", good, [])
    else:
        (tmp_path / "good").mkdir()
        tar_with_folders(tmp_path / "good" / "cifar10.tar.gz", good, [])
    data = load_dataset("cifar10", tmp_path / "good", download=False)
    assert data.y_train.tolist() == data.y_test.tolist() == list(range(10))


def _many_images() -> dict[str, bytes]:
    return {
        f"{split}/{c}/{i}.jpg": jpeg(i)
        for split in ("train", "test")
        for c in ("cat", "dog")
        for i in range(8)
    }


def test_archive_damaged_mid_stream_is_refused(tmp_path: Path) -> None:
    # tarfile stops listing at a bad header without a word: gzip's CRC tells
    archive = tar_gz(tmp_path / "cifar10.tar.gz", _many_images())
    raw = bytearray(archive.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(64)
    archive.write_bytes(bytes(raw))
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=r"cannot read .*cifar10\.tar\.gz"):
        load_dataset("cifar10", tmp_path, download=False)
    assert snapshot(tmp_path) == before


def test_tar_with_a_damaged_header_is_refused(tmp_path: Path) -> None:
    # a tar damaged before compression: the gzip layer is intact
    raw = bytearray(plain_tar(_many_images()))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tenth = tar.getmembers()[10].offset
    raw[tenth : tenth + 100] = b"x" * 100  # the 11th member's header
    archive = tmp_path / "cifar10.tar.gz"
    archive.write_bytes(gzip.compress(bytes(raw)))
    before = snapshot(tmp_path)
    with pytest.raises(
        DataError, match=r"damaged tar archive, the listing stops after"
    ):
        load_dataset("cifar10", tmp_path, download=False)
    assert snapshot(tmp_path) == before


# --- partitions --------------------------------------------------------------

LABELS = np.repeat(np.arange(10), 3)  # 30 samples, 3 per class


@pytest.mark.parametrize(
    ("scheme", "num_clients", "options", "message"),
    [
        ("iid", 31, {}, r"'num-clients': 31; .*partition 'iid' .*at most 30 clients"),
        ("niid", 31, {}, r"'num-clients': 31; .*partition 'niid'"),
        (
            "niid",
            15,
            {"min_size": 0},
            r"partition 'niid' with num-clients=15 leaves client \d+ without training "
            r"samples .*raise min-size \(now 0\) to at least 1",
        ),
        (
            "pathological",
            10,
            {"classes_per_client": 6},
            r"partition 'pathological' with num-clients=10 and classes-per-client=6 "
            r".*use fewer clients or a lower classes-per-client",
        ),
    ],
)
def test_partition_that_leaves_a_client_empty(
    scheme: str, num_clients: int, options: dict, message: str
) -> None:
    with pytest.raises(PartitionError, match=message):
        partition_indices(LABELS, 10, num_clients, scheme, **options)


def test_silos_over_missing_classes() -> None:
    labels = np.repeat(np.arange(5), 4)  # classes 5..9 have no samples
    with pytest.raises(
        PartitionError,
        match=r"partition 'silos' with num-clients=10 leaves client 5 without "
        r"training samples \(5 of 10 clients empty\); some classes have no",
    ):
        partition_indices(labels, 10, 10, "silos")


@pytest.mark.parametrize("client", [-1, 10])
def test_client_without_a_shard(client: int) -> None:
    settings = Settings.from_run_config({})  # digits, 10 clients
    for shard in (client_shard, client_test_shard):
        with pytest.raises(
            PartitionError, match=r"num-clients=10 gives clients 0\.\.9"
        ):
            shard(settings, client, torch.device("cpu"))


# --- checkpoints -------------------------------------------------------------

RUN_CONFIG = {"rounds": 5, "model": "cnn", "strategy": "fedavg", "lr": 0.01}


@pytest.mark.parametrize(("key", "value"), [("model", "mlp"), ("strategy", "scaffold")])
def test_checkpoint_of_another_model_or_strategy(
    tmp_path: Path, key: str, value: str
) -> None:
    model = {"w": np.ones((2, 2), np.float32)}
    extra = resumable_extra(RUN_CONFIG)
    save_checkpoint(tmp_path, Checkpoint(2, model, extra=extra), keep=2)
    before = snapshot(tmp_path)
    changed = {**RUN_CONFIG, key: value, "rounds": 8}  # rounds may change
    message = (
        rf"round 2 was written with {key}='{RUN_CONFIG[key]}', this run has "
        rf"{key}='{value}'; only .*rounds"
    )
    for check in (check_resumable, load_resumable):
        with pytest.raises(CheckpointError, match=message):
            check(tmp_path, changed)
    assert snapshot(tmp_path) == before
    assert load_resumable(tmp_path, {**RUN_CONFIG, "rounds": 8}).round == 2


@pytest.mark.parametrize(
    ("damage", "problem"),
    [({"_last_lr": ...}, r"_last_lr=None, not \[one learning rate > 0\]"),
     ({"_last_lr": [0.0]}, r"_last_lr=\[0.0\]"),
     ({"num_bad_epochs": "2"}, r"num_bad_epochs='2', not an integer >= 0"),
     ({"best": None}, r"best=None, not a number")],
)  # fmt: skip
def test_a_checkpoint_with_a_damaged_schedule_state_is_refused_before_the_run(
    tmp_path: Path, damage: dict, problem: str
) -> None:
    """The learning-rate schedule's state in meta.json is checked with the
    rest of the checkpoint (a KeyError in the ServerApp, after start-up)."""
    extra = resumable_extra(RUN_CONFIG)
    state = {**extra["lr-scheduler"], **damage}
    extra["lr-scheduler"] = {k: v for k, v in state.items() if v is not ...}
    model = {"w": np.ones((2, 2), np.float32)}
    save_checkpoint(tmp_path, Checkpoint(2, model, extra=extra), keep=2)
    for check in (check_resumable, load_resumable):
        with pytest.raises(
            CheckpointError, match=rf"meta.json: its 'lr-scheduler' entry has {problem}"
        ):
            check(tmp_path, {**RUN_CONFIG, "rounds": 8})


@pytest.mark.parametrize(("strategy", "refused"), [("feddyn", True), ("fedavg", False)])
def test_a_resume_may_not_stop_checkpointing_clients_that_keep_state(
    tmp_path: Path, strategy: str, refused: bool
) -> None:
    """FedDyn's clients keep h_k, written with the checkpoints: resumed with
    checkpoint-every=0 they would train on in memory while their files stay
    at the checkpoint's round, which a later resume would read as current.
    FedAvg's clients keep nothing, so its checkpoints may stop."""
    saved = {**RUN_CONFIG, "strategy": strategy, "checkpoint-every": 2}
    model = {"w": np.ones((2, 2), np.float32)}
    save_checkpoint(
        tmp_path, Checkpoint(2, model, extra=resumable_extra(saved)), keep=2
    )
    resumed = {**saved, "checkpoint-every": 0, "rounds": 8}
    if refused:
        with pytest.raises(CheckpointError, match="keep checkpoint-every > 0"):
            check_resumable(tmp_path, resumed)
    else:
        assert check_resumable(tmp_path, resumed) == 2
    assert check_resumable(tmp_path, {**resumed, "checkpoint-every": 3}) == 2


def test_a_failed_download_leaves_no_empty_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download that fails (here: a mirror on a closed loopback port) says
    so and leaves no empty `torchvision/MNIST/raw` to pass for data."""
    import torchvision.datasets

    from pollen.deployment.processes import free_port

    mirror = f"http://127.0.0.1:{free_port()}/"
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", [mirror])
    with pytest.raises(DataError, match="download of 'mnist' failed"):
        load_dataset("mnist", tmp_path, download=True)
    assert not (tmp_path / "torchvision").exists()

"""Data sources, the decoded cache, every kind of bad data file, and the lines
a slow user loader gets."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pollen.extensions import ExtensionError
from pollen.task import data as data_module
from pollen.task.data import CACHE_DIR, DataError, _digits, load_dataset, user_dataset
from tests.user_package import on_path


def fake_mnist(
    n_train: int = 50, n_test: int = 20, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, n_test).astype(np.uint8),
    }


def write_npz(root: Path, name: str, arrays: dict[str, np.ndarray]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.npz"
    np.savez_compressed(path, **arrays)
    return path


def test_digits_ship_with_scikit_learn() -> None:
    ds = load_dataset("digits", "unused", download=False)
    assert ds.x_train.shape == (1437, 1, 8, 8) and ds.x_test.shape == (360, 1, 8, 8)
    assert ds.x_train.dtype.is_floating_point is False and int(ds.x_train.max()) == 255
    assert sorted(set(ds.y_train.tolist())) == list(range(10))


def expected_digits() -> dict[str, np.ndarray]:
    """The digits split computed from `load_digits` itself."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.clip(np.rint(bunch.images * 255 / 16), 0, 255).astype(np.uint8)
    order = np.random.default_rng(0).permutation(1797)
    tr, te = order[:1437], order[1437:]
    return {
        "x_train": x[tr],
        "y_train": bunch.target[tr],
        "x_test": x[te],
        "y_test": bunch.target[te],
    }


@pytest.mark.parametrize("where", ["csv", "load_digits"])
def test_digits_are_scikit_learns(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from scikit-learn's CSV, or through `load_digits` when the installed
    scikit-learn keeps the file elsewhere: the same images, labels and split."""
    if where == "load_digits":
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    arrays = _digits()
    for k, want in expected_digits().items():
        assert np.array_equal(arrays[k], want), k


def test_digits_shards_need_neither_scikit_learn_nor_datasets(tmp_path: Path) -> None:
    """The digits come from scikit-learn's CSV and their shards, once computed,
    from the partition cache: a process that needs them (a deployed ClientApp
    gets a new one per message) imports neither scikit-learn nor
    flwr-datasets' `datasets` (1.1 and 1.4 s of CPU)."""
    script = (
        "import sys; from pollen.settings import Settings; "
        "from pollen.task.shards import federated_data; "
        f"federated_data(Settings.from_run_config({{'data-root': {str(tmp_path)!r}}})); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'datasets'}))"
    )
    run = [sys.executable, "-c", script]
    first = subprocess.run(run, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == "['datasets']"  # partitioned, then cached
    assert len(list((tmp_path / CACHE_DIR / "partitions").glob("*.npz"))) == 1
    again = subprocess.run(run, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == "[]"


def test_npz_is_decoded_once_and_cached(tmp_path: Path) -> None:
    arrays = fake_mnist()
    write_npz(tmp_path, "mnist", arrays)
    ds = load_dataset("mnist", tmp_path, download=False)
    assert ds.x_train.shape == (50, 1, 28, 28)
    assert np.array_equal(ds.x_train[:, 0].numpy(), arrays["x_train"])
    assert (tmp_path / CACHE_DIR / "mnist" / "x_train.npy").exists()
    assert ds.source.endswith("mnist.npz")


def test_cache_goes_to_pollen_cache_dir_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only data-root (a container's data volume) keeps its cache elsewhere."""
    data, elsewhere = tmp_path / "data", tmp_path / "cache"
    write_npz(data, "mnist", fake_mnist())
    monkeypatch.setenv("POLLEN_CACHE_DIR", str(elsewhere))
    first = load_dataset("mnist", data, download=False)
    again = load_dataset("mnist", data, download=False)
    assert (elsewhere / "mnist" / "x_train.npy").exists()
    assert not (data / CACHE_DIR).exists()
    assert torch.equal(first.x_train, again.x_train)


def test_cache_is_rebuilt_when_the_source_changes(tmp_path: Path) -> None:
    write_npz(tmp_path, "mnist", fake_mnist(seed=1))
    first = load_dataset("mnist", tmp_path, download=False)
    write_npz(tmp_path, "mnist", fake_mnist(n_train=60, seed=2))
    second = load_dataset("mnist", tmp_path, download=False)
    assert len(first.y_train) == 50 and len(second.y_train) == 60


def test_keras_name_with_underscore(tmp_path: Path) -> None:
    write_npz(tmp_path, "fashion_mnist", fake_mnist())
    assert load_dataset("fashion-mnist", tmp_path, download=False).num_classes == 10


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: a.update(x_train=a["x_train"][:, :20]),
            r"x_train has shape \[50, 20, 28\]",
        ),
        (
            lambda a: a.update(x_test=a["x_test"].astype(np.float32)),
            "dtype float32; expected uint8",
        ),
        (
            lambda a: a.update(y_train=a["y_train"] + 5),
            "labels 5..14; mnist has classes 0..9",
        ),
        (
            lambda a: a.update(y_test=a["y_test"][:3]),
            r"y_test has shape \[3\]; expected \[20\]",
        ),
        (lambda a: a.pop("y_test"), "lacks y_test"),
    ],
)
def test_malformed_npz_is_refused(tmp_path: Path, change, message: str) -> None:
    arrays = fake_mnist()
    change(arrays)
    write_npz(tmp_path, "mnist", arrays)
    with pytest.raises(DataError, match=message):
        load_dataset("mnist", tmp_path, download=False)


def test_truncated_npz_is_refused(tmp_path: Path) -> None:
    path = write_npz(tmp_path, "mnist", fake_mnist())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=r"truncated or not a \.npz"):
        load_dataset("mnist", tmp_path, download=False)


def test_missing_data_with_download_off(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no data for 'cifar10'.*set download=true"):
        load_dataset("cifar10", tmp_path, download=False)


def test_unreachable_download_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", offline)
    with pytest.raises(DataError, match="download of 'mnist' failed"):
        load_dataset("mnist", tmp_path, download=True)


def png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                   "horse", "ship", "truck"]  # fmt: skip
IMAGES = {
    "train/cat/0.png": (200, 0, 0),
    "train/cat/1.png": (210, 0, 0),
    "train/airplane/0.png": (0, 0, 200),
    "test/cat/0.png": (220, 0, 0),
    "test/airplane/0.png": (0, 0, 220),
    **{f"{split}/{c}/0.png": (0, 100, 0) for split in ("train", "test")
       for c in CIFAR10_CLASSES if c not in ("cat", "airplane")},
}  # fmt: skip


def test_image_folder_archive_sorted_class_names(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "cifar10.tar.gz", "w:gz") as tar:
        for name, colour in IMAGES.items():
            data = png(colour)
            info = tarfile.TarInfo(f"cifar10/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = load_dataset("cifar10", tmp_path, download=False)
    assert ds.x_train.shape == (11, 3, 32, 32)
    assert ds.y_train.tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9]  # sorted names
    assert int(ds.x_train[0, 2, 0, 0]) == 200 and int(ds.x_train[3, 0, 0, 0]) == 200


def test_image_folder_directory(tmp_path: Path) -> None:
    for name, colour in IMAGES.items():
        path = tmp_path / "cifar10" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(colour))
    ds = load_dataset("cifar10", tmp_path, download=False)
    assert ds.y_test.tolist() == list(range(10)) and ds.input_shape == (3, 32, 32)


def test_an_image_folders_cache_is_rebuilt_when_an_image_changes(
    tmp_path: Path,
) -> None:
    """An image added to a class folder, or one replaced in place, changes
    the class folder or the image, not the top folder: the decoded cache
    (read by a new process, here with the in-process copy cleared) is
    rebuilt all the same."""

    def write(name: str, colour: tuple[int, int, int]) -> None:
        path = tmp_path / "cifar10" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(colour))

    def in_a_new_process():
        data_module._load_cached.cache_clear()
        return load_dataset("cifar10", tmp_path, download=False)

    for name, colour in IMAGES.items():
        write(name, colour)
    (tmp_path / "cifar10" / "train" / "cat" / ".#0.png").symlink_to("gone.png")
    assert len(in_a_new_process().y_train) == 11  # a dangling link is skipped
    write("train/cat/2.png", (230, 0, 0))
    assert len(in_a_new_process().y_train) == 12
    write("train/airplane/0.png", (0, 0, 90))
    assert int(in_a_new_process().x_train[0, 2, 0, 0]) == 90


def test_truncated_archive_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cifar10.tar.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DataError, match="cannot read"):
        load_dataset("cifar10", tmp_path, download=False)


def test_real_mnist_matches_its_provenance(shared_data: Path) -> None:
    ds = load_dataset("mnist", shared_data, download=False)
    assert ds.x_train.shape == (60000, 1, 28, 28) and len(ds.y_test) == 10000
    assert ds.y_train[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert ds.mean[0] == pytest.approx(0.130660, abs=1e-5)


def test_cifar100_takes_fine_labels_0_to_99(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8),
        "y_train": np.arange(200) % 100,
        "x_test": rng.integers(0, 256, (100, 32, 32, 3), dtype=np.uint8),
        "y_test": np.arange(100),
    }
    write_npz(tmp_path, "cifar100", arrays)
    data = load_dataset("cifar100", tmp_path, download=False)
    assert data.num_classes == 100 and data.input_shape == (3, 32, 32)
    assert int(data.y_train.max()) == 99
    write_npz(tmp_path / "bad", "cifar100", {**arrays, "y_test": arrays["y_test"] + 1})
    with pytest.raises(DataError, match=r"classes 0\.\.99"):
        load_dataset("cifar100", tmp_path / "bad", download=False)


def test_an_image_folders_fingerprint_is_every_file_in_walk_order(
    tmp_path: Path,
) -> None:
    """The fingerprint digests each file's path, size and modification time
    in `os.walk`'s order (a folder's files, then its subfolders, each by
    name), so caches written before it was computed with `os.scandir` stay
    valid; links to folders are not followed, dangling links are skipped."""
    top = tmp_path / "cifar10"
    for name in ("b.png", "a/z.png", "a/b/c.png", "a/b/a.png", "c/x.png", "a.png"):
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(name.encode())
    (top / "a" / "gone.png").symlink_to("nowhere.png")
    (top / "a" / "linked").symlink_to(top / "c", target_is_directory=True)
    lines = []
    for folder, subfolders, names in os.walk(top):
        subfolders.sort()
        for name in sorted(names):
            file = Path(folder, name)
            if file.is_file():
                info = file.stat()
                lines.append(f"{file.relative_to(top)}\0{info.st_size}\0"
                             f"{info.st_mtime_ns}\n")  # fmt: skip
    assert len(lines) == 6
    assert data_module._fingerprint(top) == {
        "path": str(top),
        "files": 6,
        "digest": hashlib.sha256("".join(lines).encode()).hexdigest(),
    }


SLOW_LOADERS = '''
"""Data-set loaders that take their time: 0.6 s (past the tests' 0.2 s) or none."""

import time

import numpy as np


def quick():
    x = np.arange(4 * 36, dtype=np.uint8).reshape(4, 6, 6)
    y = np.array([0, 1, 0, 1])
    return {"x_train": x, "y_train": y, "x_test": x, "y_test": y, "classes": 2}


def slow():
    time.sleep(0.6)
    return quick()


def raises():
    raise OSError("the share is gone")


def slow_raises():
    time.sleep(0.6)
    raises()
'''

ANNOUNCE_AFTER_S = 0.2  # the tests' threshold: the loaders above straddle it


@pytest.fixture
def slow_loaders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The module `slowloaders` on the path, its loaders announced after
    `ANNOUNCE_AFTER_S`; each test's loader called afresh."""
    (tmp_path / "slowloaders.py").write_text(SLOW_LOADERS)
    monkeypatch.setattr("pollen.common.announce.ANNOUNCE_AFTER_S", ANNOUNCE_AFTER_S)
    with on_path(tmp_path):
        yield "slowloaders"
    user_dataset.cache_clear()
    sys.modules.pop("slowloaders", None)


def still_running(name: str) -> str:
    """The line a loader past the threshold gets while it runs."""
    return (
        f"pollen: loading data set {name!r} (a user's loader) ... still running "
        f"after {ANNOUNCE_AFTER_S:g} s"
    )


def test_a_slow_user_loader_is_announced_then_timed(
    slow_loaders: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loader past the threshold gets a line while it runs (a minute of
    silence looks like a hang) and one with its time when it returns."""
    name = f"{slow_loaders}:slow"
    user_dataset(name)
    first, second = capsys.readouterr().err.splitlines()
    assert first == still_running(name)
    assert re.fullmatch(rf"pollen: data set {name!r} loaded in \d+\.\d s", second)


def test_a_quick_user_loader_is_silent(
    slow_loaders: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loader under the threshold prints nothing, then or later: the
    common case stays silent."""
    user_dataset(f"{slow_loaders}:quick")
    time.sleep(2 * ANNOUNCE_AFTER_S)  # past when a running timer would speak
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("loader", ["raises", "slow_raises"])
def test_a_failing_user_loader_leaves_no_line_after_its_error(
    loader: str, slow_loaders: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loader that raises, early or past the threshold, has its timer
    cancelled and no time given: nothing follows the error."""
    name = f"{slow_loaders}:{loader}"
    with pytest.raises(ExtensionError, match="its loader raised OSError"):
        user_dataset(name)
    before = capsys.readouterr().err.splitlines()
    time.sleep(2 * ANNOUNCE_AFTER_S)  # past when a running timer would speak
    assert capsys.readouterr().err == ""
    assert before == ([still_running(name)] if loader == "slow_raises" else [])

"""Data sets: find them, decode them once, keep them as uint8 tensors.

Sources are tried in order, all under `data-root`:

1. the decoded cache `.pollen-cache/<name>/` (plain `.npy` files, memory-mapped;
   under `$POLLEN_CACHE_DIR` instead when that is set, for read-only data),
   valid while its source file is unchanged and its files match their CRC-32
   (a damaged cache is decoded again from the source);
2. a Keras-layout `<name>.npz` (`x_train`, `y_train`, `x_test`, `y_test`);
3. an image folder `<name>/` or archive `<name>.tar.gz` / `<name>-jpeg.tar.gz`
   holding `train/<class>/*` and `test/<class>/*` (class index = sorted names);
4. a torchvision download, when `download` is true.

A node with its own examples (node config `data-file`) reads them from one
.npz instead (`read_node_file`): `x_train`, `y_train` and optionally
`x_test`, `y_test`, normalised with the data set's statistics from `SPECS`,
so that it needs no copy of the data set.

`digits` is scikit-learn's handwritten digits (8x8, 1,797 images): it ships
with a dependency, so the default run needs neither files nor internet.

A user's data set (`data-set = "module:function"` or a name an installed
package registers, `pollen.extensions`) is what its loader returns
(`user_dataset`), checked and kept once per process.

Whatever the source, the result is validated (dtype, shape, label range) and
returned as tensors `x` uint8 `[N, C, H, W]` and `y` int64 `[N]`. Images may
come as `[N, H, W]` (grey), `[N, H, W, C]` or `[N, C, H, W]`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import tarfile
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from ..catalog import DATA_SETS, DataSetInfo
from ..common.announce import announced
from ..extensions import (
    DATA_SET_GROUP,
    USER_TRAINING,
    ExtensionError,
    import_path,
    summary,
    user_function,
)
from ..files import NpzError, read_npz, readable_folder_problem

if TYPE_CHECKING:  # torch loads where tensors are made (seconds): `pollen run`
    # reads a data set's labels for its partition check without it
    import torch

SPLITS = ("x_train", "y_train", "x_test", "y_test")
CACHE_DIR = ".pollen-cache"
CACHE_ENV = "POLLEN_CACHE_DIR"
# 2: per-file CRC-32 in source.json; 3: image folders' class folders checked
CACHE_VERSION = 3


class DataError(ValueError):
    """Missing, unreadable or malformed data; the message names the file."""


@dataclass(frozen=True)
class DataSpec:
    """What a named data set must look like (its shape and classes, from
    `pollen.catalog`), where torchvision downloads it, and its training
    split's per-channel pixel mean and std (0..1): what a node normalises
    with when it holds its own examples instead of the data set (a loaded
    data set uses the statistics of the copy it was loaded from)."""

    name: str
    torchvision_class: str | None
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def num_classes(self) -> int:
        return DATA_SETS[self.name].classes

    @property
    def channels(self) -> int:
        return DATA_SETS[self.name].channels

    @property
    def size(self) -> int:
        return DATA_SETS[self.name].side


# digits, mnist and fashion-mnist: as the loader computes them (from
# scikit-learn's copy and ../shared/data; checked by tests/test_node_data.py).
# cifar10, cifar100: the original arrays' (torchvision's download); the JPEG copy
# cifar10-jpeg.tar.gz gives the same means and stds about 0.002 lower.
SPECS = {
    s.name: s
    for s in (
        DataSpec("digits", None,
                 (0.30549564554423025,), (0.37587373215482484,)),
        DataSpec("mnist", "MNIST",
                 (0.13066047627384283,), (0.3081078038564627,)),
        DataSpec("fashion-mnist", "FashionMNIST",
                 (0.2860405969887955,), (0.35302424451492254,)),
        DataSpec("cifar10", "CIFAR10",
                 (0.4913997551666284, 0.48215855929893703, 0.4465309133731618),
                 (0.24703225141799082, 0.24348516474564, 0.2615878392604963)),
        DataSpec("cifar100", "CIFAR100",
                 (0.5070751592371323, 0.48654887331495095, 0.4409178433670343),
                 (0.2673342858792401, 0.2564384629170883, 0.27615047132568404)),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Dataset:
    """A decoded data set: uint8 images `[N, C, H, W]`, int64 labels `[N]`."""

    name: str
    num_classes: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x_train.shape[1:]
        return c, h, w

    @property
    def augmentable(self) -> bool:
        """Random crops and flips suit colour photographs (CIFAR), not digits
        or clothing: `augment` applies to 3-channel data sets only."""
        return self.input_shape[0] == 3


def load_dataset(name: str, data_root: str | Path, download: bool) -> Dataset:
    """Load `name` from the first source that has it (see module docstring).

    Loaded once per process, and again only when the source file changes.
    A user's data set (`pollen.extensions`) comes from its loader instead.
    """
    if name not in DATA_SETS and import_path(name, DATA_SET_GROUP):
        return user_dataset(name)
    spec = _spec(name)
    if name == "digits":
        return _digits_dataset()
    root = Path(data_root).expanduser().resolve()
    if problem := readable_folder_problem(root, "data-root"):
        raise DataError(
            f"{problem} (the one that holds {spec.name}.npz, an image folder or "
            "archive, or where download=true puts the data)"
        )
    try:
        source = _find_local_source(spec, root)
        fingerprint = tuple(_fingerprint(source).items()) if source else None
        return _load_cached(spec, root, download, source, fingerprint)
    except PermissionError as err:
        raise DataError(
            f"cannot read {err.filename or root}: permission denied; data-root "
            "must be a folder this user can read (and, for the decoded cache, "
            f"write, or set {CACHE_ENV})"
        ) from None


def check_readable(name: str, data_root: str | Path, download: bool) -> None:
    """Load `name` as a run would, leaving it decoded in the disk cache for
    the run's processes, and keep no copy in this one: what `pollen run`
    checks before Flower starts. `DataError` says what is wrong."""
    try:
        load_dataset(name, data_root, download)
    finally:
        _load_cached.cache_clear()


def local_training_labels(name: str, data_root: str | Path) -> np.ndarray | None:
    """The training split's labels of data set `name` as a run loading it on
    this machine gets them, without tensors and without a download: from
    the decoded cache, or decoded into it from a source file under
    `data_root`; a user's data set from its loader (called once per
    process). None where this machine has no readable copy (the data may
    live only where the ServerApp runs) or the data set is generated."""
    if name not in DATA_SETS:
        return user_dataset(name).y_train.numpy()
    if DATA_SETS[name].generated:
        return None
    if name == "digits":
        return _digits()["y_train"]
    spec, root = _spec(name), Path(data_root).expanduser().resolve()
    try:
        source = _find_local_source(spec, root)
        fingerprint = _fingerprint(source) if source else None
        arrays, _ = _arrays_from_sources(spec, root, False, source, fingerprint)
    except (DataError, OSError):
        return None
    return np.asarray(arrays["y_train"], np.int64)


def read_node_file(name: str, path: Path) -> Dataset:
    """A node's own examples of data set `name` (node config `data-file`).

    The .npz holds `x_train`, `y_train` and optionally `x_test`, `y_test` (the
    node's own test examples; without them the test split is empty), checked
    as a data set's splits are. The node needs no copy of a built-in data
    set: its inputs are normalised with the whole data set's statistics from
    `SPECS`, as the server's and the other nodes' are. A user's data set is
    defined by its loader, which every process may call: the node calls it
    for the examples' shape, classes and statistics (`_user_node_file`).
    """
    optional = SPLITS[2:]
    arrays = _read_npz(path, SPLITS[:2], optional, kind="a node data-file")
    present = [k for k in optional if k in arrays]
    if len(present) == 1:
        raise DataError(
            f"{path} holds {present[0]} without its pair; a node data-file holds "
            "both x_test and y_test (its own test examples) or neither"
        )
    if name not in SPECS:
        return _user_node_file(name, arrays, str(path))
    spec = _spec(name)
    if not present:
        c, s = spec.channels, spec.size
        arrays.update(x_test=np.zeros((0, c, s, s), np.uint8), y_test=np.zeros(0))
    _validate(
        spec, arrays, str(path), splits=("train", "test") if present else ("train",)
    )
    return _to_dataset(spec, arrays, str(path), spec_stats=True)


def _user_node_file(name: str, arrays: dict[str, np.ndarray], where: str) -> Dataset:
    """A node's own examples of a user's data set: each split checked as the
    loader's are, of the loader's example shape and kind, normalised with
    the statistics of the loader's training split, as the server's inputs
    and the other nodes' are."""
    import torch

    reference = user_dataset(name)
    like = reference.x_train.numpy()
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split in ("train", "test"):
        if f"x_{split}" not in arrays:  # no test split of its own
            splits[split] = (np.zeros((0, *like.shape[1:]), like.dtype), np.zeros(0))
            continue
        try:
            x, y = _user_split(arrays, split, reference.num_classes)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        if (x.dtype, x.shape[1:]) != (like.dtype, like.shape[1:]):
            raise DataError(
                f"{where}: x_{split} is {x.dtype} {list(x.shape[1:])} per example; "
                f"data-set {name!r} is {like.dtype} {list(like.shape[1:])}"
            )
        splits[split] = (x, y)
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["test"]
    if len(y_train) == 0:
        raise DataError(f"{where}: the train split is empty")
    return Dataset(
        name=name,
        num_classes=reference.num_classes,
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train.astype(np.int64)),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test.astype(np.int64)),
        mean=reference.mean,
        std=reference.std,
        source=where,
    )


USER_SPLITS = (*SPLITS, "classes")


@cache
def user_dataset(name: str) -> Dataset:
    """A user's data set (`pollen.extensions`): what its loader returns,
    checked and made a `Dataset` once per process.

    The loader takes no argument and returns a mapping of `x_train`,
    `y_train`, `x_test`, `y_test` (numpy arrays or torch tensors) and
    `classes` (how many). Images are uint8 `[N, H, W]` or `[N, C, H, W]`,
    normalised with the training split's statistics as pollen's own data
    sets are; features are floats `[N, F]` (seen as F channels of one
    pixel, as `synthetic`'s) or `[N, C, H, W]`, used as given. Labels are
    integers 0..classes-1. Every process that needs the data calls it, so
    it must return the same examples each time (seeded); one that runs
    past `ANNOUNCE_AFTER_S` is announced on stderr (`announced`), so a slow
    loader is not taken for a hang.
    """
    import torch

    loader = user_function("data-set", name, DATA_SET_GROUP)
    try:
        with announced(
            f"loading data set {name!r} ({_user_source(name)})",
            f"data set {name!r} loaded",
        ):
            returned = loader()
    except Exception as err:
        raise ExtensionError(
            f"data-set={name!r}: its loader raised {type(err).__name__}: {err}"
        ) from err
    try:
        arrays, classes = _user_arrays(returned)
    except DataError as err:
        raise ExtensionError(
            f"data-set={name!r}: {err}; a loader returns a mapping of "
            + ", ".join(USER_SPLITS)
            + " (docs/extending.md)"
        ) from None
    x_train = torch.from_numpy(arrays["x_train"])
    channels = x_train.shape[1]
    mean, std = (
        _channel_stats(x_train)
        if x_train.dtype == torch.uint8
        else ((0.0,) * channels, (1.0,) * channels)
    )
    return Dataset(
        name=name,
        num_classes=classes,
        x_train=x_train,
        y_train=torch.from_numpy(arrays["y_train"]),
        x_test=torch.from_numpy(arrays["x_test"]),
        y_test=torch.from_numpy(arrays["y_test"]),
        mean=mean,
        std=std,
        source=_user_source(name),
    )


def _user_source(name: str) -> str:
    """Where a user's data set came from, its import path where `name` is
    a registered name."""
    path = import_path(name, DATA_SET_GROUP)
    return "a user's loader" if path == name else f"a user's loader, {path}"


@cache
def user_data_set_info(name: str) -> DataSetInfo:
    """What the catalogue says of a user's data set, from what its loader
    returns (`pollen.extensions.data_set_info` asks this at run time)."""
    dataset = user_dataset(name)
    channels, height, width = dataset.input_shape
    path = str(import_path(name, DATA_SET_GROUP))
    return DataSetInfo(
        name=name,
        channels=channels,
        side=min(height, width),
        classes=dataset.num_classes,
        train_examples=len(dataset.y_train),
        summary=summary(user_function("data-set", name, DATA_SET_GROUP), path),
        training=USER_TRAINING,
    )


def _user_arrays(returned: object) -> tuple[dict[str, np.ndarray], int]:
    """A user loader's result as contiguous arrays (inputs `[N, C, H, W]`,
    labels int64) and its number of classes; `DataError` says what is wrong."""
    if not isinstance(returned, Mapping):
        raise DataError(f"its loader returned a {type(returned).__name__}")
    missing = [k for k in USER_SPLITS if k not in returned]
    if missing:
        raise DataError(f"its loader's mapping lacks {', '.join(missing)}")
    classes = returned["classes"]
    if isinstance(classes, bool | np.bool_) or not isinstance(classes, Integral):
        raise DataError(f"classes is {classes!r}; expected an integer >= 2")
    classes = int(classes)  # numpy's integers too (y_train.max() + 1)
    if classes < 2:
        raise DataError(f"classes is {classes!r}; expected an integer >= 2")
    arrays = {}
    for split in ("train", "test"):
        x, y = _user_split(returned, split, classes)
        if len(y) == 0:
            raise DataError(f"the {split} split is empty")
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x, y
    train, test = arrays["x_train"], arrays["x_test"]
    if (train.dtype, train.shape[1:]) != (test.dtype, test.shape[1:]):
        raise DataError(
            f"x_train is {train.dtype} {list(train.shape[1:])} per example, x_test "
            f"{test.dtype} {list(test.shape[1:])}; both splits need the same"
        )
    return arrays, classes


def _user_split(
    arrays: Mapping[str, Any], split: str, classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """`x_split`, `y_split` of a user's arrays as contiguous inputs `[N, C,
    H, W]` (uint8 images or float32 features) and int64 labels in
    0..classes-1; `DataError` says what is wrong."""
    x = np.asarray(arrays[f"x_{split}"])
    y = np.asarray(arrays[f"y_{split}"])
    if x.dtype == np.uint8 and x.ndim == 3:
        x = x[:, None]
    elif np.issubdtype(x.dtype, np.floating) and x.ndim == 2:
        x = x[:, :, None, None]
    elif x.ndim == 4 and x.shape[3] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)  # channels last, as a Keras .npz keeps images
    if x.ndim != 4 or not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)):
        raise DataError(
            f"x_{split} is {x.dtype} of shape {list(x.shape)}; expected uint8 "
            "images [N, H, W] or [N, C, H, W], or float features [N, F] or "
            "[N, C, H, W]"
        )
    if x.dtype != np.uint8:
        x = x.astype(np.float32, copy=False)  # finite as trained: 1e39 is not
        if not np.isfinite(x).all():
            raise DataError(f"x_{split} holds values that are not finite in float32")
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise DataError(
            f"y_{split} is {y.dtype} of shape {list(y.shape)}; expected "
            f"integer labels [{len(x)}], one per example of x_{split}"
        )
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise DataError(
            f"y_{split} has labels {y.min()}..{y.max()}; classes={classes} "
            f"allows 0..{classes - 1}"
        )
    dtype = np.uint8 if x.dtype == np.uint8 else np.float32
    return (
        np.ascontiguousarray(x, dtype=dtype),
        np.ascontiguousarray(y, dtype=np.int64),
    )


def _spec(name: str) -> DataSpec:
    spec = SPECS.get(name)
    if spec is None:
        raise DataError(f"unknown data set {name!r}; allowed: {', '.join(SPECS)}")
    return spec


@cache
def _digits_dataset() -> Dataset:
    return _to_dataset(SPECS["digits"], _digits(), "scikit-learn digits")


@cache
def _load_cached(
    spec: DataSpec,
    root: Path,
    download: bool,
    source: Path | None,
    fingerprint: tuple[tuple[str, object], ...] | None,
) -> Dataset:
    """Decode (or read from the disk cache) once per process and source version."""
    arrays, where = _arrays_from_sources(
        spec, root, download, source, dict(fingerprint) if fingerprint else None
    )
    return _to_dataset(spec, arrays, where)


def cache_root(data_root: str | Path) -> Path:
    """Where decoded data sets and shards are kept: `$POLLEN_CACHE_DIR` when it
    is set (a writable place for a read-only data-root, as in the containers),
    otherwise `.pollen-cache` beside the data."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    return Path(data_root).expanduser().resolve() / CACHE_DIR


def partition_cache(data_root: str | Path) -> Path:
    """Where shards computed from the data sets under `data_root` are kept."""
    return cache_root(data_root) / "partitions"


def _arrays_from_sources(
    spec: DataSpec,
    root: Path,
    download: bool,
    source: Path | None,
    fingerprint: dict[str, object] | None,
) -> tuple[dict[str, np.ndarray], str]:
    cache_dir = cache_root(root) / spec.name
    damage = ""
    try:
        cached = _read_cache(spec, cache_dir, fingerprint)
    except DataError as err:
        cached, damage = None, str(err)
    if cached is not None:
        arrays, decoded_from = cached
        return arrays, f"{cache_dir} (decoded from {decoded_from})"
    if source is not None:
        if damage:
            warnings.warn(f"{damage}; decoding {source} again", stacklevel=2)
        arrays = _decode(spec, source)
    elif download:
        arrays = _download(spec, root)
        source = root / "torchvision"
    else:
        stems = " or ".join(_stems(spec))
        raise DataError(
            f"no data for {spec.name!r} in {root}: expected {stems}.npz, an image "
            f"folder {stems}/ or {stems}.tar.gz; set download=true to fetch it"
            + (f" ({damage})" if damage else "")
        )
    _validate(spec, arrays, str(source))
    _write_cache(cache_dir, arrays, fingerprint, str(source))
    return arrays, str(source)


def _stems(spec: DataSpec) -> list[str]:
    stems = [spec.name]
    if "-" in spec.name:
        stems.append(spec.name.replace("-", "_"))
    return stems


def _find_local_source(spec: DataSpec, root: Path) -> Path | None:
    for stem in _stems(spec):
        for candidate in (
            root / f"{stem}.npz",
            root / stem,
            root / f"{stem}.tar.gz",
            root / f"{stem}-jpeg.tar.gz",
        ):
            if candidate.exists():
                return candidate
    return None


def _fingerprint(path: Path) -> dict[str, object]:
    """What the decoded cache is valid for: a file's size and modification
    time; an image folder's every file (relative path, size, modification
    time in ns), digested, since adding or replacing an image changes its
    class folder or the image, never the top folder."""
    stat = path.stat()
    if not path.is_dir():
        return {"path": str(path), "size": stat.st_size, "mtime": stat.st_mtime}
    digest = hashlib.sha256()
    count = 0
    for line in _folder_files(path, ""):
        digest.update(line.encode())
        count += 1
    return {"path": str(path), "files": count, "digest": digest.hexdigest()}


def _folder_files(folder: Path | str, prefix: str) -> Iterator[str]:
    """One line per file under `folder`: its path below the top folder, size
    and modification time. A folder's files by name come first, then its
    subfolders by name, as `os.walk` visits them. `os.scandir` gives each
    entry's type without a system call: a CIFAR-10 folder (60,000 files)
    takes 0.24 s here against 0.80 s through `os.walk` and `Path`
    (2026-12-05), paid once by every process that loads it."""
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        if (
            entry.is_file()
        ):  # follows links; a dangling one is skipped, as the decoder does
            info = entry.stat()
            yield f"{prefix}{entry.name}\0{info.st_size}\0{info.st_mtime_ns}\n"
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _folder_files(entry.path, f"{prefix}{entry.name}/")


def _read_cache(
    spec: DataSpec, cache_dir: Path, fingerprint: dict[str, object] | None
) -> tuple[dict[str, np.ndarray], str] | None:
    """The cached arrays and the source they were decoded from, if still valid.

    None when there is no cache or it is stale (other version or source);
    `DataError` when it is damaged: a file missing, unreadable or not matching
    the CRC-32 written with it, or arrays that fail `_validate`.
    """
    meta_path = cache_dir / "source.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise DataError("source.json does not hold a JSON object")
        if meta.get("version") != CACHE_VERSION:
            return None
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            return None
        for k in SPLITS:
            if _crc32(cache_dir / f"{k}.npy") != meta["checksums"][k]:
                raise DataError(f"{k}.npy does not match the CRC-32 written with it")
        arrays = {k: np.load(cache_dir / f"{k}.npy", mmap_mode="r") for k in SPLITS}
        _validate(spec, arrays, str(cache_dir))
        return arrays, str(meta["source"])
    except (OSError, ValueError, KeyError, TypeError) as err:  # DataError too
        raise DataError(f"decoded cache {cache_dir} is damaged: {err}") from err


def _crc32(path: Path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (read in 4 MiB chunks)."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _write_cache(
    cache_dir: Path,
    arrays: dict[str, np.ndarray],
    fingerprint: dict[str, object] | None,
    source: str,
) -> None:
    """Write the decoded arrays next to the data, atomically (tmp dir + rename)."""
    tmp = cache_dir.with_name(f".{cache_dir.name}.tmp-{np.random.randint(1 << 30)}")
    try:
        tmp.mkdir(parents=True)
        for k in SPLITS:
            np.save(tmp / f"{k}.npy", np.ascontiguousarray(arrays[k]))
        meta = {
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "source": source,
            "checksums": {k: _crc32(tmp / f"{k}.npy") for k in SPLITS},
        }
        (tmp / "source.json").write_text(json.dumps(meta))
        shutil.rmtree(cache_dir, ignore_errors=True)
        tmp.rename(cache_dir)
    except OSError:
        pass  # read-only data-root: the next run decodes again, nothing breaks
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _decode(spec: DataSpec, source: Path) -> dict[str, np.ndarray]:
    if source.suffix == ".npz":
        return _read_npz(source)
    if source.is_dir():
        return _read_image_folder_dir(spec, source)
    return _read_image_folder_archive(spec, source)


def _read_npz(
    path: Path,
    keys: tuple[str, ...] = SPLITS,
    optional: tuple[str, ...] = (),
    kind: str = "a Keras-layout .npz",
) -> dict[str, np.ndarray]:
    """The arrays `keys`, and those of `optional` it has, of a .npz (`kind`
    names what it should be); `DataError` for anything else."""
    holds = ", ".join(keys) + (
        f", optionally {', '.join(optional)}" if optional else ""
    )
    try:
        arrays = read_npz(path)
    except FileNotFoundError as err:
        raise DataError(
            f"cannot read {path}: no such file; {kind} holds {holds}"
        ) from err
    except NpzError as err:
        raise DataError(f"{err}; {kind} holds {holds}") from err
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {kind} holds {holds}")
    return {k: arrays[k] for k in (*keys, *optional) if k in arrays}


def _decode_image(data: bytes | Path, spec: DataSpec, where: str) -> np.ndarray:
    """One image file as uint8 `[H, W]` or `[H, W, 3]`; `DataError` naming it."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return np.asarray(im.convert("L" if spec.channels == 1 else "RGB"))
    except Image.UnidentifiedImageError as err:
        raise DataError(
            f"cannot decode image {where}: not an image format Pillow reads "
            "(JPEG, PNG, ...); the file is corrupted or not an image"
        ) from err
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(
            f"cannot decode image {where}: {err}; the file is truncated or "
            "corrupted, replace or remove it"
        ) from err


def _stack_split(
    items: list[tuple[str, str, np.ndarray]], folders: set[str], where: str
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(class name, file name, image) triples -> arrays ordered by class, file.

    The classes are the class `folders` (label = position in sorted order),
    every one of which must hold an image: an empty one left out would shift
    every later label down by one without a word.
    """
    if not items:
        raise DataError(f"{where} holds no images")
    classes = sorted(folders | {c for c, _, _ in items})
    empty = sorted(set(classes) - {c for c, _, _ in items})
    if empty:
        raise DataError(
            f"{where}: class folder {empty[0]!r} holds no images; every class "
            "needs images in train/ and test/ (labels are the sorted folder "
            "names: leaving one out would renumber the others)"
        )
    items.sort(key=lambda t: (t[0], t[1]))
    index = {c: i for i, c in enumerate(classes)}
    shapes = {im.shape for _, _, im in items}
    if len(shapes) != 1:
        raise DataError(f"{where}: images differ in size: {sorted(shapes)[:3]}")
    x = np.stack([im for _, _, im in items])
    y = np.array([index[c] for c, _, _ in items], dtype=np.int64)
    return x, y, classes


def _read_image_folder_dir(spec: DataSpec, root: Path) -> dict[str, np.ndarray]:
    base = _split_parent(p.relative_to(root).as_posix() for p in root.rglob("*"))
    splits = {}
    for split in ("train", "test"):
        folder = root / base / split
        items = [
            (p.parent.name, p.name, _decode_image(p, spec, str(p)))
            for p in folder.glob("*/*")
            if p.is_file()
        ]
        folders = {p.name for p in folder.glob("*") if p.is_dir()}
        splits[split] = _stack_split(items, folders, str(folder))
    return _folder_arrays(spec, splits, str(root))


def _read_image_folder_archive(spec: DataSpec, path: Path) -> dict[str, np.ndarray]:
    try:
        with tarfile.open(path, "r:*") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            base = _split_parent([m.name for m in members])
            items: dict[str, list] = {"train": [], "test": []}
            folders: dict[str, set[str]] = {"train": set(), "test": set()}
            for m in tar.getmembers():  # a class folder may be empty
                parts = m.name[len(base) :].strip("/").split("/")
                if m.isdir() and len(parts) == 2 and parts[0] in folders:
                    folders[parts[0]].add(parts[1])
            for m in members:
                parts = m.name[len(base) :].lstrip("/").split("/")
                if len(parts) != 3 or parts[0] not in items:
                    continue
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                image = _decode_image(data, spec, f"{path}:{m.name}")
                items[parts[0]].append((parts[1], parts[2], image))
            _check_archive_end(tar, path, len(members))
    except (tarfile.TarError, zlib.error, EOFError, OSError) as err:
        raise DataError(
            f"cannot read {path}: truncated, corrupted or not a tar archive ({err})"
        ) from err
    splits = {
        s: _stack_split(v, folders[s], f"{path}:{base}{s}/") for s, v in items.items()
    }
    return _folder_arrays(spec, splits, str(path))


def _check_archive_end(tar: tarfile.TarFile, path: Path, members: int) -> None:
    """Refuse an archive whose member list ended at a damaged header.

    `tarfile` ends the listing silently at the first unreadable header, so
    what follows the last member must be the zero end-of-archive padding.
    Reading it to the end also makes gzip (bz2, xz) check its CRC.
    """
    f = tar.fileobj
    assert f is not None
    f.seek(tar.offset)
    while chunk := f.read(1 << 20):
        if chunk.strip(b"\0"):
            raise DataError(
                f"cannot read {path}: damaged tar archive, the listing stops after "
                f"{members} files at a header that is neither a file nor the end "
                "of the archive; re-create or re-download it"
            )


def _split_parent(names: Iterable[str]) -> str:
    """The folder (prefix ending in '/', or '') that holds `train/` and `test/`."""
    for name in names:
        parts = name.split("/")
        for i, part in enumerate(parts[:-1]):
            if part in ("train", "test"):
                return "/".join(parts[:i]) + ("/" if i else "")
    raise DataError("image folder has no train/<class>/ and test/<class>/ folders")


def _folder_arrays(spec: DataSpec, splits: dict, where: str) -> dict[str, np.ndarray]:
    """The two splits' arrays, once their class folders are the same names
    and as many as the data set has classes."""
    (x_tr, y_tr, c_tr), (x_te, y_te, c_te) = splits["train"], splits["test"]
    if c_tr != c_te:
        only = sorted(set(c_tr) ^ set(c_te))
        raise DataError(
            f"{where}: train and test class folders differ ({only[0]!r} is in "
            "one only); both splits need the same class folders"
        )
    if len(c_tr) != spec.num_classes:
        raise DataError(
            f"{where}: {len(c_tr)} class folders ({', '.join(c_tr[:4])}"
            f"{', ...' if len(c_tr) > 4 else ''}); {spec.name} has "
            f"{spec.num_classes} classes, one folder each in train/ and test/"
        )
    return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}


def _download(spec: DataSpec, root: Path) -> dict[str, np.ndarray]:
    import torchvision.datasets

    cls = getattr(torchvision.datasets, spec.torchvision_class or "")
    target = root / "torchvision"
    made = not target.exists()
    try:
        parts = [cls(str(target), train=t, download=True) for t in (True, False)]
    except Exception as err:  # urllib, HTTP and checksum errors all end here
        if made:  # nothing half-downloaded is left to pass for data
            shutil.rmtree(target, ignore_errors=True)
        raise DataError(
            f"download of {spec.name!r} failed ({type(err).__name__}: {err}); put "
            f"{spec.name}.npz in {root} or check the network"
        ) from err
    out = {}
    for split, ds in zip(("train", "test"), parts, strict=True):
        out[f"x_{split}"] = np.asarray(ds.data)
        out[f"y_{split}"] = np.asarray(ds.targets)
    return out


def _digits() -> dict[str, np.ndarray]:
    """scikit-learn's digits, pixels 0..16 rescaled to 0..255, fixed 80/20 split."""
    table = _digits_table()
    x = np.clip(np.rint(table[:, :-1] * 255 / 16), 0, 255).astype(np.uint8)
    x, y = x.reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    n_train = int(0.8 * len(y))
    tr, te = order[:n_train], order[n_train:]
    return {"x_train": x[tr], "y_train": y[tr], "x_test": x[te], "y_test": y[te]}


def _digits_table() -> np.ndarray:
    """The digits as rows of 64 pixels (0..16) and a label.

    Read straight from the CSV that scikit-learn ships, the file its
    `load_digits` reads (20 ms): importing `sklearn.datasets` costs about
    1.1 s of CPU, which every process that loads the digits would pay (the
    ServerApp, each ClientApp actor, each message of a deployed ClientApp).
    A scikit-learn that keeps the file elsewhere is asked through
    `load_digits`.
    """
    package = importlib.util.find_spec("sklearn")  # finds it, does not import it
    if package is not None and package.origin is not None:
        csv = Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            return np.loadtxt(csv, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def _image_shapes(spec: DataSpec) -> list[tuple[int, ...]]:
    """The shapes one image may have: HW (grey only), HWC or CHW.

    A data set's channels (1, 3) never equal its size, so HWC and CHW are
    told apart by their shape alone.
    """
    c, s = spec.channels, spec.size
    return ([(s, s)] if c == 1 else []) + [(s, s, c), (c, s, s)]


def _validate(
    spec: DataSpec,
    arrays: dict[str, np.ndarray],
    where: str,
    splits: tuple[str, ...] = ("train", "test"),
) -> None:
    shapes = [f"[N, {', '.join(map(str, shape))}]" for shape in _image_shapes(spec)]
    expected = ", ".join(shapes[:-1]) + f" or {shapes[-1]}"
    for split in splits:
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8:
            raise DataError(
                f"{where}: x_{split} has dtype {x.dtype}; expected uint8 pixels 0..255"
            )
        if x.shape[1:] not in _image_shapes(spec):
            raise DataError(
                f"{where}: x_{split} has shape {list(x.shape)}; {spec.name} needs "
                f"{expected}"
            )
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(
                f"{where}: y_{split} has shape {list(y.shape)}; expected [{len(x)}], "
                f"one label per image of x_{split}"
            )
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: y_{split} has dtype {y.dtype}; expected ints")
        if len(y) == 0:
            raise DataError(f"{where}: {split} split is empty")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= spec.num_classes:
            raise DataError(
                f"{where}: y_{split} has labels {low}..{high}; {spec.name} has "
                f"classes 0..{spec.num_classes - 1}"
            )


def _to_dataset(
    spec: DataSpec,
    arrays: dict[str, np.ndarray],
    source: str,
    spec_stats: bool = False,
) -> Dataset:
    """Validated arrays as a `Dataset`, normalised with its training split's
    statistics (or, with `spec_stats`, with those in `spec`)."""
    import torch

    def images(x: np.ndarray) -> torch.Tensor:
        x = np.array(x)  # a private, writable copy (the cache is memory-mapped)
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[1:] != (spec.channels, spec.size, spec.size):
            x = x.transpose(0, 3, 1, 2)
        return torch.from_numpy(np.ascontiguousarray(x))

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(y).astype(np.int64))

    x_train = images(arrays["x_train"])
    mean, std = (spec.mean, spec.std) if spec_stats else _channel_stats(x_train)
    return Dataset(
        name=spec.name,
        num_classes=spec.num_classes,
        x_train=x_train,
        y_train=labels(arrays["y_train"]),
        x_test=images(arrays["x_test"]),
        y_test=labels(arrays["y_test"]),
        mean=mean,
        std=std,
        source=source,
    )


def _channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images, in chunks to bound memory."""
    import torch

    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for chunk in x.split(4096):
        c = chunk.transpose(0, 1).reshape(x.shape[1], -1).double() / 255.0
        total += c.sum(1)
        squares += (c * c).sum(1)
    n = x.numel() / x.shape[1]
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(1e-12).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())

"""Server-side checkpoints of a federated run, in a format that never runs code.

A checkpoint of round r lives in `<run-dir>/checkpoints/round-<r:05d>/`:

- `model.npz`: the global model, name -> array, every dtype kept exactly;
- `strategy.npz`: the strategy's server-side state (momentum, FedDyn's h, ...),
  name -> array, possibly empty;
- `meta.json`: the format version, the round and the caller's `extra` dict
  (scheduler state, settings fingerprint, model name, ...).

Arrays are stored with `numpy.lib.format` and read back with
`allow_pickle=False`, so no pickle is written or loaded, and object arrays are
refused on both sides. Array names are percent-encoded into the archive's
member names, so any name ("m/features.0.weight") survives the round trip.

A checkpoint is written into a temporary sibling directory and renamed into
place, `meta.json` last: a directory with the final name and a `meta.json` is
complete, anything else is ignored by the readers and swept up by the next
save. Only the newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pollen import files
from pollen.common.few import few
from pollen.files import write_json, write_npz
from pollen.presets import resolve_auto
from pollen.settings import INVOCATION_KEYS, Settings

from . import lr_schedule

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.npz"
STRATEGY_FILE = "strategy.npz"
META_FILE = "meta.json"

_ROUND = r"(\d{5}|[1-9]\d{5,})"  # as f"{r:05d}" writes it, nothing else
_FINAL = re.compile(rf"round-{_ROUND}")
# `.tmp`: being written; `.old`: the copy a re-save of the same round replaces
_TEMPORARY = re.compile(rf"\.round-{_ROUND}\.(tmp|old)")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or cannot be written as asked."""


@dataclass(frozen=True, eq=False)  # arrays have no single truth value: no __eq__
class Checkpoint:
    """The server's state after `round`: enough to resume the run."""

    round: int
    model: dict[str, np.ndarray]
    strategy_state: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(run_dir: Path, round: int) -> Path:
    """Where the checkpoint of `round` lives (whether or not it exists)."""
    return Path(run_dir) / CHECKPOINTS / f"round-{round:05d}"


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint, keep: int) -> Path:
    """Write `checkpoint`, then keep only the newest `keep` checkpoints.

    An existing checkpoint of the same round is replaced: the new one is
    written in full first, then swapped in. The one just written is never
    deleted; the others kept are the `keep - 1` of highest round. Returns the
    checkpoint's directory.
    """
    r = checkpoint.round
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"checkpoint round must be an int >= 0, got {r!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    model = _checked_arrays(checkpoint.model, "model")
    state = _checked_arrays(checkpoint.strategy_state, "strategy_state")
    if not isinstance(checkpoint.extra, dict):
        raise CheckpointError(
            f"checkpoint extra must be a dict, got {checkpoint.extra!r}"
        )
    meta = {"format-version": FORMAT_VERSION, "round": r, "extra": checkpoint.extra}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint extra is not JSON-able: {err}") from err

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _tidy(root)
    final = checkpoint_dir(run_dir, r)
    tmp = root / f".{final.name}.tmp"
    old = root / f".{final.name}.old"
    tmp.mkdir()  # _tidy removed any leftover
    try:
        write_npz(tmp / MODEL_FILE, model)
        write_npz(tmp / STRATEGY_FILE, state)
        write_json(tmp / META_FILE, meta)  # last: marks the checkpoint complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # POSIX renames a directory over an empty one only: move the old copy
    # aside first; the readers fall back to it if a crash comes in between.
    files.sync_folder(tmp)  # on the disk before any older copy goes
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    files.sync_folder(root)
    if old.exists():
        _remove(old)

    complete = _complete(root)
    others = sorted(n for n in complete if n != r)
    for n in others[: max(0, len(others) - (keep - 1))]:
        _remove(complete[n])
    return final


def list_checkpoints(run_dir: Path) -> list[int]:
    """The rounds that have a complete checkpoint, in increasing order."""
    root = Path(run_dir) / CHECKPOINTS
    return sorted(_complete(root)) if root.is_dir() else []


def load_checkpoint(run_dir: Path, round: int | None = None) -> Checkpoint:
    """Read the checkpoint of `round`, or the latest one when `round` is None."""
    round, where = _locate(run_dir, round)
    meta = _read_meta(where / META_FILE, round)
    return Checkpoint(
        round=round,
        model=read_npz(where / MODEL_FILE),
        strategy_state=read_npz(where / STRATEGY_FILE),
        extra=meta["extra"],
    )


def first_difference(
    recorded: Mapping[str, Any], run_config: Mapping[str, Any], ignored: Collection[str]
) -> str | None:
    """The first key (in sorted order, outside `ignored`) whose value in
    `run_config` differs from the one a run recorded, or None: whether a saved
    run computed what `run_config` asks (a resume, a finished comparison
    cell). A key the run did not record was added to pollen since, so the
    run had its default, or for an "auto" key its preset's value."""
    defaults = {key: default for key, default, _, _ in Settings.describe()}
    resolved = {**defaults, **recorded}
    with contextlib.suppress(KeyError):  # a record too old to name its strategy
        resolved = resolve_auto(resolved)
    for key in sorted(run_config):
        then = recorded.get(key, resolved.get(key))
        if key not in ignored and then != run_config[key]:
            return key
    return None


def _locate(run_dir: Path, round: int | None) -> tuple[int, Path]:
    """(round, directory) of the complete checkpoint asked for (None: latest)."""
    root = Path(run_dir) / CHECKPOINTS
    found = _complete(root) if root.is_dir() else {}
    if round is not None and round not in found:
        incomplete = checkpoint_dir(run_dir, round)
        if incomplete.is_dir():
            raise CheckpointError(
                f"{incomplete / META_FILE} is missing: the checkpoint of round "
                f"{round} is incomplete"
            )
    if not found:
        incomplete = sorted(root.glob("round-*/")) if root.is_dir() else []
        raise CheckpointError(
            f"no checkpoint in {root}; {_why_none(Path(run_dir))}"
            + "".join(f"; {p.name} has no {META_FILE} (incomplete)" for p in incomplete)
        )
    if round is None:
        round = max(found)
    if round not in found:
        rounds = ", ".join(map(str, sorted(found)))
        raise CheckpointError(
            f"no checkpoint of round {round} in {root} (rounds with one: {rounds})"
        )
    return round, found[round]


def recorded_checkpoint_every(run_dir: Path) -> int | None:
    """The `checkpoint-every` the run in `run_dir` ran with (its
    `settings.json`), None where that cannot be read."""
    try:
        every = json.loads((run_dir / "settings.json").read_text()).get(
            "checkpoint-every"
        )
    except (OSError, ValueError, AttributeError):
        return None
    return every if isinstance(every, int) and not isinstance(every, bool) else None


def _why_none(run_dir: Path) -> str:
    """Why `run_dir` holds no checkpoint, as far as its settings say: a run
    that checkpoints may have stopped before it wrote one."""
    every = recorded_checkpoint_every(run_dir)
    if every is not None and every > 0:
        return f"the run stopped before it wrote one (checkpoint-every={every})"
    if every == 0:
        return "the run has checkpoint-every=0, which writes none"
    return "a run writes them when checkpoint-every > 0"


# Run-config keys that may differ between a checkpointed run and the run
# resuming it; any other difference would make the resumed run a different one
# (how often clients evaluate their own models changes no model or state).
RESUMABLE_CHANGES = frozenset(
    {"rounds", "resume", "notify-url", "notify-every", "checkpoint-every",
     "checkpoint-keep", "device", "output-dir", "run-name", "data-root",
     "personal-eval-every", "tracker", "tracking-uri", "tracking-experiment",
     "state-memory-mib"}
) | INVOCATION_KEYS  # fmt: skip


def check_resumable(run_dir: Path, run_config: dict[str, Any]) -> int:
    """The round of `run_dir`'s latest checkpoint, if `run_config` may
    continue it (`load_resumable`)."""
    return load_resumable(run_dir, run_config).round


def load_resumable(run_dir: Path, run_config: dict[str, Any]) -> Checkpoint:
    """The latest checkpoint of `run_dir`, if `run_config` may continue it.

    Reads the whole checkpoint, each file once: `meta.json`, and the model
    and strategy state in full (a truncated or damaged file is named now,
    not after the run's start-up). The checkpoint keeps the run config that
    wrote it (`extra["settings"]`); a difference outside `RESUMABLE_CHANGES`
    is refused, naming the key.
    """
    round, where = _locate(run_dir, None)
    model, state = (read_npz(where / name) for name in (MODEL_FILE, STRATEGY_FILE))
    extra = _read_meta(where / META_FILE, round)["extra"]
    _check_continues(run_dir, where, round, extra, run_config)
    return Checkpoint(round, model, state, extra)


def _check_continues(
    run_dir: Path,
    where: Path,
    round: int,
    extra: dict[str, Any],
    run_config: dict[str, Any],
) -> None:
    """Refuse `run_config` as a continuation of the checkpoint of `round`
    (in `where`, whose `extra` is given): a record without its run's
    settings or with a damaged schedule, a change outside
    `RESUMABLE_CHANGES`, client state it would leave behind, no round left."""
    saved = extra.get("settings")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{where / META_FILE} does not record the settings of its run"
        )
    if problem := lr_schedule.state_problem(extra.get(lr_schedule.SCHEDULE_KEY)):
        raise CheckpointError(
            f"{where / META_FILE}: its {lr_schedule.SCHEDULE_KEY!r} entry {problem}"
        )
    key = first_difference(saved, run_config, RESUMABLE_CHANGES)
    if key is not None:
        raise CheckpointError(
            f"invalid value for 'resume': the checkpoint of round "
            f"{round} was written with {key}={saved.get(key)!r}, this "
            f"run has {key}={run_config[key]!r}; only "
            f"{', '.join(sorted(RESUMABLE_CHANGES))} may change"
        )
    if saved.get("checkpoint-every") and run_config.get("checkpoint-every") == 0:
        _check_client_state_kept(round, saved["checkpoint-every"], run_config)
    if round >= run_config["rounds"]:
        raise CheckpointError(
            f"invalid value for 'resume': {run_dir} has a checkpoint of round "
            f"{round} and the run has rounds={run_config['rounds']}; "
            "raise rounds to train further"
        )


def model_problem(
    checkpoint: Checkpoint, built: Collection[str], model: str
) -> str | None:
    """Why `checkpoint`'s global model is not model `model` as the run builds
    it, or None: the entries the built model has and the checkpoint lacks
    (added), those the checkpoint has and the model lacks (missing) and,
    where `built` maps each entry to its shape (not only names it), the
    entries of one name and two shapes (a layer resized). A user's factory
    edited between the runs (a layer renamed) leaves every setting the
    same, so only the entries tell; the command and the ServerApp refuse
    it in these words."""
    added = sorted(set(built) - set(checkpoint.model))
    missing = sorted(set(checkpoint.model) - set(built))
    shapes = built if isinstance(built, Mapping) else {}
    resized = [
        f"{name} {_shape(checkpoint.model[name].shape)} in the checkpoint, "
        f"{_shape(shapes[name])} in the model"
        for name in sorted(set(shapes) & set(checkpoint.model))
        if tuple(shapes[name]) != checkpoint.model[name].shape
    ]
    found = [
        f"{kind} {few(names)}{meaning}"
        for kind, names, meaning in (
            ("added", added, " (the model has, the checkpoint lacks)"),
            ("missing", missing, " (the checkpoint has, the model lacks)"),
            ("resized", resized, ""),
        )
        if names
    ]
    if not found:
        return None
    return (
        f"invalid value for 'resume': the entries of the checkpoint's model "
        f"(round {checkpoint.round}) are not those of model {model!r} as it is "
        f"built now: {'; '.join(found)}; resume with the model that wrote the "
        "checkpoint, or start a new run"
    )


def _shape(shape: Collection[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _check_client_state_kept(
    round: int, every: int, run_config: dict[str, Any]
) -> None:
    """Refuse to resume without checkpoints a run whose clients keep state
    of their own: its files were written with its checkpoints, and would
    stay at round `round` while the clients train on in memory; a later
    resume (from an interruption's checkpoint) would read them as current,
    or a spill would prune the ones the checkpoint needs."""
    if not Settings.from_run_config(run_config).clients_keep_state:
        return
    raise CheckpointError(
        f"invalid value for 'checkpoint-every': the checkpoint of round {round} "
        f"was written with checkpoint-every={every}, and its clients keep state "
        "of their own (local entries, a personal model, h_k or c_k), saved with "
        "the checkpoints; without them that state would stay at round "
        f"{round} while the clients train on; keep checkpoint-every > 0"
    )


def _checked_arrays(arrays: dict[str, Any], what: str) -> dict[str, np.ndarray]:
    """`arrays` as numpy arrays; refuse non-string names and object dtypes."""
    checked = {}
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{what}: array names must be str, got {name!r}")
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise CheckpointError(
                f"{what}[{name!r}] has dtype {array.dtype}: object arrays would "
                "need pickle, which checkpoints never use"
            )
        checked[name] = array
    return checked


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """What `write_npz` wrote, without pickle; `CheckpointError` otherwise."""
    try:
        return files.read_npz(path)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} is missing") from err
    except files.NpzError as err:
        raise CheckpointError(f"{err} (not a file pollen wrote)") from err


def _read_meta(path: Path, round: int) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    version = meta.get("format-version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this pollen "
            f"reads version {FORMAT_VERSION}"
        )
    if meta.get("round") != round:
        raise CheckpointError(
            f"{path} says round {meta.get('round')!r}, its directory round {round}"
        )
    if not isinstance(meta.get("extra"), dict):
        raise CheckpointError(f"{path}: 'extra' must be a JSON object")
    return meta


def _complete(root: Path) -> dict[int, Path]:
    """Round -> directory of every complete checkpoint under `root`.

    A `.old` copy stands in for its round only when a crash came between
    moving it aside and renaming its replacement into place.
    """
    final, old = {}, {}
    for path in root.iterdir():
        meta = path / META_FILE
        if not (meta.is_file() and meta.stat().st_size):  # empty: cut off mid-write
            continue
        if match := _FINAL.fullmatch(path.name):
            final[int(match[1])] = path
        elif (match := _TEMPORARY.fullmatch(path.name)) and match[2] == "old":
            old[int(match[1])] = path
    return {**old, **final}


def _tidy(root: Path) -> None:
    """Sweep up what a crash left: restore orphaned `.old` copies, drop the rest."""
    for r, path in _complete(root).items():
        if path.name.startswith("."):  # an orphaned `.old` copy
            target = root / f"round-{r:05d}"
            if target.exists():  # incomplete, or it would have won
                _remove(target)
            os.replace(path, target)
    for path in list(root.iterdir()):
        if path.is_dir() and (
            _TEMPORARY.fullmatch(path.name)
            or (_FINAL.fullmatch(path.name) and not (path / META_FILE).is_file())
        ):
            _remove(path)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory, `meta.json` first so that a crash midway
    never leaves something that looks complete."""
    (path / META_FILE).unlink(missing_ok=True)
    shutil.rmtree(path)

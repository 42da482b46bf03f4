"""A user's own parts: models, data sets, aggregators, server updates, objectives.

pollen is installed and extended, not forked: `model = "mypkg.nets:make_net"`
names a model factory and `data-set = "mypkg.data:load"` a data-set loader
(docs/extending.md gives their signatures); `aggregator`, `server-update`
and `local-objective` take a class by import path the same way, written as
pollen's own parts are (a `Rule`, a `ServerUpdate`, an objective part) and
loaded like them (`part`). An installed package may register any of them
under a short name in the entry-point groups `pollen.models`,
`pollen.data_sets`, `pollen.aggregators`, `pollen.server_updates` and
`pollen.local_objectives` of its pyproject.toml (a name two packages
register with different import paths is refused, naming both). This module
decodes such a name: the function it points at, and what the catalogue says of it (a
`DataSetInfo`, a `ModelInfo`). Only the user's code can tell that, so
`pollen.task` runs it (loads the data set, builds the model on the data
set's input shape) and is reached here at run time through its import path,
as `pollen.settings` reaches every part above it. Importable without torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, NamedTuple

from .catalog import (
    AGGREGATORS,
    DATA_SETS,
    LOCAL_OBJECTIVES,
    MODELS,
    SERVER_UPDATES,
    DataSetInfo,
    ModelInfo,
    Part,
    TrainingDefaults,
    load,
)

MODEL_GROUP = "pollen.models"
DATA_SET_GROUP = "pollen.data_sets"
# run-config key -> (the catalogue's parts, the entry-point group of a user's)
PART_KEYS: dict[str, tuple[dict[str, Part], str]] = {
    "aggregator": (AGGREGATORS, "pollen.aggregators"),
    "server-update": (SERVER_UPDATES, "pollen.server_updates"),
    "local-objective": (LOCAL_OBJECTIVES, "pollen.local_objectives"),
}
# the class a user's part of each key subclasses (docs/extending.md; reached
# at run time, as the catalogue's parts are)
PART_BASES = {
    "aggregator": "pollen.strategies.aggregation:Rule",
    "server-update": "pollen.strategies.server_update:ServerUpdate",
    "local-objective": "pollen.task.objective_parts:Plain",
}
# entry-point group -> the run-config key whose value it names
GROUP_KEYS = {
    MODEL_GROUP: "model",
    DATA_SET_GROUP: "data-set",
    **{group: key for key, (_, group) in PART_KEYS.items()},
}
# "package.module:function"
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
# what "auto" takes for a user's data set: mnist's and fashion-mnist's measured
# defaults (catalog.TrainingDefaults), a fair start for a small image task
USER_TRAINING = TrainingDefaults(lr=0.01)
# where pollen.task describes a user's part (floor 5, reached at run time)
_DESCRIBE_DATA_SET = "pollen.task.data:user_data_set_info"
_DESCRIBE_MODEL = "pollen.task.models:user_model_info"


class ExtensionError(ValueError):
    """A user's model or data set pollen cannot use; one line naming the key."""


class Registration(NamedTuple):
    """One installed package's entry point: the distribution that registers
    a name (as pip lists it) and the import path the name stands for."""

    distribution: str
    path: str


@cache
def registered(group: str) -> Mapping[str, tuple[Registration, ...]]:
    """The names installed packages register under entry-point `group`
    (`pollen.models`, `pollen.data_sets`, ...), each with who registers it
    and the import path it names: one `Registration`, or several, sorted,
    where packages give the name different import paths (`import_path`
    refuses such a name rather than pick one by path order). A name given
    the same import path again (a package visible twice on the path, the
    metadata a renamed package left behind) counts once.

    Read once per process and group: every check of a name that is not
    built in asks it, and a scan of the installed distributions' metadata
    takes milliseconds each time. A package installed while a process runs
    is seen by the next process (or after `registered.cache_clear()`)."""
    found: dict[str, dict[str, Registration]] = {}
    for point in entry_points(group=group):
        path = f"{point.module}:{point.attr}"  # "module:attr.attr", without extras
        # `entry_points` gives each point the distribution that registers it
        found.setdefault(point.name, {}).setdefault(
            path,
            Registration(point.dist.name, path),  # type: ignore[union-attr]
        )
    return MappingProxyType(
        {name: tuple(sorted(paths.values())) for name, paths in found.items()}
    )


def _clash(name: str, group: str, found: Sequence[Registration]) -> str:
    """One line for `name`, which installed packages register under `group`
    with different import paths: each package and its path, and the two
    ways out (keep one package, or name the part by its import path)."""
    key = GROUP_KEYS[group]
    each = [f"{r.distribution} as {r.path!r}" for r in found]
    return (
        f"{key}={name!r} is ambiguous: {len(found)} installed packages register "
        f"it under entry-point group {group}, {', '.join(each[:-1])} and "
        f"{each[-1]}; uninstall all but one, or name the one you mean by its "
        f"import path ({key}={found[0].path!r})"
    )


def import_path(name: str, group: str) -> str | None:
    """The import path that a user's part `name` stands for: `name` itself
    ("module:function"), or what an installed package registers under
    `group`; None for any other name. `ExtensionError` (`_clash`) for a name
    installed packages register with different import paths."""
    if IMPORT_PATH.fullmatch(name):
        return name
    found = registered(group).get(name, ())
    if len(found) > 1:
        raise ExtensionError(_clash(name, group, found))
    return found[0].path if found else None


def names_user_part(name: str, group: str) -> bool:
    """Whether `name` is an import path or a name registered under `group`.
    A name several packages register counts: a key's check accepts it, and
    loading the part (`import_path`) refuses it naming the packages."""
    return bool(IMPORT_PATH.fullmatch(name)) or name in registered(group)


def user_function(key: str, name: str, group: str) -> Callable[..., Any]:
    """The function a user's part `name` (run-config key `key`) names,
    imported; `ExtensionError` when it cannot be imported or called."""
    path = import_path(name, group)
    if path is None:
        raise ExtensionError(
            f"{key}={name!r} is neither built in, nor an import path "
            f"'module:function', nor a name registered under the entry-point "
            f"group {group}"
        )
    try:
        found = load(path)
    except Exception as err:  # the user's module runs on import: anything ends here
        raise ExtensionError(
            f"{key}={name!r}: cannot import {path!r} ({type(err).__name__}: {err}); "
            "it must be importable where pollen runs: installed, or its folder "
            "on PYTHONPATH (docs/extending.md)"
        ) from None
    if not callable(found):
        raise ExtensionError(
            f"{key}={name!r}: {path!r} is a {type(found).__name__}, not a function "
            "(docs/extending.md gives the signature)"
        )
    return found


def summary(function: Callable[..., Any], path: str) -> str:
    """The first line of a user function's docstring, or its import path."""
    doc = (function.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else path


def data_set_info(name: str) -> DataSetInfo:
    """What the catalogue says of data set `name`: a built-in's entry, or
    what a user's loader returns (loaded once per process);
    `ExtensionError` for a user's data set pollen cannot use."""
    if name in DATA_SETS:
        return DATA_SETS[name]
    return load(_DESCRIBE_DATA_SET)(name)


def model_info(name: str, data_set: str) -> ModelInfo:
    """What the catalogue says of model `name` for data set `data_set`: a
    built-in's entry, or what a user's model is when built on the data
    set's input shape (BatchNorm, LoRA, dropout layers; once per process);
    `ExtensionError` for a user's model that cannot take that data."""
    if name in MODELS:
        return MODELS[name]
    return load(_DESCRIBE_MODEL)(name, data_set)


def part(key: str, name: str) -> Part:
    """The part run-config `key` (aggregator, server-update, local-objective)
    names: the catalogue's, or a user's class named by import path or entry
    point, imported (`ExtensionError` where it cannot be)."""
    parts, group = PART_KEYS[key]
    if name in parts:
        return parts[name]
    implementation = user_function(key, name, group)
    base = load(PART_BASES[key])
    if not (isinstance(implementation, type) and issubclass(implementation, base)):
        raise ExtensionError(
            f"{key}={name!r} is no class subclassing "
            f"{PART_BASES[key].replace(':', '.')}, as a user's {key} must be "
            "(docs/extending.md)"
        )
    return Part(name, summary(implementation, name), str(import_path(name, group)))

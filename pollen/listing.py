"""What pollen offers, printed from the one declaration of each name.

`pollen list [SECTION]` prints the catalogue (`pollen.catalog`: strategy
presets and the parts they combine, models, data sets, partitions) and the
run-config keys (`pollen.settings.Settings.describe`); `pollen config KEY`
prints one key. Nothing here is a second list to keep in sync: a new part,
model or key appears here as soon as it is declared. Torch-free, so the
answer comes without loading a model.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Collection, Mapping, Sequence

from .catalog import (
    AGGREGATORS,
    ATTACKS,
    CENTRAL_DP,
    CLIENT_EXECUTIONS,
    DATA_SETS,
    LOCAL_OBJECTIVES,
    MODELS,
    PARTITIONS,
    PRESETS,
    SECURE_AGGREGATIONS,
    SERVER_UPDATES,
    SHARING_POLICIES,
    TRAINING_KEYS,
    ModelInfo,
    Scalar,
    assumed_training,
)
from .extensions import (
    DATA_SET_GROUP,
    MODEL_GROUP,
    USER_TRAINING,
    Registration,
    registered,
)
from .reference import app_defaults
from .settings import Settings, SettingsError


def _rows(pairs: list[tuple[str, str]], indent: int = 2) -> str:
    width = max(len(name) for name, _ in pairs)
    pad = " " * indent
    return "\n".join(f"{pad}{name:<{width}}  {text}".rstrip() for name, text in pairs)


def _preset_text(parts: Mapping[str, Scalar]) -> str:
    """A preset's parts and settings, then the client hyper-parameters its
    parts assume where the run config leaves them auto."""
    chosen = ", ".join(
        f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in parts.items()
    )
    assumed = assumed_training(
        SERVER_UPDATES[str(parts["server-update"])],
        LOCAL_OBJECTIVES[str(parts["local-objective"])],
    )
    if not assumed:
        return chosen
    return chosen + "; auto " + ", ".join(f"{k}={v:g}" for k, v in assumed.items())


def strategies() -> str:
    """Each preset and the parts (and settings) it chooses."""
    return _rows([(name, _preset_text(parts)) for name, parts in PRESETS.items()])


def parts() -> str:
    """The composable parts, by the key that chooses them."""
    sections = [
        ("server-update", [(p.name, p.summary) for p in SERVER_UPDATES.values()]),
        ("aggregator", [(p.name, p.summary) for p in AGGREGATORS.values()]),
        ("local-objective", [(p.name, p.summary) for p in LOCAL_OBJECTIVES.values()]),
        ("bn-policy / sharing", [(name, "") for name in SHARING_POLICIES]),
        ("central-dp", [(name, "") for name in CENTRAL_DP]),
        ("attack", [(name, "") for name in ATTACKS]),
        ("client-execution", list(CLIENT_EXECUTIONS.items())),
        ("secure-aggregation", list(SECURE_AGGREGATIONS.items())),
    ]
    return "\n".join(f"  {key}:\n{_rows(pairs, 4)}" for key, pairs in sections)


def _model_notes(info: ModelInfo) -> str:
    flags = [
        ("BatchNorm", info.batchnorm),
        ("dropout: no cohorts", info.dropout),
        ("LoRA", info.lora),
        (f"images of at least {info.min_side}px", info.min_side > 0),
        ("colour only", info.colour_only),
    ]
    marked = [label for label, on in flags if on]
    return f" ({', '.join(marked)})" if marked else ""


def _user_rows(
    group: str, what: str, built_in: Collection[str]
) -> list[tuple[str, str]]:
    """The names installed packages register under `group`, then the import
    path form: read from the packages' metadata, nothing imported."""
    return [
        *((name, _registered_text(found, name in built_in))
          for name, found in sorted(registered(group).items())),
        ("module:function", f"{what} of your own (docs/extending.md)"),
    ]  # fmt: skip


def _registered_text(found: Sequence[Registration], shadowed: bool) -> str:
    """What `pollen list` says of a registered name: the import path it
    names, or, where packages give it different ones, each with its package
    and the name refused (listed, not raised: a clash the user does not use
    must not stop the listing); a built-in of the name wins over either."""
    note = ""
    if shadowed:
        note = "; not used: the built-in of this name wins"
    elif len(found) > 1:
        note = "; refused by name: give an import path"
    if len(found) == 1:
        return f"{found[0].path} (an installed package's{note})"
    each = ", ".join(f"{r.path} by {r.distribution}" for r in found)
    return f"ambiguous: {each} (installed packages'{note})"


def models() -> str:
    return _rows(
        [(m.name, m.summary + _model_notes(m)) for m in MODELS.values()]
        + _user_rows(MODEL_GROUP, "a model factory", MODELS)
    )


def datasets() -> str:
    return _rows(
        [
            (
                d.name,
                f"{d.summary}; {d.channels}x{d.side}x{d.side}, {d.classes} classes",
            )
            for d in DATA_SETS.values()
        ]
        + _user_rows(DATA_SET_GROUP, "a data-set loader", DATA_SETS)
    )


def partitions() -> str:
    return _rows([(name, "") for name in PARTITIONS])


def keys() -> str:
    run = app_defaults()  # pollen's pyproject.toml, read once
    return _rows([(key, f"{_default(run.get(key, default), default)}: {text}")
                  for key, default, text, _ in Settings.describe()])  # fmt: skip


def _default(run: object, declared: object) -> str:
    """A key's default as a run of pollen's app gets it (`run`, from its
    pyproject.toml's `[tool.flwr.app.config]`), and the declaration's where
    that differs."""
    if run == declared:
        return repr(declared)
    return f"{run!r} (an app whose pyproject.toml does not set it: {declared!r})"


SECTIONS: dict[str, Callable[[], str]] = {
    "strategies": strategies,
    "parts": parts,
    "models": models,
    "datasets": datasets,
    "partitions": partitions,
    "keys": keys,
}


def listing(section: str | None = None) -> str:
    """One section, or every section but the keys (`pollen list keys`)."""
    chosen = [section] if section else [s for s in SECTIONS if s != "keys"]
    return "\n\n".join(f"{name}:\n{SECTIONS[name]()}" for name in chosen)


def describe_key(name: str) -> str:
    """A key's type, default, allowed values and help; a close match for a typo."""
    table = {
        key: (default, text, allowed)
        for key, default, text, allowed in Settings.describe()
    }
    if name not in table:
        close = difflib.get_close_matches(name, table, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SettingsError(
            f"unknown run-config key {name!r}{hint} (`pollen list keys`)"
        )
    default, text, allowed = table[name]
    field = next(
        f for f in dataclasses.fields(Settings) if f.name == name.replace("-", "_")
    )
    lines = [
        f"{name}: {text}",
        f"  type: {field.metadata['kind'].__name__}",
        f"  default: {_default(app_defaults().get(name, default), default)}",
        f"  allowed: {allowed or 'any'}",
    ]
    if name in TRAINING_KEYS:  # "auto": a part's assumption, else the data set's
        parts = [
            f"{part.name} {part.training[name]:g}"
            for part in (*SERVER_UPDATES.values(), *AGGREGATORS.values(),
                         *LOCAL_OBJECTIVES.values())
            if name in part.training
        ]  # fmt: skip
        if parts:
            lines.append("  auto, by part (before the data set's): " + ", ".join(parts))
        lines.append(
            "  auto, by data set: "
            + ", ".join(
                f"{data_set} {info.training.describe(name)}"
                for data_set, info in DATA_SETS.items()
            )
            + f", a user's {USER_TRAINING.describe(name)}"
        )
    return "\n".join(lines)

"""A run's configuration as `pollen` commands resolve it before anything runs.

The app's pyproject defaults, then each `--run-config` value in order, then
validation by `Settings`; paths are pinned against the shell's directory and
the run gets its name here, so the command that submits a run knows where
its results land (the SuperLink's processes run elsewhere).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..catalog import BACKBONE_SOURCES, DATA_SETS
from ..common.webhook import URL_ENV, check_url
from ..files import readable_folder_problem
from ..keys import tracking_uri_rule, unknown_key_message
from ..presets import departures
from ..runs.checkpoints import load_resumable
from ..runs.results import check_run_dir_is_new, default_run_name
from ..runs.tracking_mlflow import URI_ENV, check_server, pin_uri, tracking_uri
from ..settings import Settings, SettingsError
from .model_checks import (
    built_model,
    check_resumed_model,
    partition_problem,
    user_round_problem,
    user_term_problem,
)


class RunConfigError(ValueError):
    """A run config that cannot be resolved (not a Flower App, unknown key,
    unreadable value); the user must fix it before anything runs."""


# One "key=value" of a --run-config or --node-config string, as Flower's parser reads it.
PAIR = re.compile(r"""[^\s=]+=(?:'[^']*'|"[^"]*"|\S+)""")


def pairs_problem(text: str) -> str | None:
    """What, in a "key=value ..." string, is not such a pair (None when all are).

    Flower's parser keeps only what its pattern matches, so `rounds=` (no
    value) or a stray word would silently fall back to the default.
    """
    position = 0
    while (position := _skip_spaces(text, position)) < len(text):
        pair = PAIR.match(text, position)
        if pair is None:
            token = text[position:].split(maxsplit=1)[0]
            lone = token.endswith("=") and token.count("=") == 1
            return f"{token!r} {'has no value' if lone else 'is not key=value'}"
        if pair.end() < len(text) and not text[pair.end()].isspace():
            return f"{pair.group()!r} is followed by {text[pair.end()]!r}, not a space"
        position = pair.end()
    return None


def _skip_spaces(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


PRESETS_DIR = "configs"  # in the app: a preset is a TOML file there, by its stem


def preset(app: Path, value: str) -> Path | None:
    """The app's preset that a `--run-config` value names (`mnist-fedavg`:
    `configs/mnist-fedavg.toml`), or None when the value names none."""
    if not re.fullmatch(r"[\w.-]+", value) or value.endswith(".toml"):
        return None
    path = app / PRESETS_DIR / f"{value}.toml"
    return path if path.is_file() else None


def resolve_run_config(app: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """pyproject defaults, then each `--run-config` value in order (later wins).

    Unlike `flwr run`, TOML files, the app's presets (by name) and
    "key=value" strings may be mixed.
    """
    from click import ClickException
    from flwr.common.config import get_project_config, parse_config_args

    try:
        config = dict(get_project_config(app)["tool"]["flwr"]["app"]["config"])
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise RunConfigError(
            f"{app} is not a Flower App with [tool.flwr.app.config]: {err}"
        ) from err
    for value in overrides:
        value = str(preset(app, value) or value)
        if not value.endswith(".toml") and (problem := pairs_problem(value)):
            raise RunConfigError(
                f"invalid --run-config {value!r}: {problem}; write key=value pairs "
                "separated by spaces, strings quoted (e.g. rounds=3 run-name='a b')"
            )
        try:
            parsed = parse_config_args([value])
        except (ValueError, OSError, ClickException) as err:
            raise RunConfigError(f"invalid --run-config {value!r}: {err}") from err
        unknown = sorted(set(parsed) - set(config))
        if unknown:
            raise RunConfigError(
                f"{unknown_key_message(unknown[0], config)} (in {value!r})"
            )
        config.update(parsed)
    _pin_read_files(config)
    return config


def resolve_settings(app: Path, overrides: Sequence[str]) -> Settings:
    """`resolve_run_config`, validated."""
    return Settings.from_run_config(resolve_run_config(app, overrides))


def check_local_device(device: str) -> None:
    """Refuse a `device` this machine lacks, for work that runs here (a
    simulation, the centralised baseline): now, not after Flower and Ray have
    started. torch is imported only when a device is named."""
    if device in ("auto", "cpu"):
        return
    from ..task.train import pick_device

    try:
        pick_device(device)
    except ValueError as err:
        raise SettingsError(f"{err}; allowed here: auto (what there is), cpu") from None


def check_local_data(settings: Settings) -> None:
    """Read the data set a run on this machine names, before Flower starts: a
    missing, truncated or malformed file (or image folder) stops the command
    in seconds, not after start-up. The decoded copy stays in the disk cache
    the run then reads; digits ships with scikit-learn, synthetic is
    generated and a user's data set was loaded when the settings were
    validated, so none of them needs a check."""
    built_in = DATA_SETS.get(settings.data_set)
    if built_in is None or built_in.generated or built_in.name == "digits":
        return
    root = Path(settings.data_root)
    if problem := readable_folder_problem(root, "data-root"):  # before torch loads
        raise SettingsError(f"data-set={settings.data_set!r}: {problem}")
    from ..task.data import DataError, check_readable

    try:
        check_readable(settings.data_set, settings.data_root, settings.download)
    except DataError as err:
        raise SettingsError(f"data-set={settings.data_set!r}: {err}") from None


def check_local_tracker(settings: Settings) -> None:
    """Refuse a tracker whose package is missing, or whose tracking server does
    not answer, for a ServerApp that runs on this machine: now, not after
    Flower's start-up (MLflow's client would retry for minutes)."""
    if settings.tracker == "none":
        return
    from importlib.util import find_spec

    if find_spec(settings.tracker) is None:
        raise SettingsError(
            f"tracker={settings.tracker!r} needs the {settings.tracker} package, "
            f"which is not installed: pip install 'pollen-fl[{settings.tracker}]'"
        )
    if settings.tracker == "mlflow":
        try:
            check_server(settings.tracking_uri)
        except ValueError as err:
            raise SettingsError(f"tracking-uri: {err}") from None


def pin_tracking_uri(settings: Settings) -> Settings:
    """With tracker=mlflow, `tracking-uri` made explicit: as set, else the
    store a resumed run logged to, else `$MLFLOW_TRACKING_URI`, else an
    SQLite store beside the runs; a relative SQLite path made absolute."""
    if settings.tracker != "mlflow":
        return settings
    uri = pin_uri(tracking_uri(settings))
    rule = tracking_uri_rule()
    if not rule.check(uri):  # from the environment or a resumed run's record
        raise SettingsError(
            f"the MLflow tracking URI {uri!r} (from ${URI_ENV}, or the record of "
            f"the run resumed) is not one pollen takes; allowed: {rule.allowed}; "
            "set tracking-uri to override it"
        )
    return dataclasses.replace(settings, tracking_uri=uri)


def pin_paths(settings: Settings, strategy: str) -> Settings:
    """`data-root`, `output-dir` and `resume` made absolute against this
    shell's directory, and an empty `run-name` given a generated one (named
    after `strategy`), so this command knows where results land."""
    return dataclasses.replace(
        settings,
        data_root=_absolute(settings.data_root),
        output_dir=_absolute(settings.output_dir),
        run_name=settings.run_name or default_run_name(strategy, settings.data_set),
        resume=settings.resume and _absolute(settings.resume),
    )


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _pin_read_files(config: dict[str, Any]) -> None:
    """A relative `network-profile` or `backbone-weights` file made absolute
    against this shell's directory: the ServerApp reads them in the
    SuperLink's Flower home. Done where every command that validates a run
    config reads it (a run, a comparison's cells), so a run records the
    path its cell names."""
    profile, weights = config.get("network-profile"), config.get("backbone-weights")
    if isinstance(profile, str) and profile:
        config["network-profile"] = _absolute(profile)
    if isinstance(weights, str) and weights and weights not in BACKBONE_SOURCES:
        config["backbone-weights"] = _absolute(weights)


def prepare_run(app: Path, overrides: Sequence[str]) -> tuple[Settings, str, int]:
    """Validate the run config and pin what the ServerApp must not guess.

    Relative `data-root`/`output-dir` are resolved against this shell's
    directory, and an empty `run-name` gets a generated one (with `resume`:
    the directory being resumed). Returns the settings, the complete run
    config as one "key=value" string and the round a resume continues after
    (its checkpoint's, checked here, its entries against the model built
    now; 0 for a new run). A client hyper-parameter set against what a
    part of the run assumes is run as asked, with a note.
    """
    run_config = resolve_run_config(app, overrides)
    settings = Settings.from_run_config(run_config)
    for line in departures(run_config, settings.to_run_config()):
        print(f"pollen: note: {line}", flush=True)
    settings = pin_tracking_uri(pin_paths(settings, settings.strategy))
    if not settings.notify_url and os.environ.get(URL_ENV):
        try:
            check_url(os.environ[URL_ENV], from_env=True)
        except ValueError as err:
            raise SettingsError(str(err)) from None
    for check in (user_term_problem, user_round_problem, partition_problem):
        if problem := check(settings):
            raise SettingsError(problem)
    resumed_after = 0
    size = built_model(settings)
    if settings.resume:
        checkpoint = load_resumable(Path(settings.resume), settings.to_run_config())
        check_resumed_model(checkpoint, size, settings.model)
        resumed_after = checkpoint.round
    else:
        check_run_dir_is_new(settings.output_dir, settings.run_name)
    return settings, config_string(settings), resumed_after


def config_string(settings: Settings) -> str:
    """Every key of `settings` as one "key=value ..." string for `flwr run`."""
    config = settings.to_run_config()
    return " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())

"""Every run-config key pollen understands, declared once.

A key's type, default, help text and allowed values live in the field of
`Settings` that holds it. `Settings.from_run_config` turns Flower's run config
(pyproject defaults fused with `--run-config` overrides) into a validated,
typed, frozen object; anything invalid raises `SettingsError` with one line
naming the key, the value and what is allowed, before any data is touched.

Checks that need the data (a `min-size` the data cannot meet, more
classes per client than the data set has) live with the data, in
`pollen.task.partition`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Scalar = bool | int | float | str

DATA_SETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100")
MODELS = ("mlp", "mlp-bn", "cnn", "mobilenet")
PARTITIONS = ("iid", "niid", "pathological", "silos")
STRATEGIES = ("fedavg",)
DEVICES = ("auto", "cpu", "cuda", "mps")


class SettingsError(ValueError):
    """An invalid run-config value; the message is one line a user can act on."""


@dataclass(frozen=True)
class Rule:
    """What a key allows: a predicate and the words that describe it."""

    check: Callable[[Any], bool]
    allowed: str


def one_of(*choices: str) -> Rule:
    return Rule(lambda v: v in choices, "one of " + ", ".join(choices))


def at_least(low: float) -> Rule:
    return Rule(lambda v: v >= low, f">= {low:g}")


def above(low: float) -> Rule:
    return Rule(lambda v: v > low, f"> {low:g}")


def in_range(low: float, high: float) -> Rule:
    return Rule(lambda v: low < v <= high, f"in ({low:g}, {high:g}]")


def key(default: Scalar, help: str, rule: Rule | None = None) -> Any:
    """Declare one run-config key (as a dataclass field)."""
    return field(default=default, metadata={"help": help, "rule": rule})


@dataclass(frozen=True)
class Settings:
    """A validated run configuration. Attribute `data_set` is key `data-set`."""

    # Reproducibility and compute
    seed: int = key(
        845, "seed for partitions, client sampling and training", at_least(0)
    )
    device: str = key("auto", "auto picks CUDA, then MPS, then CPU", one_of(*DEVICES))
    # Data
    data_set: str = key("digits", "data set to train on", one_of(*DATA_SETS))
    data_root: str = key(
        "data", "folder with <name>.npz / image folders; decoded cache goes here"
    )
    download: bool = key(True, "download with torchvision when no local copy exists")
    augment: bool = key(True, "random crop + flip for 32x32 colour data")
    normalize: bool = key(True, "standardise inputs with the data set's mean/std")
    test_batch_size: int = key(
        128, "batch size of the server's evaluation", at_least(1)
    )
    # Federation
    num_clients: int = key(10, "number of clients (data partitions)", at_least(1))
    client_frac: float = key(
        0.25, "fraction of clients sampled per round", in_range(0, 1)
    )
    local_epochs: int = key(1, "local epochs per round", at_least(1))
    batch_size: int = key(100, "local batch size", at_least(1))
    lr: float = key(1e-2, "initial client learning rate", above(0))
    momentum: float = key(
        0.9, "client SGD momentum", Rule(lambda v: 0 <= v < 1, "in [0, 1)")
    )
    weight_decay: float = key(5e-4, "client SGD weight decay", at_least(0))
    rounds: int = key(10, "communication rounds", at_least(1))
    model: str = key("mlp", "model architecture", one_of(*MODELS))
    strategy: str = key("fedavg", "server strategy preset", one_of(*STRATEGIES))
    # Partitioning
    partition: str = key("iid", "how training data is split", one_of(*PARTITIONS))
    alpha: float = key(0.5, "Dirichlet concentration for partition=niid", above(0))
    min_size: int = key(
        10, "minimum samples per client for partition=niid", at_least(0)
    )
    classes_per_client: int = key(
        2, "classes per client for partition=pathological", at_least(1)
    )
    print_labels: bool = key(False, "print each client's label counts")
    # ReduceLROnPlateau on the server's test loss
    lr_factor: float = key(
        0.5, "lr multiplier on a plateau", Rule(lambda v: 0 < v < 1, "in (0, 1)")
    )
    lr_patience: int = key(5, "rounds without improvement before a cut", at_least(0))
    min_lr: float = key(1e-6, "lower bound of the lr", at_least(0))
    lr_threshold: float = key(1e-4, "relative improvement that counts", at_least(0))
    lr_cooldown: int = key(0, "rounds to wait after a cut", at_least(0))
    # Results
    output_dir: str = key("results", "folder that holds one directory per run")
    run_name: str = key("", "name of this run's directory (default: generated)")

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Scalar]) -> Settings:
        """Validate a Flower run config; unknown keys and bad values raise."""
        fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(run_config) - set(fields))
        if unknown:
            raise SettingsError(
                f"unknown run-config key {unknown[0]!r}; known keys: "
                + ", ".join(sorted(fields))
            )
        values = {}
        for name, f in fields.items():
            raw = run_config.get(name, f.default)
            value = _coerce(name, raw, type(f.default))
            rule: Rule | None = f.metadata["rule"]
            if rule is not None and not rule.check(value):
                raise SettingsError(
                    f"invalid value for {name!r}: {raw!r}; allowed: {rule.allowed}"
                )
            values[f.name] = value
        return cls(**values)

    def to_run_config(self) -> dict[str, Scalar]:
        """The settings as run-config keys (what `settings.json` holds)."""
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
        }

    @classmethod
    def describe(cls) -> list[tuple[str, Scalar, str, str]]:
        """(key, default, help, allowed) for every key: the reference table."""
        return [
            (
                f.name.replace("_", "-"),
                f.default,
                f.metadata["help"],
                f.metadata["rule"].allowed if f.metadata["rule"] else "",
            )
            for f in dataclasses.fields(cls)
        ]


def _coerce(name: str, raw: Scalar, kind: type) -> Scalar:
    """Give `raw` the type of the key's default, refusing lossy conversions."""
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    elif kind is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif kind is float:
        number = isinstance(raw, int | float) and not isinstance(raw, bool)
        if number and math.isfinite(raw):
            return float(raw)
    elif isinstance(raw, str):
        return raw
    raise SettingsError(
        f"invalid value for {name!r}: {raw!r}; allowed: a {kind.__name__}"
        + (" (finite)" if kind is float else "")
    )

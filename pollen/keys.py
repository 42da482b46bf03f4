"""How a run-config key is declared and each value checked on its own.

`pollen.settings` declares every key as a dataclass field made by `key`: its
default, help text, type and a `Rule` (a predicate with the words that
describe it). `checked_values` gives every raw value its key's type
(`coerce`) and asks the key's rule; the words of a rule are what an error
message and the reference (docs/configuration.md) say is allowed. Rules
across keys (combinations, and what each part refuses) are not here:
`pollen.settings` asks the parts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .catalog import TRACKING_STORES, Scalar
from .common.webhook import check_url
from .extensions import PART_KEYS, names_user_part

AUTO = "auto"


class SettingsError(ValueError):
    """An invalid run-config value; the message is one line a user can act on."""


# how a key's allowed values end where a user's own part is accepted
_USER_PART = (
    ", or a user's: an import path 'module:{what}' or a name registered under "
    "entry-point group {group} (docs/extending.md)"
)


@dataclass(frozen=True)
class Rule:
    """What a key allows: a predicate and the words that describe it."""

    check: Callable[[Any], bool]
    allowed: str


def one_of(*choices: str) -> Rule:
    return Rule(lambda v: v in choices, "one of " + ", ".join(choices))


def part_of(key: str, *extra: str) -> Rule:
    """For the part-naming `key` (`extensions.PART_KEYS`): one of `extra` or
    of the catalogue's parts as they are when the key is checked (so a part
    added to the catalogue is allowed), or a user's class by import path or
    entry point (`pollen.extensions`)."""
    parts, group = PART_KEYS[key]
    return Rule(
        lambda v: v in extra or v in parts or names_user_part(v, group),
        one_of(*extra, *parts).allowed + _USER_PART.format(what="Class", group=group),
    )


def part_rule(built_in: Collection[str], group: str) -> Rule:
    """A built-in name, or a user's part (`pollen.extensions`)."""
    return Rule(
        lambda v: v in built_in or names_user_part(v, group),
        "one of "
        + ", ".join(built_in)
        + _USER_PART.format(what="function", group=group),
    )


def at_least(low: float) -> Rule:
    return Rule(lambda v: v >= low, f">= {low:g}")


def above(low: float) -> Rule:
    return Rule(lambda v: v > low, f"> {low:g}")


def in_range(low: float, high: float) -> Rule:
    return Rule(lambda v: low < v <= high, f"in ({low:g}, {high:g}]")


def unit_interval() -> Rule:
    """A weight from 0 to 1, both included (a mixture's)."""
    return Rule(lambda v: 0 <= v <= 1, "in [0, 1]")


def fraction() -> Rule:
    """A share that may be 0 and stays below 1 (a decay, a dropout)."""
    return Rule(lambda v: 0 <= v < 1, "in [0, 1)")


def open_fraction() -> Rule:
    """A share strictly between 0 and 1 (a probability, a quantile)."""
    return Rule(lambda v: 0 < v < 1, "in (0, 1)")


def betas_rule() -> Rule:
    return Rule(lambda v: parse_betas(v) is not None, "'b1,b2' with both in [0, 1)")


def parse_betas(text: str) -> tuple[float, float] | None:
    """'0.9,0.999' -> (0.9, 0.999); None unless two numbers in [0, 1)."""
    try:
        b1, b2 = (float(part) for part in text.split(","))
    except ValueError:
        return None
    return (b1, b2) if 0 <= b1 < 1 and 0 <= b2 < 1 else None


def webhook_rule() -> Rule:
    def valid(url: str) -> bool:
        try:
            return not url or bool(check_url(url))
        except ValueError:
            return False

    return Rule(valid, "an http(s) URL, or empty")


def folder_name_rule() -> Rule:
    def valid(name: str) -> bool:
        return not name or (
            not any(c in name for c in "/\\") and name.strip(". ") != ""
        )

    return Rule(valid, "a name without / or \\ (it names a folder), or empty")


def tracking_uri_rule() -> Rule:
    def valid(uri: str) -> bool:
        if not uri:
            return True
        if uri.startswith(("http://", "https://")):
            return webhook_rule().check(uri)
        scheme, _, rest = uri.partition("://")
        return uri.startswith(TRACKING_STORES) and bool(rest) and "/" not in scheme

    return Rule(
        valid,
        "empty, an http(s) URL of an MLflow tracking server, or a store URI "
        "starting with " + ", ".join(TRACKING_STORES),
    )


KIND_NAMES = {
    int: "an integer (signed 64-bit)",
    float: "a finite number",
    bool: "true or false",
    str: "a string",
}


def coerce(raw: Scalar, kind: type) -> Scalar | None:
    """`raw` in the type of the key's default, or None where that would
    lose something (3.5 as an integer, "yes" as a boolean, infinity)."""
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    elif kind is int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, int) and not isinstance(raw, bool) and _sint64(raw):
            return raw
    elif kind is float:
        number = isinstance(raw, int | float) and not isinstance(raw, bool)
        if number and not isinstance(raw, float) and abs(raw) > sys.float_info.max:
            return None
        if number and math.isfinite(raw):
            return float(raw)
    elif isinstance(raw, str):
        return raw
    return None


def _sint64(value: int) -> bool:
    """Whether Flower can carry `value` (its config values are signed 64-bit
    integers)."""
    return -(2**63) <= value < 2**63


def kind_words(kind: type) -> str:
    """What a value of `kind` is, in an error message ("an integer")."""
    return KIND_NAMES.get(kind, kind.__name__)


def key(
    default: Scalar, help: str, rule: Rule | None = None, kind: type | None = None
) -> Any:
    """Declare one run-config key (as a dataclass field).

    `kind` is the value type when the default is the string "auto" (the key
    then takes "auto" or a value of that kind, and "auto" is resolved from the
    strategy preset, or for the client's hyper-parameters from the data set).
    """
    metadata = {"help": help, "rule": rule, "kind": kind or type(default)}
    return field(default=default, metadata=metadata)


def key_name(f: dataclasses.Field) -> str:
    """The run-config name of a declared key (field `data_set` is `data-set`)."""
    return f.name.replace("_", "-")


def allowed_text(f: dataclasses.Field) -> str:
    """What a declared key allows, in words (the reference's column)."""
    rule: Rule | None = f.metadata["rule"]
    text = rule.allowed if rule else ""
    if f.default == AUTO and f.metadata["kind"] is not str:
        text = f"auto or {text or kind_words(f.metadata['kind'])}"
    return text


def checked_values(
    keys: Collection[dataclasses.Field], run_config: Mapping[str, Scalar]
) -> dict[str, Scalar]:
    """Every declared key's value (`run_config`'s, else its default) in its
    key's type and allowed by its rule, by run-config name; "auto" stays
    where the key takes it. Raises `SettingsError` naming the first unknown
    key, or the first value that is not allowed and what is."""
    by_name = {key_name(f): f for f in keys}
    unknown = sorted(set(run_config) - set(by_name))
    if unknown:
        raise SettingsError(unknown_key_message(unknown[0], by_name))
    values: dict[str, Scalar] = {}
    for name, f in by_name.items():
        raw = run_config.get(name, f.default)
        if raw == AUTO and f.default == AUTO:
            values[name] = AUTO
            continue
        value = coerce(raw, f.metadata["kind"])
        rule: Rule | None = f.metadata["rule"]
        if value is None:
            allowed = kind_words(f.metadata["kind"])
            if f.metadata["kind"] is str and rule is not None:
                allowed = rule.allowed
            quoted = str(raw)
            if f.metadata["kind"] is str and (rule is None or rule.check(quoted)):
                allowed += f" (in quotes: {name}='{quoted}')"  # TOML read a number
        elif rule is not None and not rule.check(value):
            allowed = rule.allowed
        else:
            values[name] = value
            continue
        raise SettingsError(
            f"invalid value for {name!r}: {raw!r}; allowed: "
            + ("auto or " if f.default == AUTO else "")
            + allowed
        )
    return values


def unknown_key_message(name: str, known: Collection[str]) -> str:
    """One line for a key pollen does not know: the closest known keys when
    the name looks like a typo of one, else where the whole list is."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.75)
    hint = (
        "did you mean " + " or ".join(repr(k) for k in close) + "?"
        if close
        else "`pollen list keys` lists every key"
    )
    return f"unknown run-config key {name!r}; {hint}"

"""What an aggregation step and a server update hand back, checked as it
comes back.

A part of the user's own (docs/extending.md) runs inside the round: a
result with an entry missing, of another shape, of an integer dtype or
holding NaN would otherwise zero the model, leave an entry at its old value
or get every next reply rejected, and be found rounds later under another
name (the clients' learning rate, a checkpoint). So each result is checked
against the entries the round sent, and a wrong one ends the run with one
line naming the part by its import path and what was wrong. A float result
of another precision is cast, not refused: a server update returns each
entry in its current dtype (`aggregation.cast_like`), and pollen does it for
a part that forgot. NaN or infinity is refused from a user's part only:
from pollen's own it means a setting made a correct part diverge, which
the global model's test says naming that setting (server-lr).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..common.few import few
from .aggregation import Aggregate, Arrays, ClientUpdate, cast_like


class PartError(ValueError):
    """A part's result pollen cannot use; one line naming the part."""


def part_path(part: object) -> str:
    """A part's import path, as a run config names it ("module:Class")."""
    kind = type(part)
    return f"{kind.__module__}:{kind.__qualname__}"


def _users(part: object) -> bool:
    """Whether `part` is a user's, not pollen's own: NaN from pollen's own
    parts is left to the global model's test, whose message names the
    setting that makes a correct part diverge (server-lr)."""
    return not type(part).__module__.startswith("pollen.")


def checked_aggregate(
    result: object,
    current: Arrays,
    updates: Collection[ClientUpdate],
    aggregator: object,
) -> Aggregate:
    """The aggregation step's `result`, with every entry of `current` (the
    shared entries the clients were sent) in float64 (integer entries, such as BatchNorm's counters, may stay integer)
    and made only of the round's `updates`; `PartError` otherwise."""
    who = f"aggregator {part_path(aggregator)!r}"
    if not isinstance(result, Aggregate):
        raise PartError(
            f"{who} returned a {type(result).__name__}; expected "
            "pollen.strategies.aggregation.Aggregate(arrays, updates) "
            "(docs/extending.md)"
        )
    if not isinstance(result.arrays, Mapping):
        raise PartError(
            f"{who} returned arrays of type {type(result.arrays).__name__}; "
            "expected a dict of one numpy array per entry"
        )
    _check_keys(who, result.arrays, current)
    arrays = {}
    for key in current:
        value = _checked_array(who, key, result.arrays[key], current[key])
        if np.issubdtype(current[key].dtype, np.floating):
            if not np.issubdtype(value.dtype, np.floating):
                raise PartError(
                    f"{who} returned entry {key!r} as {value.dtype}; an aggregate of "
                    "float entries is float64 (the server update casts it back)"
                )
            value = value.astype(np.float64, copy=False)
        arrays[key] = value
        if _users(aggregator):
            _check_finite(who, key, value, "from finite updates")
    used = tuple(result.updates)
    if not {update.client for update in used} <= {u.client for u in updates}:
        raise PartError(
            f"{who} returned updates of clients the round did not give it; "
            "Aggregate.updates lists the ClientUpdates it used, from those it was "
            "called with"
        )
    return Aggregate(arrays, used, result.report)


def checked_update(
    result: object, current: Arrays, server_update: object
) -> dict[str, np.ndarray]:
    """The server update's `result`: every entry of `current`, of its shape,
    cast to its dtype (float64 -> float32 where the model is float32) and
    finite; `PartError` otherwise."""
    who = f"server update {part_path(server_update)!r}"
    if not isinstance(result, Mapping):
        raise PartError(
            f"{who} returned a {type(result).__name__}; expected a dict of the "
            "next shared entries, one numpy array per entry"
        )
    _check_keys(who, result, current)
    checked = {}
    for key, like in current.items():
        value = _checked_array(who, key, result[key], like)
        checked[key] = value if value.dtype == like.dtype else cast_like(value, like)
        if _users(server_update):
            _check_finite(who, key, value, "from a finite aggregate")
    return checked


def _check_keys(who: str, result: Mapping[str, Any], keys: Collection[str]) -> None:
    """Refuse a result whose entries are not exactly `keys`."""
    missing = [key for key in keys if key not in result]
    extra = [key for key in result if key not in keys]
    if missing or extra:
        said = [f"no entry {few([repr(key) for key in missing])}"] if missing else []
        said += (
            [f"entries the round did not send, {few([repr(key) for key in extra])}"]
            if extra
            else []
        )
        raise PartError(f"{who} returned {' and '.join(said)}; expected every one of "
                        f"the {len(keys)} shared entries")  # fmt: skip


def _checked_array(who: str, key: str, value: object, like: np.ndarray) -> np.ndarray:
    """`value` as a numeric numpy array of `like`'s shape (a numpy scalar is
    a 0-d array, as a sum of 0-d arrays gives), or `PartError`."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or not (
        np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_
    ):
        kind = type(value).__name__
        described = (
            f"{kind} of {value.dtype}" if isinstance(value, np.ndarray) else kind
        )
        raise PartError(
            f"{who} returned entry {key!r} as a {described}; expected a numpy array "
            "of numbers"
        )
    if value.shape != like.shape:
        raise PartError(
            f"{who} returned entry {key!r} of shape {list(value.shape)}; the model's "
            f"is {list(like.shape)}"
        )
    return value


def _check_finite(who: str, key: str, value: np.ndarray, inputs: str) -> None:
    """Refuse `value` where it holds NaN or infinity."""
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
        raise PartError(f"{who} returned NaN or infinity in entry {key!r} {inputs}")

"""What the server checks in a client's training reply before it trusts it.

A federation cannot assume its clients are correct: a node may run other
code, crash half-way through serialising, diverge, or lie. Every reply is
checked against what the server sent and what it knows about the client;
one that fails is dropped with a one-line reason and the round goes on
with the others. Optionally (`update-norm-bound`), an update far larger than
the round's typical one is clipped or dropped, a basic defence against a
poisoned or broken client (cf. norm bounding, Sun et al. 2019).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log

from ..catalog import NORM_ACTIONS
from ..protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    METRICS,
    NUM_EXAMPLES,
    PERSONAL_METRICS,
)
from .aggregation import Arrays

# A line of a traceback that names an exception: "TypeError: ..." or
# "torch.OutOfMemoryError: ..."
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*\.)?(?P<name>[A-Za-z_]\w*(?:Error|Exception))"
    r"(?:: (?P<text>.+))?$"
)
# what Flower's simulation and ClientApp wrap a client's own exception in
_WRAPPERS = ("ClientAppException", "RayTaskError")
ERROR_LINE_CHARS = 300


def error_line(reason: str) -> str:
    """The one line of a client's error that says what went wrong: the last
    exception a traceback names, not Flower's or Ray's wrapper around it
    (an error reply carries the whole traceback, which history.json keeps),
    else its first line; at most `ERROR_LINE_CHARS` characters."""
    lines = [line.strip() for line in reason.splitlines()]
    named = [
        found
        for line in lines
        if (found := _EXCEPTION_LINE.match(line)) and found["name"] not in _WRAPPERS
    ]
    if named:
        found = named[-1]
        line = f"{found['name']}: {found['text']}" if found["text"] else found["name"]
    else:
        line = next((line for line in lines if line), "")
    if len(line) <= ERROR_LINE_CHARS:
        return line
    return line[: ERROR_LINE_CHARS - 3] + "..."


@dataclass(frozen=True)
class Expectation:
    """What a valid training reply of one round looks like."""

    arrays: Arrays  # the shared entries sent: names, shapes and dtypes to match
    owner: Mapping[int, int]  # client -> the node that serves it
    sampled: frozenset[int]  # the clients asked to train this round
    max_examples: Mapping[int, int]  # client -> its shard size (absent: unbounded)
    # metrics the aggregation step reads (positive numbers, e.g. FedNova's a_k)
    required_metrics: tuple[str, ...] = ()
    # further array records every reply carries: name -> entries to match
    records: Mapping[str, Arrays] = field(default_factory=dict)


class ReplyError(ValueError):
    """Why a reply cannot be aggregated (one line, for the log and history)."""


class NonFiniteReply(ReplyError):
    """A reply carrying NaN or infinity: a diverged client, or a bad one."""


def checked_reply(
    msg: Message, expected: Expectation, seen: set[int]
) -> tuple[int, MetricRecord, dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """The client a training reply names, its metrics, its entries and its
    expected further records, decoded once, after every check has passed;
    `ReplyError` saying which check failed otherwise. Only these records are
    used: any other record in the reply is ignored, never aggregated.

    `seen` holds the clients already accepted this round; a second reply for
    one of them is refused.
    """
    arrays, metrics = msg.content.get(ARRAYS), msg.content.get(METRICS)
    if not isinstance(arrays, ArrayRecord) or not isinstance(metrics, MetricRecord):
        raise ReplyError(f"reply lacks its {ARRAYS!r} or {METRICS!r} record")
    client = named_client(msg, expected.owner, expected.sampled, seen, "train")
    _check_metrics(metrics, client, expected)
    records = {}
    for name, entries in expected.records.items():
        record = msg.content.get(name)
        if not isinstance(record, ArrayRecord):
            raise ReplyError(f"reply lacks its {name!r} record")
        records[name] = _decoded(record, entries, f"{name}: ")
    return client, metrics, _decoded(arrays, expected.arrays), records


def checked_personal_reply(
    msg: Message, owner: Mapping[int, int], asked: Collection[int], seen: set[int]
) -> tuple[int, dict[str, float]]:
    """The client a personal-evaluation reply names and its `PERSONAL_METRICS`,
    after the same checks of who sent it as a training reply's; NaN is allowed
    (a node may hold no test data), any other value outside an accuracy's
    [0, 1] or a loss's [0, inf) is refused."""
    metrics = msg.content.get(METRICS)
    if not isinstance(metrics, MetricRecord):
        raise ReplyError(f"reply lacks its {METRICS!r} record")
    client = named_client(msg, owner, asked, seen, "evaluate")
    values = {}
    for name in PERSONAL_METRICS:
        value = metrics.get(name)
        upper = 1.0 if name.endswith("accuracy") else math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ReplyError(f"metric {name!r} must be a number, got {value!r}")
        if not (math.isnan(value) or 0.0 <= value <= upper):
            raise ReplyError(
                f"metric {name!r} must lie in [0, {upper:g}], got {value!r}"
            )
        values[name] = float(value)
    return client, values


def reported_seconds(metrics: Mapping[str, object] | None, key: str) -> float:
    """The seconds of work a client reports under `key` (`train-seconds`,
    `eval-seconds`) for the simulated clock; 0 where it reports none or no
    finite number >= 0 (the clock then counts the message's transfer alone)."""
    value = (metrics or {}).get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) and value >= 0 else 0.0


def reply_failures(
    clients: list[int],
    owner: Mapping[int, int],
    valid: list[Message],
    failed: list[Message],
) -> list[str]:
    """One line per error reply, and one per node that answered fewer of
    its sampled clients' messages than it was sent.

    Flower's error reply for a node it has lost ("Node Unavailable") does
    not name that node as its source, so such an error is told as the
    reason of the nodes that went silent; without one they timed out."""
    nodes = set(owner.values())
    lines = [f"node {m.metadata.src_node_id}: {m.error.reason}"
             for m in failed if m.metadata.src_node_id in nodes]  # fmt: skip
    for msg in failed:  # the console's line; history.json keeps the traceback
        if msg.metadata.src_node_id in nodes:
            log(WARNING, "pollen: error reply: node %d: %s",
                msg.metadata.src_node_id, error_line(msg.error.reason))  # fmt: skip
    unattributed = sorted(
        {m.error.reason for m in failed if m.metadata.src_node_id not in nodes}
    )
    why = ": " + "; ".join(unattributed) if unattributed else " within round-timeout"
    sent: dict[int, list[int]] = {}
    for client in clients:
        sent.setdefault(owner[client], []).append(client)
    answered: dict[int, int] = {}
    for msg in [*valid, *failed]:
        node = msg.metadata.src_node_id
        answered[node] = answered.get(node, 0) + 1
    for node, served in sent.items():
        missing = len(served) - answered.get(node, 0)
        if missing > 0:
            lines.append(
                f"node {node}: no reply for {missing} of clients {served}{why}"
            )
            log(WARNING, "pollen: %s", lines[-1])
    return lines


def named_client(
    msg: Message,
    owner: Mapping[int, int],
    asked: Collection[int],
    seen: set[int],
    action: str,
) -> int:
    """The client a reply names, if it was asked to `action`, is served by the
    node that replied, and has not replied before."""
    client_record = msg.content.get(CLIENT_RECORD)
    if not isinstance(client_record, ConfigRecord) or not isinstance(
        client_record.get(CLIENT), int
    ):
        raise ReplyError(f"reply does not name its client ({CLIENT})")
    client = client_record[CLIENT]
    if client not in asked:
        raise ReplyError(f"client {client} was not asked to {action} this round")
    if owner.get(client) != msg.metadata.src_node_id:
        raise ReplyError(
            f"client {client} is not served by node {msg.metadata.src_node_id}"
        )
    if client in seen:
        raise ReplyError(f"a second reply for client {client}")
    return client


def _check_metrics(metrics: MetricRecord, client: int, expected: Expectation) -> None:
    count = metrics.get(NUM_EXAMPLES)
    bound = expected.max_examples.get(client)
    if isinstance(count, bool) or not isinstance(count, int | float) or not count > 0:
        raise ReplyError(f"{NUM_EXAMPLES} must be a positive number, got {count!r}")
    if bound is not None and count > bound:
        raise ReplyError(
            f"{NUM_EXAMPLES}={count:g} exceeds the client's shard ({bound})"
        )
    for name, value in metrics.items():
        if isinstance(value, list):
            raise ReplyError(f"metric {name!r} must be a finite number, got {value!r}")
        if not math.isfinite(value):
            raise NonFiniteReply(
                f"metric {name!r} must be a finite number, got {value!r}"
            )
    for name in expected.required_metrics:
        value = metrics.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not value > 0
        ):
            raise ReplyError(
                f"metric {name!r} must be a positive number (the aggregator needs "
                f"it), got {value!r}"
            )


def _decoded(
    arrays: ArrayRecord, sent: Arrays, where: str = ""
) -> dict[str, np.ndarray]:
    if set(arrays) != set(sent):
        missing = sorted(set(sent) - set(arrays))
        extra = sorted(set(arrays) - set(sent))
        raise ReplyError(
            f"{where}wrong entries (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    decoded = {}
    for key, expected in sent.items():
        try:
            value = arrays[key].numpy()
        except Exception as err:  # a corrupt buffer: whatever numpy raises
            raise ReplyError(
                f"{where}entry {key!r} cannot be read ({type(err).__name__})"
            ) from err
        if value.shape != expected.shape or value.dtype != expected.dtype:
            raise ReplyError(
                f"{where}entry {key!r} is {value.dtype}{list(value.shape)}, "
                f"expected {expected.dtype}{list(expected.shape)}"
            )
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise NonFiniteReply(f"{where}entry {key!r} is not finite")
        decoded[key] = value
    return decoded


def update_norm(current: Arrays, update: Arrays) -> float:
    """L2 norm of update - current over the floating entries, in float64."""
    total = 0.0
    for key, value in current.items():
        if np.issubdtype(value.dtype, np.floating):
            delta = update[key].astype(np.float64) - value
            total += float(np.dot(delta.ravel(), delta.ravel()))
    return math.sqrt(total)


def bound_update_norms(
    current: Arrays, updates: list[Arrays], bound: float, action: str
) -> list[tuple[Arrays | None, str]]:
    """Limit each update's norm to `bound` x the median norm of the round.

    With `action="clip"` an update above the limit is scaled back onto it,
    current + (update - current) * limit / norm; with `"drop"` it becomes None.
    Returns, in order, each update as kept and a note ("" when untouched).
    """
    if action not in NORM_ACTIONS:
        raise ValueError(f"unknown action {action!r}; allowed: {NORM_ACTIONS}")
    norms = [update_norm(current, u) for u in updates]
    median = float(np.median(norms)) if norms else 0.0
    out: list[tuple[Arrays | None, str]] = []
    for update, norm in zip(updates, norms, strict=True):
        if norm <= bound * median:
            out.append((update, ""))
            continue
        note = f"update norm {norm:.4g} > {bound:g} x the median {median:.4g}"
        if action == "clip":
            out.append((_scaled(current, update, bound * median / norm), note))
        else:
            out.append((None, note))
    return out


def _scaled(current: Arrays, update: Arrays, factor: float) -> dict[str, np.ndarray]:
    """current + factor * (update - current) on floating entries, dtypes kept."""
    out = {}
    for key, value in update.items():
        if np.issubdtype(value.dtype, np.floating):
            base = current[key].astype(np.float64)
            value = (base + factor * (value.astype(np.float64) - base)).astype(
                value.dtype
            )
        out[key] = value
    return out

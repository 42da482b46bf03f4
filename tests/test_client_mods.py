"""The ClientApp mods around the training and evaluation handlers: central
DP's clipping on the client and a straggler's slowdown, by hand, on stand-in
handlers."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from pollen.protocol import (
    ARRAYS,
    CLIP_NORM,
    CONFIG,
    EVAL_SECONDS,
    METRICS,
    SLOWDOWN,
    TRAIN_SECONDS,
    UPDATE_NORM,
)
from pollen.task import straggler
from pollen.task.client_clip import clipping_mod
from pollen.task.straggler import node_slowdown, straggler_mod

pytestmark = pytest.mark.usefixtures("task_identity")


def arrays(w: list[float], count: int) -> ArrayRecord:
    return ArrayRecord(
        {
            "w": Array(np.array(w, dtype=np.float32)),
            "count": Array(np.array(count, dtype=np.int64)),
        }
    )


def message(config: dict) -> Message:
    content = RecordDict({ARRAYS: arrays([1.0, 1.0], 7), CONFIG: ConfigRecord(config)})
    return Message(content, dst_node_id=1, message_type="train")


def handler(trained: ArrayRecord, metrics: dict):
    def call_next(msg: Message, context: Context) -> Message:
        content = RecordDict({ARRAYS: trained, METRICS: MetricRecord(metrics)})
        return Message(content, reply_to=msg)

    return call_next


def context(node_config: dict | None = None) -> Context:
    return Context(1, 1, node_config or {}, RecordDict(), {})


def test_clipping_mod_clips_the_update_and_reports_its_norm() -> None:
    """x = [1, 1], trained [4, 5]: Delta = [3, 4], norm 5, clipped to C = 2:
    x + Delta 2/5 = [2.2, 2.6]; the integer counter keeps its trained value."""
    call_next = handler(arrays([4.0, 5.0], 9), {TRAIN_SECONDS: 0.1})
    reply = clipping_mod(message({CLIP_NORM: 2.0}), context(), call_next)
    np.testing.assert_allclose(reply.content[ARRAYS]["w"].numpy(), [2.2, 2.6])
    assert reply.content[ARRAYS]["w"].numpy().dtype == np.float32
    assert reply.content[ARRAYS]["count"].numpy() == 9
    assert dict(reply.content[METRICS]) == {TRAIN_SECONDS: 0.1, UPDATE_NORM: 5.0}


def test_clipping_mod_leaves_a_reply_alone_without_a_clip_norm() -> None:
    call_next = handler(arrays([4.0, 5.0], 9), {TRAIN_SECONDS: 0.1})
    reply = clipping_mod(message({}), context(), call_next)
    np.testing.assert_array_equal(reply.content[ARRAYS]["w"].numpy(), [4.0, 5.0])
    assert dict(reply.content[METRICS]) == {TRAIN_SECONDS: 0.1}


@pytest.mark.parametrize(
    ("key", "slowdown", "expected"),
    [(TRAIN_SECONDS, 3, [1.0]), (EVAL_SECONDS, 1.5, [0.25]), (TRAIN_SECONDS, 1, [])],
)
def test_a_straggler_sleeps_its_slowdown_less_one_times_its_seconds(
    monkeypatch: pytest.MonkeyPatch, key: str, slowdown: float, expected: list
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    call_next = handler(arrays([4.0, 5.0], 9), {key: 0.5})
    mod = straggler_mod(key)
    reply = mod(message({}), context({SLOWDOWN: slowdown}), call_next)
    assert slept == expected
    assert dict(reply.content[METRICS]) == {key: 0.5}  # its own, unslowed seconds


@pytest.mark.parametrize("bad", [0.5, True, "2"])
def test_a_bad_slowdown_is_refused_before_the_work(bad: object) -> None:
    def never(msg: Message, context: Context) -> Message:
        raise AssertionError("the handler ran")

    with pytest.raises(ValueError, match=f"node config {SLOWDOWN}="):
        straggler_mod(TRAIN_SECONDS)(message({}), context({SLOWDOWN: bad}), never)
    assert node_slowdown(context()) == 1.0

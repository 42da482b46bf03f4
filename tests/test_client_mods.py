"""The ClientApp mods around the training and evaluation handlers: central
DP's clipping on the client and a straggler's slowdown, by hand, on stand-in
handlers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from pollen import protocol as proto
from pollen.task import straggler
from pollen.task.client_clip import clipping_mod
from pollen.task.straggler import node_slowdown, straggler_mod

pytestmark = pytest.mark.usefixtures("task_identity")


def arrays(w: list[float], count: int) -> ArrayRecord:
    return ArrayRecord(
        {
            "w": torch.tensor(w, dtype=torch.float32),
            "count": torch.tensor(count, dtype=torch.int64),
        }
    )


def message(config: dict) -> Message:
    content = RecordDict(
        {proto.ARRAYS: arrays([1.0, 1.0], 7), proto.CONFIG: ConfigRecord(config)}
    )
    return Message(content, dst_node_id=1, message_type="train")


def handler(trained: ArrayRecord, metrics: dict):
    def call_next(msg: Message, context: Context) -> Message:
        content = RecordDict(
            {proto.ARRAYS: trained, proto.METRICS: MetricRecord(metrics)}
        )
        return Message(content, reply_to=msg)

    return call_next


def context(node_config: dict | None = None) -> Context:
    return Context(1, 1, node_config or {}, RecordDict(), {})


def test_clipping_mod_clips_the_update_and_reports_its_norm() -> None:
    """x = [1, 1], trained [4, 5]: Delta = [3, 4], norm 5, clipped to C = 2:
    x + Delta 2/5 = [2.2, 2.6]; the integer counter keeps its trained value."""
    call_next = handler(arrays([4.0, 5.0], 9), {proto.TRAIN_SECONDS: 0.1})
    reply = clipping_mod(message({proto.CLIP_NORM: 2.0}), context(), call_next)
    np.testing.assert_allclose(reply.content[proto.ARRAYS]["w"].numpy(), [2.2, 2.6])
    assert reply.content[proto.ARRAYS]["w"].numpy().dtype == np.float32
    assert reply.content[proto.ARRAYS]["count"].numpy() == 9
    assert dict(reply.content[proto.METRICS]) == {
        proto.TRAIN_SECONDS: 0.1,
        proto.UPDATE_NORM: 5.0,
    }


def test_clipping_mod_leaves_a_reply_alone_without_a_clip_norm() -> None:
    call_next = handler(arrays([4.0, 5.0], 9), {proto.TRAIN_SECONDS: 0.1})
    reply = clipping_mod(message({}), context(), call_next)
    np.testing.assert_array_equal(reply.content[proto.ARRAYS]["w"].numpy(), [4.0, 5.0])
    assert dict(reply.content[proto.METRICS]) == {proto.TRAIN_SECONDS: 0.1}


@pytest.mark.parametrize(
    ("key", "slowdown", "expected"),
    [
        (proto.TRAIN_SECONDS, 3, [1.0]),
        (proto.EVAL_SECONDS, 1.5, [0.25]),
        (proto.TRAIN_SECONDS, 1, []),
    ],
)
def test_a_straggler_sleeps_its_slowdown_less_one_times_its_seconds(
    monkeypatch: pytest.MonkeyPatch, key: str, slowdown: float, expected: list
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    call_next = handler(arrays([4.0, 5.0], 9), {key: 0.5})
    mod = straggler_mod(key)
    reply = mod(message({}), context({proto.SLOWDOWN: slowdown}), call_next)
    assert slept == expected
    assert dict(reply.content[proto.METRICS]) == {key: 0.5}  # its own, unslowed seconds


@pytest.mark.parametrize("bad", [0.5, True, "2"])
def test_a_bad_slowdown_is_refused_before_the_work(bad: object) -> None:
    def never(msg: Message, context: Context) -> Message:
        raise AssertionError("the handler ran")

    with pytest.raises(ValueError, match=f"node config {proto.SLOWDOWN}="):
        straggler_mod(proto.TRAIN_SECONDS)(
            message({}), context({proto.SLOWDOWN: bad}), never
        )
    assert node_slowdown(context()) == 1.0

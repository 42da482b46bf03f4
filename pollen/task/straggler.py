"""A straggler, emulated: a node whose local work takes `slowdown` times as long.

A network profile (`pollen.network_profile`) gives some nodes a compute
slowdown (node config `slowdown`, set by `pollen compare --network`). Such
a node does its work at this machine's speed and then sleeps (slowdown - 1)
times the seconds it measured, so the model it returns is the one it would
have returned, only later; the seconds it reports are its own, unslowed
(the simulated clock multiplies them by the profile's slowdown). A
ClientApp mod around the training and evaluation handlers.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable, Mod

from ..protocol import METRICS, SLOWDOWN


def node_slowdown(context: Context) -> float:
    """This node's compute slowdown (node config `slowdown`; 1 where absent)."""
    value = context.node_config.get(SLOWDOWN, 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        raise ValueError(
            f"node config {SLOWDOWN}={value!r}: expected a number >= 1 (1: this "
            "machine's speed)"
        )
    return float(value)


def straggler_mod(seconds_key: str) -> Mod:
    """A ClientApp mod that makes the handler's work, the seconds its reply
    reports under metric `seconds_key`, take `slowdown` times as long."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        slowdown = node_slowdown(context)
        reply = call_next(msg, context)
        if slowdown > 1:
            time.sleep((slowdown - 1) * float(reply.content[METRICS][seconds_key]))
        return reply

    return mod

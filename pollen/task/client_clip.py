"""Central DP's clipping on the client (`central-clip-on = "client"`).

DP-FedAvg (McMahan et al. 2018, https://arxiv.org/abs/1710.06963,
Algorithm 1) bounds each client's contribution by clipping its update to
norm C. Where the run clips on the client, the server sends this round's C
with each training message (config `clip-norm`) and the client clips before
replying, so its update never leaves it unclipped; the server then adds the
noise (`strategies/central_dp.py`). Like Flower's own `fixedclipping_mod`,
this is a ClientApp mod around the training handler; the arithmetic is
`pollen.common.clipping.clipped_reply`, the same the server clips with.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from ..common.clipping import clipped_reply
from ..protocol import ARRAYS, CLIP_NORM, CONFIG, METRICS, UPDATE_NORM


def clipping_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """A ClientApp mod: where the message names a clip norm C, the reply's
    entries are moved back to x + Delta min(1, C / ||Delta||) (x: the
    entries received) and its metrics report ||Delta|| as `update-norm`."""
    reply = call_next(msg, context)
    config = msg.content[CONFIG]
    if CLIP_NORM in config:
        reply.content[ARRAYS], norm = clipped_reply(
            msg.content[ARRAYS], reply.content[ARRAYS], float(config[CLIP_NORM])
        )
        reply.content[METRICS][UPDATE_NORM] = norm
    return reply

"""What `mode = "async"` (FedBuff) refuses, asked by `Settings` before
anything starts (torch-free: it reads the settings and the parts' flags).

Buffered asynchronous aggregation (Nguyen et al. 2022,
https://arxiv.org/abs/2106.06639; `pollen.strategies.asynchronous`) has no
rounds: a part whose rule needs a synchronous round says so in its
`synchronous_only` flag (FedDyn's server state h, SCAFFOLD's control c), a
round deadline has no round to end, a buffer cannot wait for more
replies than clients train at once, and a version cannot need more
replies (`min-train-replies`) than its buffer holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..catalog import CHOOSING_KEYS
from ..extensions import PART_KEYS, part

if TYPE_CHECKING:
    from ..settings import Settings


def async_problem(s: Settings) -> str | None:
    """Why `s` (with mode async) cannot train asynchronously, or None."""
    for key in CHOOSING_KEYS:
        name = getattr(s, key.replace("-", "_"))
        if why := part(key, name).load().synchronous_only:
            allowed = [
                other
                for other, other_part in PART_KEYS[key][0].items()
                if not other_part.load().synchronous_only
            ]
            return (
                f"mode='async' with {key}={name!r}: {why}; allowed with async: "
                + ", ".join(allowed)
            )
    if s.dp:
        return (
            "dp=true with mode='async': DP-SGD's noise is set for each client "
            "training at most once a round (rounds x local-epochs at its sampling "
            "rate), and FedBuff gives a client its next task as soon as it "
            "replies, so a fast client would spend more than dp-epsilon; use "
            "mode='sync'"
        )
    if s.round_deadline:
        return (
            "round-deadline with mode='async': a deadline ends a synchronous "
            "round; async mode has no rounds to end (set round-deadline=0)"
        )
    if s.concurrency and s.buffer_size and s.buffer_size > s.concurrency:
        return (
            f"buffer-size={s.buffer_size} above concurrency={s.concurrency}: the "
            "buffer would wait for more replies than clients train at once"
        )
    buffer = s.buffer_size or max(1, (s.concurrency or s.sample_size) // 2)
    if s.min_train_replies > buffer:
        return (
            f"min-train-replies={s.min_train_replies} above the {buffer} replies "
            "a version aggregates (buffer-size, or half the concurrency): every "
            f"version would be skipped; set min-train-replies <= {buffer}"
        )
    return None

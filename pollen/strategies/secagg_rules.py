"""What `secure-aggregation = "secagg+"` refuses, asked by `Settings` before
anything starts (torch- and Flower-free: settings and arithmetic only).

Under SecAgg+ the server learns one thing per round: the sum of the
sampled clients' masked vectors (`pollen.strategies.secure_round`). Every
part that needs an individual update cannot run on that sum:

- robust aggregators (median, trimmed mean, Krum, Bulyan) and FedNova's
  normalised averaging look at each update;
- central DP clips each update on the server, and `update-norm-bound`
  compares each update's norm with the round's median;
- a deadline cuts a round between the protocol's stages, and FedBuff's
  asynchronous buffer has no round whose clients mask together;
- a cohort packs a node's clients into one message the protocol's stages
  do not address.

Arithmetic that cannot hold is refused too: a round's sum of 2^bits-step
quanta must fit the 32-bit modulus, and a round of fewer than three
clients would reveal each update to the others through the next model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings import Settings

MIN_CLIENTS = 3  # fewer: the sum less one's own update is the other's


def secagg_problem(s: Settings) -> str | None:
    """Why `s` cannot run secure aggregation, or None."""
    needs_each = [
        (s.aggregator != "mean", f"aggregator={s.aggregator!r}"),
        (s.server_update == "fednova" or s.aggregator == "fednova", "fednova"),
        (s.central_dp != "off", f"central-dp={s.central_dp!r}"),
        (s.update_norm_bound > 0, f"update-norm-bound={s.update_norm_bound:g}"),
    ]
    for on, given in needs_each:
        if on:
            return (
                f"secure-aggregation='secagg+' with {given}: it needs each "
                "client's update, and the server sees only the round's sum; "
                "allowed: aggregator='mean' with fedavg, fedopt or feddyn, "
                "no central-dp, update-norm-bound=0"
            )
    rounds = [
        (s.round_deadline > 0, f"round-deadline={s.round_deadline:g}",
         "a deadline would cut the protocol between its stages"),
        (s.mode == "async", "mode='async'",
         "FedBuff's buffer has no round whose clients mask together"),
        (s.client_execution == "cohort", "client-execution='cohort'",
         "a cohort packs a node's clients into one message; use 'sequential'"),
    ]  # fmt: skip
    for on, given, why in rounds:
        if on:
            return f"secure-aggregation='secagg+' with {given}: {why}"
    per_round = s.sample_size
    if per_round < MIN_CLIENTS:
        return (
            f"secure-aggregation='secagg+' with {per_round} clients per round: "
            f"needs at least {MIN_CLIENTS} (with two, each learns the other's "
            "update from the next model); raise client-frac or num-clients"
        )
    if s.secagg_bits + math.ceil(math.log2(per_round + 1)) > 32:
        return (
            f"secagg-bits={s.secagg_bits} with {per_round} clients per round: "
            "their sum overflows the 32-bit modulus; allowed: secagg-bits <= "
            f"{32 - math.ceil(math.log2(per_round + 1))}"
        )
    return None

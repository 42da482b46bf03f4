"""The simulated clock: how long a round would take over a network profile.

A simulation runs every client on this machine, so its real seconds say
nothing about a federation whose links and devices differ. Under a network
profile (`pollen.network_profile`) each training message is timed as it
would be on client k's node:

    t_k = (L_k + b_down * 8 / R_down,k)        the model reaches the client
        + o                                    the message's fixed overhead
        + s_k * c_k                            local work, slowed down
        + (L_k + b_up * 8 / R_up,k)            the update reaches the server

with L_k the one-way latency, R the link's rate (unlimited when 0), b the
bytes of the message's arrays, c_k the training seconds the client measured
and reported (`train-seconds`), s_k its slowdown and o the profile's
`message-overhead` (what a deployed message costs beyond its link and its
work: the node's pulls and pushes through the SuperLink, the ClientApp's
start; measured for this machine in docs/deployment.md). A lossy link's
rate is capped by TCP's steady-state throughput (Mathis et al. 1997,
rate <= 1.22 * MSS / (RTT * sqrt(p)), MSS 1448 bytes), since lost frames are
resent. Jitter averages out and is left out, and so is TCP's slow start.

A synchronous round is its slowest client (or the deadline), then, in a
round with personal evaluation, its slowest evaluating client (the same
formula with its `eval-seconds`, the model down and only metrics back),
then the server's own evaluation as it took on this machine. FedBuff's loop
(`strategies.asynchronous`) times its versions on this clock, the server's
work between versions included, and in a simulation also takes replies in
the order of their arrival on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..common.links import Direction, LinkShape
from ..network_profile import NetworkProfile, NodeProfile

MSS_BYTES = 1448  # a TCP segment's payload on Ethernet with timestamps
MATHIS_C = math.sqrt(3 / 2)  # the constant of Mathis et al.'s bound, ~1.22


def effective_rate(link: LinkShape, direction: Direction) -> float:
    """Bits per second a bulk transfer gets in `direction` (inf: unlimited)."""
    delay, _, rate, loss = link.direction(direction)
    rate = rate or math.inf
    rtt = 2 * delay
    if loss and rtt:
        rate = min(rate, MATHIS_C * MSS_BYTES * 8 / (rtt * math.sqrt(loss)))
    return rate


def transfer_seconds(num_bytes: int, link: LinkShape, direction: Direction) -> float:
    """One message of `num_bytes` over `link`: latency plus serialisation."""
    delay = link.direction(direction)[0]
    return delay + num_bytes * 8 / effective_rate(link, direction)


class SimulatedClock:
    """Client times and round times of one run under a profile."""

    def __init__(self, profile: NetworkProfile, num_clients: int) -> None:
        self.profile = profile
        self.nodes: list[NodeProfile] = profile.nodes(num_clients)

    def client_seconds(
        self, client: int, bytes_down: int, train_seconds: float, bytes_up: int
    ) -> float:
        """t_k of the module docstring: down, slowed-down work, up."""
        node = self.nodes[client]
        return (
            transfer_seconds(bytes_down, node.link, "down")
            + self.profile.message_overhead
            + node.slowdown * train_seconds
            + transfer_seconds(bytes_up, node.link, "up")
        )

    def evaluation_seconds(
        self, bytes_down: int, eval_seconds: Mapping[int, float]
    ) -> float:
        """The personal evaluation of a round: its slowest client, each sent
        `bytes_down` and replying with metrics alone (no arrays)."""
        return max(
            (self.client_seconds(c, bytes_down, s, 0) for c, s in eval_seconds.items()),
            default=0.0,
        )

    @staticmethod
    def round_seconds(
        times: Mapping[int, float], deadline: float = 0.0, late: bool = False
    ) -> float:
        """A synchronous round's time: the deadline (0: none) when a client
        was late for it, here or as the deployed round found it (`late`:
        the round stopped waiting then), otherwise its slowest client's."""
        if deadline and (late or any(t > deadline for t in times.values())):
            return deadline
        return max(times.values(), default=0.0)

    @staticmethod
    def late(times: Mapping[int, float], deadline: float) -> list[int]:
        """The clients whose reply comes after the deadline (0: none)."""
        return sorted(c for c, t in times.items() if deadline and t > deadline)

"""Calibrating central DP's noise multiplier to a privacy budget.

`central-epsilon` is turned into the noise multiplier z of a Gaussian
mechanism released once a round (sample rate 1: the clipped sum over the
round's clients), with Opacus's RDP accountant (Mironov, 2017,
https://arxiv.org/abs/1702.07476). `Settings` calls it to check and report
the budget before any process starts; the aggregation step
(`strategies/central_dp.py`) calls it to plan its noise.
"""

from __future__ import annotations


def noise_for_epsilon(epsilon: float, releases: int, delta: float) -> float:
    """The smallest z (Opacus's search, same accountant) whose `releases`
    rounds spend at most `epsilon` at `delta`: `central-epsilon`."""
    from opacus.accountants.utils import get_noise_multiplier

    z = get_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=1.0,
        steps=releases, accountant="rdp",
    )  # fmt: skip
    return float(z)

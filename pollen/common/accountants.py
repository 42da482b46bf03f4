"""Privacy accountants: the epsilon of a repeated, subsampled Gaussian mechanism,
and the noise that keeps it within a budget.

Both of pollen's kinds of DP release the same mechanism T times: a Gaussian
of noise multiplier z (noise std z x the sensitivity) on a sample taken with
probability q. DP-SGD releases one per step (q = batch / shard size,
Poisson batches); central DP one per round, with q = 1 (no amplification by
sampling is claimed, `strategies/central_dp.py` says why). An accountant
bounds the epsilon of T such releases at a delta; the three differ only in
how tight that bound is:

- `rdp`: Renyi DP (Mironov 2017, https://arxiv.org/abs/1702.07476; the
  subsampled Gaussian of Mironov, Talwar and Zhang 2019,
  https://arxiv.org/abs/1908.10530), Opacus's `RDPAccountant`. The loosest,
  and the one most papers report.
- `prv`: privacy random variables (Gopi, Lee and Wutschitz 2021,
  https://arxiv.org/abs/2106.02848), Opacus's `PRVAccountant`: the privacy
  loss distribution composed numerically by FFT, with an error bound.
- `pld`: privacy loss distributions (Koskela et al. 2020,
  https://arxiv.org/abs/1906.03049; Doroshenko et al. 2022,
  https://arxiv.org/abs/2207.04380), Google's `dp-accounting`
  `PLDAccountant`: the same idea with pessimistic discretisation.

PRV and PLD are within about 1 % of the exact epsilon where it is known (a
Gaussian mechanism without sampling, Balle and Wang 2018); RDP is up to
15 % above it. A tighter accountant spends the same budget with less noise, so
more accuracy at the same guarantee. The chosen `accountant` calibrates the
noise and drives the budget; a run's summary gives every accountant's
epsilon for the same releases. Both libraries are imported where they are
used: each takes seconds to import on a 2-core machine.
"""

from __future__ import annotations

import logging
import math
import warnings
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

ACCOUNTANTS = {
    "rdp": "Renyi DP (Opacus's RDPAccountant): the loosest bound, the usual one",
    "prv": "privacy random variables (Opacus's PRVAccountant): near-exact",
    "pld": "privacy loss distribution (Google's dp-accounting PLDAccountant): near-exact",
}


def epsilon(
    accountant: str, *, noise_multiplier: float, sample_rate: float, steps: int,
    delta: float,
) -> float:  # fmt: skip
    """The epsilon at `delta` of `steps` Gaussian releases of multiplier
    `noise_multiplier`, each on a sample of rate `sample_rate`, under
    `accountant`; 0 before the first release."""
    check_accountant(accountant)
    if steps == 0:
        return 0.0
    with _quiet():
        if accountant == "pld":
            return _pld_epsilon(noise_multiplier, sample_rate, steps, delta)
        return _opacus_epsilon(accountant, noise_multiplier, sample_rate, steps, delta)


# Above this RDP epsilon the tighter accountants are not asked: such a
# guarantee protects nothing, and their numerical composition takes tens of
# seconds there.
WORTH_TIGHTENING = 100.0


def epsilons(
    *, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
    counting: str = "rdp",
) -> dict[str, float | None]:  # fmt: skip
    """The same releases under every accountant; None where one gives no
    finite bound (PRV's error bound outgrows epsilon at a large epsilon, for
    instance) or, for an accountant other than RDP and the run's own
    (`counting`), where RDP's exceeds `WORTH_TIGHTENING`."""
    spent: dict[str, float | None] = {}
    for name in ACCOUNTANTS:  # rdp first
        skip = name not in ("rdp", counting)
        if skip and (spent["rdp"] or 0.0) > WORTH_TIGHTENING:
            spent[name] = None
            continue
        try:
            value = epsilon(
                name, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                steps=steps, delta=delta,
            )  # fmt: skip
        except (ValueError, RuntimeError, ArithmeticError):
            value = math.inf
        spent[name] = value if math.isfinite(value) else None
    return spent


@cache
def noise_multiplier(
    accountant: str, *, epsilon: float, delta: float, sample_rate: float, steps: int
) -> float:
    """The smallest noise multiplier (within the libraries' tolerances, always
    on the safe side) whose `steps` releases at `sample_rate` spend at most
    `epsilon` at `delta` under `accountant`. A search of a few seconds:
    cached per process."""
    check_accountant(accountant)
    with _quiet():
        if accountant == "pld":
            return _pld_noise(epsilon, delta, sample_rate, steps)
        from opacus.accountants.utils import get_noise_multiplier

        z = get_noise_multiplier(
            target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
            steps=steps, accountant=accountant,
        )  # fmt: skip
        return float(z)


def check_accountant(name: str) -> None:
    if name not in ACCOUNTANTS:
        raise ValueError(
            f"unknown accountant {name!r}; allowed: {', '.join(ACCOUNTANTS)}"
        )


def _opacus_epsilon(
    accountant: str, z: float, sample_rate: float, steps: int, delta: float
) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    counter = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    counter.history = [(z, sample_rate, steps)]
    return float(counter.get_epsilon(delta))


def _pld_event(z: float, sample_rate: float, steps: int) -> DpEvent:
    from dp_accounting import dp_event

    release = dp_event.GaussianDpEvent(z)
    if sample_rate < 1:
        release = dp_event.PoissonSampledDpEvent(sample_rate, release)
    return dp_event.SelfComposedDpEvent(release, steps)


def _pld_epsilon(z: float, sample_rate: float, steps: int, delta: float) -> float:
    from dp_accounting.pld import PLDAccountant

    counter = PLDAccountant()
    counter.compose(_pld_event(z, sample_rate, steps))
    return float(counter.get_epsilon(delta))


def _pld_noise(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """dp-accounting's calibration: Brent's method on the noise multiplier,
    whose answer it moves by the tolerance where needed to keep the budget.
    The search runs between half and all of RDP's answer (RDP's bound is
    looser, so its noise is enough): below that, a PLD of thousands of
    steps at little noise would need gigabytes."""
    from dp_accounting import mechanism_calibration
    from dp_accounting.pld import PLDAccountant

    enough = noise_multiplier(
        "rdp", epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps
    )
    z = mechanism_calibration.calibrate_dp_mechanism(
        PLDAccountant, lambda z: _pld_event(z, sample_rate, steps),
        epsilon, delta,
        mechanism_calibration.ExplicitBracketInterval(enough / 2, enough), tol=1e-3,
    )  # fmt: skip
    return float(z)


class _quiet(warnings.catch_warnings):
    """Silence what the libraries say on the way (Opacus's "optimal order is
    the largest alpha", RDP orders its series cannot reach, PRV's log of
    zero at q = 1): expected, and nothing a user can act on."""

    def __init__(self) -> None:
        super().__init__()
        self._level = logging.root.manager.disable

    def __enter__(self) -> None:
        super().__enter__()
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        logging.disable(self._level)
        super().__exit__(*exc)

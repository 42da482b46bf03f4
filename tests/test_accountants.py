"""The privacy accountants: each equals its library's own computation on the
same releases, the two near-exact ones agree with the closed-form epsilon of
composed Gaussian mechanisms (and RDP bounds it from above), calibration
keeps the budget, and the summary counts a run's releases under each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from flwr.app import ArrayRecord
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from pollen.common import accountants
from pollen.common.accountants import ACCOUNTANTS, epsilon, epsilons, noise_multiplier
from pollen.protocol import DP_EPSILON, DP_NOISE_MULTIPLIER, DP_SAMPLE_RATE, DP_STEPS
from pollen.runs.notify import Notifier
from pollen.runs.recorder import RoundRecorder
from pollen.runs.results import privacy_line
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.round import RoundOutcome
from pollen.task.privacy import PrivacyLedger, PrivacyPlan

DELTA = 1e-5


def exact_epsilon(z: float, releases: int, delta: float) -> float:
    """The exact epsilon of `releases` Gaussian mechanisms of multiplier z
    (sensitivity 1, no sampling): together one Gaussian mechanism of
    mu = sqrt(T) / z, whose delta(eps) = Phi(-eps/mu + mu/2) -
    e^eps Phi(-eps/mu - mu/2) (Balle & Wang 2018, Theorem 8)."""
    mu = math.sqrt(releases) / z

    def gap(eps: float) -> float:
        return (
            norm.cdf(-eps / mu + mu / 2)
            - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
            - delta
        )

    return brentq(gap, 0.0, 500.0)


def test_one_gaussian_release_by_hand() -> None:
    """One release at z = 2, delta = 1e-5. By hand, mu = 1/2 and
    delta(eps) = Phi(1/4 - 2 eps) - e^eps Phi(-1/4 - 2 eps); at eps = 2.034
    that is Phi(-3.818) - 7.644 Phi(-4.318) = 6.727e-5 - 7.644 x 7.873e-6
    = 7.09e-6 < 1e-5, and at eps = 1.95 it is Phi(-3.65) - 7.029 Phi(-4.15)
    = 1.311e-4 - 1.168e-4 = 1.43e-5 > 1e-5, so the exact epsilon lies
    between. PLD and PRV land there; RDP above."""
    assert 1.95 < exact_epsilon(2.0, 1, DELTA) < 2.034
    spent = epsilons(noise_multiplier=2.0, sample_rate=1.0, steps=1, delta=DELTA)
    assert 1.95 < spent["pld"] < 2.05 and 1.95 < spent["prv"] < 2.05
    assert spent["rdp"] > 2.034


@pytest.mark.parametrize(("z", "releases"), [(1.0, 10), (2.0, 50), (0.8, 3)])
def test_near_exact_accountants_within_1_percent_and_rdp_above(
    z: float, releases: int
) -> None:
    exact = exact_epsilon(z, releases, DELTA)
    spent = epsilons(noise_multiplier=z, sample_rate=1.0, steps=releases, delta=DELTA)
    assert spent["pld"] == pytest.approx(exact, rel=0.01)
    assert spent["prv"] == pytest.approx(exact, rel=0.01)
    assert exact <= spent["rdp"] <= 1.15 * exact


def _libraries(z: float, q: float, steps: int) -> dict[str, float]:
    """Each library's own epsilon for `steps` Poisson-sampled Gaussians."""
    rdp, prv = RDPAccountant(), PRVAccountant()
    for counter in (rdp, prv):
        for _ in range(steps):
            counter.step(noise_multiplier=z, sample_rate=q)
    pld = PLDAccountant()
    release = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z))
    pld.compose(release, steps)
    return {
        "rdp": rdp.get_epsilon(DELTA),
        "prv": prv.get_epsilon(DELTA),
        "pld": pld.get_epsilon(DELTA),
    }


def test_each_accountant_is_its_librarys_own_count() -> None:
    """DP-SGD's releases (q = 0.05, 200 steps, z = 1.1), stepped one by one
    in each library, and pollen's one call per accountant; tighter ones
    below RDP."""
    theirs = _libraries(1.1, 0.05, 200)
    ours = epsilons(noise_multiplier=1.1, sample_rate=0.05, steps=200, delta=DELTA)
    for name in ACCOUNTANTS:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-6), name
    assert ours["pld"] == pytest.approx(ours["prv"], rel=0.01)
    assert ours["pld"] < 0.95 * ours["rdp"]


@pytest.mark.parametrize("name", ACCOUNTANTS)
def test_calibration_keeps_the_budget_and_only_just(name: str) -> None:
    z = noise_multiplier(name, epsilon=4.0, delta=DELTA, sample_rate=0.05, steps=200)
    spent = epsilon(name, noise_multiplier=z, sample_rate=0.05, steps=200, delta=DELTA)
    assert 3.9 <= spent <= 4.0
    assert (
        epsilon(name, noise_multiplier=z, sample_rate=0.05, steps=0, delta=DELTA) == 0
    )


def test_tighter_accountants_need_less_noise() -> None:
    z = {
        name: noise_multiplier(
            name, epsilon=4.0, delta=DELTA, sample_rate=0.05, steps=200
        )
        for name in ACCOUNTANTS
    }
    assert z["pld"] < 0.97 * z["rdp"] and z["prv"] < 0.97 * z["rdp"]
    assert z["pld"] == pytest.approx(z["prv"], rel=0.01)


def test_no_bound_is_none_and_a_useless_one_is_not_tightened() -> None:
    """PRV gives infinity where its error bound outgrows epsilon (a JSON
    summary cannot hold it); above RDP epsilon 100 PRV and PLD are not
    asked (tens of seconds for a guarantee that protects nothing)."""
    spent = epsilons(noise_multiplier=0.3, sample_rate=1.0, steps=100, delta=DELTA)
    assert spent["rdp"] > accountants.WORTH_TIGHTENING
    assert spent["prv"] is None and spent["pld"] is None


def test_the_accountant_that_counts_is_always_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten releases at z = 1 (exact epsilon about 5.6) with the bar for
    tightening lowered below RDP's: PRV is not asked, but PLD, which
    counted the run, is."""
    monkeypatch.setattr(accountants, "WORTH_TIGHTENING", 5.0)
    spent = epsilons(noise_multiplier=1.0, sample_rate=1.0, steps=10, delta=DELTA,
                     counting="pld")  # fmt: skip
    assert spent["rdp"] > 5.0 and spent["prv"] is None
    assert spent["pld"] == pytest.approx(exact_epsilon(1.0, 10, DELTA), rel=0.01)


def test_an_unknown_accountant_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown accountant .moments.*rdp, prv, pld"):
        epsilon("moments", noise_multiplier=1.0, sample_rate=1.0, steps=1, delta=DELTA)
    with pytest.raises(SettingsError, match=r"accountant.*one of rdp, prv, pld"):
        Settings.from_run_config({"accountant": "moments"})


def test_dp_sgd_plan_calibrates_and_counts_with_the_chosen_accountant() -> None:
    plan = PrivacyPlan.calibrate(
        epsilon=4.0, delta=DELTA, max_grad_norm=1.0, shard_size=400, batch_size=20,
        local_epochs=1, rounds=10, accountant="prv",
    )  # fmt: skip
    assert plan.noise_multiplier == noise_multiplier(
        "prv", epsilon=4.0, delta=DELTA, sample_rate=0.05, steps=200
    )
    ledger = PrivacyLedger(plan, steps=60)
    metrics = ledger.metrics()
    assert metrics[DP_EPSILON] == epsilon(
        "prv", noise_multiplier=plan.noise_multiplier, sample_rate=0.05, steps=60,
        delta=DELTA,
    )  # fmt: skip
    assert metrics[DP_SAMPLE_RATE] == 0.05 and metrics[DP_STEPS] == 60


def _outcome(
    updates: list[ClientUpdate], aggregation: dict | None = None
) -> RoundOutcome:
    return RoundOutcome(
        arrays=ArrayRecord(), clients=[u.client for u in updates], updates=updates,
        bytes_down=0, bytes_up=0, skipped=False, failures=[], clipped=[],
        evaluating=[], eval_bytes=0, personal={}, aggregation=aggregation or {},
    )  # fmt: skip


def test_the_summary_counts_the_client_that_spent_most_under_every_accountant(
    tmp_path: Path,
) -> None:
    settings = Settings.from_run_config(
        {"rounds": 2, "dp": True, "model": "cnn-gn", "accountant": "pld"}
    )
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    assert recorder.privacy() is None

    def reply(client: int, z: float, steps: int) -> ClientUpdate:
        spent = epsilon("pld", noise_multiplier=z, sample_rate=0.1, steps=steps,
                        delta=DELTA)  # fmt: skip
        metrics = {DP_EPSILON: spent, DP_NOISE_MULTIPLIER: z, DP_SAMPLE_RATE: 0.1,
                   DP_STEPS: steps}  # fmt: skip
        return ClientUpdate(client, {}, metrics, 1.0)

    recorder.record(1, _outcome([reply(0, 1.0, 10), reply(1, 1.5, 10)]), 1.0, 0.5, 0.1)
    recorder.record(2, _outcome([reply(1, 1.5, 20)]), 1.0, 0.5, 0.1)
    privacy = recorder.privacy()
    assert privacy is not None
    assert privacy["accountant"] == "pld" and privacy["delta"] == DELTA
    spent = privacy["example-level"]
    assert spent["client"] == 0 and spent["steps"] == 10  # 1.0 x 10 beats 1.5 x 20
    assert spent["epsilon"] == epsilons(
        noise_multiplier=1.0, sample_rate=0.1, steps=10, delta=DELTA
    )
    assert "user-level" not in privacy
    assert privacy_line(privacy).startswith(
        "pollen: privacy spent at delta 1e-05 (pld counts): example-level epsilon "
        f"{spent['epsilon']['rdp']:.2f} (rdp), "
    )
    json.dumps(privacy, allow_nan=False)


def test_the_summary_counts_central_dps_releases(tmp_path: Path) -> None:
    settings = Settings.from_run_config(
        {"rounds": 3, "central-dp": "fixed", "model": "mlp"}
    )
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    report = {"clip-norm": 1.0, "releases": 2, "noise-multiplier": 1.2, "epsilon": 9.0}
    recorder.record(1, _outcome([], report), 1.0, 0.5, 0.1)
    recorder.record(2, _outcome([], {}), 1.0, 0.5, 0.1)  # a round that did not release
    privacy = recorder.privacy()
    assert privacy is not None and "example-level" not in privacy
    assert privacy["user-level"] == {
        "noise-multiplier": 1.2, "releases": 2,
        "epsilon": epsilons(noise_multiplier=1.2, sample_rate=1.0, steps=2, delta=DELTA),
    }  # fmt: skip

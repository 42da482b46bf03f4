"""Central (user-level) DP: clipping, the fixed denominator and the noise
by hand; Flower's DP wrappers on the same replies; the adaptive clip norm;
the noise calibrated under each accountant (the accountants themselves:
tests/test_accountants.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.supercore.differential_privacy import compute_adaptive_noise_params

from pollen.common.clipping import clipped_reply
from pollen.protocol import UPDATE_NORM
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.central_dp import (
    CentralDP,
    epsilon_spent,
    update_noise_multiplier,
)
from tests.conftest import client_update, reply_from


class NoNoise:
    """A generator whose every Gaussian draw is its mean: the mechanism
    without noise, to check the rest exactly."""

    def normal(self, loc=0.0, scale=1.0, size=None):
        return np.full(size, loc) if size is not None else loc


def update(client: int, w: list[float], metrics: dict | None = None) -> ClientUpdate:
    return client_update(client, {"w": np.asarray(w, dtype=np.float32)}, 7, metrics)


def mechanism(**kw: object) -> CentralDP:
    options = {"clip_norm": 2.0, "noise_multiplier": 1.0, "sample_size": 2,
               "delta": 1e-5, "rng": NoNoise(), **kw}  # fmt: skip
    return CentralDP(**options)  # type: ignore[arg-type]


def test_clip_sum_and_fixed_denominator_by_hand() -> None:
    """x = [1, 1]; client 0 moved by [3, 4] (norm 5, clipped to C = 2:
    [1.2, 1.6]), client 1 by [0.6, 0.8] (norm 1, kept). Sum [1.8, 2.4] over
    m = 2: x_bar = [1.9, 2.2]; over a planned m = 3 (one client failed):
    [1.6, 1.8]. Example counts play no part."""
    current = {"w": np.array([1.0, 1.0], np.float32)}
    updates = [update(0, [4.0, 5.0]), update(1, [1.6, 1.8])]
    np.testing.assert_allclose(mechanism()(updates, current).arrays["w"], [1.9, 2.2])
    three = mechanism(sample_size=3)(updates, current).arrays["w"]
    np.testing.assert_allclose(three, [1.6, 1.8])


def test_noise_has_std_z_c_on_the_sum() -> None:
    """No update at all: x_bar - x is the noise over m, of std z C / m."""
    shape = (200, 100)
    current = {"w": np.zeros(shape, np.float32)}
    updates = [update(k, np.zeros(shape).tolist()) for k in range(4)]
    dp = CentralDP(clip_norm=0.5, noise_multiplier=1.3, sample_size=4, delta=1e-5,
                   rng=np.random.default_rng(0))  # fmt: skip
    noise = dp(updates, current).arrays["w"]
    assert noise.std() == pytest.approx(1.3 * 0.5 / 4, rel=0.02)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("seed", [0, 1])
def test_fixed_clipping_equals_flowers_wrapper_without_noise(seed: int) -> None:
    """Flower's server-side fixed clipping around FedAvg (equal example
    counts, every sampled client replies, noise multiplier 0) gives the same
    model as pollen's mechanism without noise."""
    rng = np.random.default_rng(seed)
    shapes = {"a": (3, 4), "b": (5,)}
    current = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    clients = [
        {k: (v + rng.normal(scale=scale, size=v.shape)).astype(np.float32)
         for k, v in current.items()}
        for scale in (0.1, 1.0, 3.0)
    ]  # fmt: skip
    messages = [
        reply_from(
            k + 1,
            RecordDict(
                {
                    "arrays": ArrayRecord({n: Array(v) for n, v in c.items()}),
                    "metrics": MetricRecord({"num-examples": 10}),
                }
            ),
        )
        for k, c in enumerate(clients)
    ]
    flower = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(), noise_multiplier=0.0, clipping_norm=1.5, num_sampled_clients=3
    )
    flower.current_arrays = ArrayRecord({n: Array(v) for n, v in current.items()})
    theirs, _ = flower.aggregate_train(1, messages)
    updates = [client_update(k, c, 10) for k, c in enumerate(clients)]
    ours = mechanism(clip_norm=1.5, sample_size=3)(updates, current).arrays
    for name in shapes:
        np.testing.assert_allclose(
            ours[name], theirs[name].numpy(), rtol=1e-5, atol=1e-6
        )


def test_adaptive_clip_norm_follows_the_unclipped_share() -> None:
    """C = 2, gamma = 0.2, eta = 0.2: one of two updates is unclipped, b_bar
    = (1 - 2/2) / 2 + 1/2 = 0.5 > gamma (the centred count, no noise), so C
    shrinks to 2 exp(-0.2 x 0.3); noise z_Delta from Theorem 1 of Andrew et
    al. equals Flower's for the same z and sigma_b."""
    current = {"w": np.array([1.0, 1.0], np.float32)}
    updates = [update(0, [4.0, 5.0]), update(1, [1.6, 1.8])]
    dp = mechanism(adaptive=True, quantile=0.2, clip_lr=0.2, count_noise=1.0)
    aggregate = dp(updates, current)
    assert aggregate.report["clip-norm"] == 2.0 and aggregate.report["unclipped"] == 0.5
    assert dp.clip_norm == pytest.approx(2.0 * math.exp(-0.2 * 0.3))
    # every update far above C: b_bar = 0 < gamma, so C grows
    grow = mechanism(adaptive=True, quantile=0.5, count_noise=1.0)
    grow([update(0, [40.0, 50.0]), update(1, [16.0, 18.0])], current)
    assert grow.clip_norm == pytest.approx(2.0 * math.exp(0.2 * 0.5))
    _, flowers_z = compute_adaptive_noise_params(1.0, 2, 1.0)
    assert dp.z_update == pytest.approx(flowers_z) == pytest.approx((1 - 0.25) ** -0.5)
    assert update_noise_multiplier(1.0, 0.0) == 1.0


def test_client_side_clipping_and_its_reported_norm() -> None:
    """The client moves its reply back onto the ball; the integer counter is
    untouched; the server counts b_k from the norm the client reports."""
    sent = ArrayRecord({"w": Array(np.array([1.0, 1.0], np.float32)),
                        "n": Array(np.array(3, np.int64))})  # fmt: skip
    trained = ArrayRecord({"w": Array(np.array([4.0, 5.0], np.float32)),
                           "n": Array(np.array(5, np.int64))})  # fmt: skip
    reply, norm = clipped_reply(sent, trained, 2.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(reply["w"].numpy(), [2.2, 2.6])
    assert int(reply["n"].numpy()) == 5
    dp = mechanism(adaptive=True, client_clips=True, count_noise=1.0)
    assert dp.train_config() == {"clip-norm": 2.0}
    assert dp.required_metrics == (UPDATE_NORM,)
    current = {"w": np.array([1.0, 1.0], np.float32)}
    updates = [
        update(0, [2.2, 2.6], {UPDATE_NORM: 5.0}),
        update(1, [1.6, 1.8], {UPDATE_NORM: 1.0}),
    ]
    assert dp(updates, current).report["unclipped"] == 0.5


def test_state_survives_a_checkpoint() -> None:
    dp = mechanism(adaptive=True, count_noise=1.0)
    dp(
        [update(0, [40.0, 50.0]), update(1, [16.0, 18.0])],
        {"w": np.zeros(2, np.float32)},
    )
    again = mechanism(adaptive=True, count_noise=1.0)
    again.load_state_arrays(dp.state_arrays())
    assert (again.clip_norm, again.releases) == (dp.clip_norm, 1)
    assert again.epsilon == dp.epsilon > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"aggregator": "median"}, r"leave aggregator at mean"),
        ({"strategy": "fedbuff"}, r"use mode='sync'"),
        ({"strategy": "scaffold"}, r"Delta c_k, FedProto.s prototypes. would leave"),
        ({"local-objective": "fedproto"}, r"FedProto.s prototypes. would leave"),
        ({"strategy": "fedproto"}, r"sharing='local' with central-dp"),
        ({"dp": True, "model": "cnn-gn"}, r"not both"),
        (
            {"central-dp": "adaptive", "central-noise-multiplier": 2.0},
            r"count noise 0.5 must exceed",
        ),
        ({"update-norm-bound": 2.0}, r"set update-norm-bound=0"),
        ({"resume": "results/x"}, r"released once already"),
        ({"model": "mlp-bn"}, r"BatchNorm's running statistics"),
    ],
)
def test_refused_combinations_name_the_reason(overrides: dict, message: str) -> None:
    config = {"num-clients": 10, "client-frac": 1.0, "central-dp": "fixed", **overrides}
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config(config)


def test_the_count_is_centred_so_one_client_moves_it_by_a_half() -> None:
    """The released count sum_k (b_k - 1/2) changes by 1/2 when one client
    comes or goes, whatever its bit: the sensitivity Theorem 1 needs."""

    def released(bits: list[int]) -> float:
        dp = mechanism(adaptive=True, count_noise=1.0, sample_size=len(bits))
        norms = [1.0 if b else 50.0 for b in bits]  # C = 2
        updates = [update(k, [1.0 + v, 1.0]) for k, v in enumerate(norms)]
        report = dp(updates, {"w": np.array([1.0, 1.0], np.float32)}).report
        return (report["unclipped"] - 0.5) * dp.sample_size

    base = [1, 0, 1]
    for extra in (0, 1):
        assert abs(released([*base, extra]) - released(base)) == pytest.approx(0.5)


def test_central_epsilon_calibrates_the_noise_for_the_planned_rounds() -> None:
    """z for epsilon 3 over 20 rounds spends at most 3 (within Opacus's
    0.01 tolerance) after round 20, and more noise means less epsilon."""
    settings = Settings.from_run_config(
        {"central-dp": "fixed", "central-epsilon": 3.0, "rounds": 20, "model": "mlp"}
    )
    dp = CentralDP.from_settings(settings)
    assert 2.95 <= epsilon_spent(dp.z, 20, 1e-5) <= 3.0
    assert epsilon_spent(dp.z * 2, 20, 1e-5) < 1.5


def test_a_tighter_accountant_calibrates_less_noise_and_counts_with_itself() -> None:
    """Under PLD the same budget needs less noise than under RDP, the
    mechanism counts its releases with PLD, and its report carries what
    the summary needs to count them under every accountant."""
    run = {"central-dp": "fixed", "central-epsilon": 3.0, "rounds": 20, "model": "mlp"}
    rdp = CentralDP.from_settings(Settings.from_run_config(run))
    pld = CentralDP.from_settings(
        Settings.from_run_config({**run, "accountant": "pld"})
    )
    assert pld.z < 0.97 * rdp.z
    assert 2.97 <= epsilon_spent(pld.z, 20, 1e-5, "pld") <= 3.0
    pld.rng = NoNoise()
    report = pld([update(0, [1.0, 0.0])], {"w": np.zeros(2)}).report
    assert report["releases"] == 1 and report["noise-multiplier"] == pld.z
    assert report["epsilon"] == pytest.approx(epsilon_spent(pld.z, 1, 1e-5, "pld"))

"""FedNova: the effective steps a_k against the paper's closed forms, the
normalised average by hand, and its reply requirement."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.common.steps import effective_steps
from pollen.protocol import EFFECTIVE_STEPS
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import ClientUpdate, Mean
from pollen.strategies.fednova import FedNova
from tests.conftest import client_update


@pytest.mark.parametrize("steps", [1, 5, 37])
def test_effective_steps_match_the_papers_closed_forms(steps: int) -> None:
    """Plain SGD: tau. Momentum rho: [tau - rho (1 - rho^tau) / (1 - rho)] /
    (1 - rho) (Wang et al. 2020, Section 5). Proximal mu with lr eta:
    [1 - (1 - eta mu)^tau] / (eta mu)."""
    assert effective_steps(steps, 0.1, 0.0, 0.0) == pytest.approx(steps)
    rho = 0.9
    momentum = (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)
    assert effective_steps(steps, 0.1, rho, 0.0) == pytest.approx(momentum)
    eta, mu = 0.05, 0.5
    prox = (1 - (1 - eta * mu) ** steps) / (eta * mu)
    assert effective_steps(steps, eta, 0.0, mu) == pytest.approx(prox)


def test_momentum_by_hand_for_two_steps() -> None:
    """rho = 0.5, two steps: m1 = 1, m2 = 1.5; the update is -(1 + 1.5) lr."""
    assert effective_steps(2, 0.1, 0.5, 0.0) == pytest.approx(2.5)


def update(
    client: int, examples: float, a: float, **arrays: np.ndarray
) -> ClientUpdate:
    return client_update(client, arrays, examples, {EFFECTIVE_STEPS: a})


def test_normalised_average_by_hand() -> None:
    """x = [0, 10]; client 0 (1 example, a = 1) moved w by [2, 2], client 1
    (3 examples, a = 4) by [8, 0]. p = (1/4, 3/4), tau_eff = 1/4 + 3 = 3.25,
    direction = 1/4 [2, 2] / 1 + 3/4 [8, 0] / 4 = [2, 0.5]: x + 3.25 x
    [2, 0.5] = [6.5, 11.625]. The statistic s (not trained) is the mean."""
    current = {"w": np.array([0.0, 10.0]), "s": np.array([1.0])}
    updates = [
        update(0, 1, 1.0, w=np.array([2.0, 12.0]), s=np.array([3.0])),
        update(1, 3, 4.0, w=np.array([8.0, 10.0]), s=np.array([5.0])),
    ]
    result = FedNova()(updates, current, trained=("w",))
    np.testing.assert_allclose(result.arrays["w"], [6.5, 11.625])
    np.testing.assert_allclose(result.arrays["s"], [4.5])  # (3 + 15) / 4


def test_equal_effective_steps_give_the_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    current = {"w": rng.normal(size=(3, 4))}
    updates = [
        update(k, n, 7.0, w=rng.normal(size=(3, 4))) for k, n in enumerate([5, 1, 9])
    ]
    nova = FedNova()(updates, current, trained=("w",)).arrays["w"]
    mean = Mean()(updates, current).arrays["w"]
    np.testing.assert_allclose(nova, mean)


def test_fednova_needs_sgd_clients() -> None:
    with pytest.raises(SettingsError, match=r"defined for SGD"):
        Settings.from_run_config({"aggregator": "fednova", "client-optimizer": "adam"})
    assert FedNova.required_metrics == (EFFECTIVE_STEPS,)

"""A new part is its class, one catalogue line and its test: an aggregator
and a local objective defined here, registered in the catalogue by import
path (as a user's own plug-in will be), are validated by `Settings` with
their own rules, and the aggregator plays a round."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from torch import nn

from pollen import catalog
from pollen.catalog import Part
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import Aggregate, ClientUpdate, Rule
from pollen.strategies.compose import build_strategy
from pollen.strategies.round import play_round
from pollen.strategies.sampling import Participants, Roster
from pollen.task.objective_parts import Plain
from pollen.task.objectives import LocalObjective
from tests.test_round import EchoGrid

pytestmark = pytest.mark.usefixtures("task_identity")


class CoordinateMax(Rule):
    """Toy aggregator: the largest value of each coordinate, defined for
    f + 2 replies (f = `byzantine-clients`)."""

    def __init__(self, byzantine: int) -> None:
        self.byzantine = byzantine

    @property
    def min_updates(self) -> int:
        return self.byzantine + 2

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> CoordinateMax:
        return cls(settings.byzantine_clients)

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        keys: Collection[str],
        trained: Collection[str] = (),
    ) -> Aggregate:
        arrays = {
            key: np.max([u.arrays[key].astype(np.float64) for u in updates], axis=0)
            for key in keys
        }
        return Aggregate(arrays, tuple(updates))


class Shrink:
    """Toy term: grad R = mu theta (a pull towards zero), no state."""

    exclude_bn = False

    def __init__(self, mu: float) -> None:
        self.mu = mu
        self.params: dict[str, nn.Parameter] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> Shrink:
        return cls(settings.prox_mu)

    @property
    def pull(self) -> float:
        return 0.0

    def load(self, context, client, anchor, content) -> None:
        self.params = anchor

    @torch.no_grad()
    def add_gradients(self, named: dict[str, nn.Parameter]) -> None:
        for name in self.params:
            named[name].grad = self.mu * named[name].detach().clone()

    def save(self, context, client, named) -> None:
        """Nothing to keep."""

    def reply_records(self) -> dict:
        return {}


class ShrinkObjective(Plain):
    """Toy local objective: the data loss plus mu/2 ||theta||^2, refused
    without a weight (it would be plain)."""

    term = f"{__name__}:Shrink"

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        if settings.prox_mu == 0:
            return "local-objective='shrink' with prox-mu=0: the term would be 0"
        return super().problem(settings)


@pytest.fixture
def toy_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two toy parts, each one catalogue line."""
    monkeypatch.setitem(
        catalog.AGGREGATORS,
        "coordinate-max",
        Part("coordinate-max", "toy", f"{__name__}:CoordinateMax"),
    )
    monkeypatch.setitem(
        catalog.LOCAL_OBJECTIVES,
        "shrink",
        Part("shrink", "toy", f"{__name__}:ShrinkObjective"),
    )


TOY = {
    "aggregator": "coordinate-max", "local-objective": "shrink", "num-clients": 2,
    "client-frac": 1.0, "prox-mu": 0.5,
}  # fmt: skip


def test_settings_ask_a_new_part_its_own_rules(toy_parts: None) -> None:
    settings = Settings.from_run_config(TOY)
    assert (settings.aggregator, settings.local_objective) == (
        "coordinate-max",
        "shrink",
    )
    with pytest.raises(SettingsError) as few:
        Settings.from_run_config({**TOY, "byzantine-clients": 1})
    assert str(few.value) == (
        "aggregator='coordinate-max' needs 3 replies per round; a round samples 2 "
        "(client-frac x num-clients); sample more clients"
    )
    with pytest.raises(SettingsError, match="prox-mu=0: the term would be 0"):
        Settings.from_run_config({**TOY, "prox-mu": 0.0})
    with pytest.raises(SettingsError, match="aggregator='coordinate-max' with mode"):
        Settings.from_run_config({**TOY, "mode": "async"})


def test_a_new_local_objective_is_built_from_its_part(toy_parts: None) -> None:
    objective = LocalObjective.from_settings(Settings.from_run_config(TOY))
    assert objective.sam_rho == 0.0 and isinstance(objective.regularizer, Shrink)
    theta = nn.Parameter(torch.tensor([2.0, -4.0]))
    objective.regularizer.load(None, 0, {"w": theta}, None)
    objective.add_regularizer_gradient({"w": theta})
    assert theta.grad.tolist() == [1.0, -2.0]


def test_a_new_aggregator_plays_a_round(toy_parts: None) -> None:
    settings = Settings.from_run_config(TOY)
    model = nn.Linear(2, 1)
    strategy, personal = build_strategy(settings, model)
    assert isinstance(strategy.aggregator, CoordinateMax)
    start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    arrays = ArrayRecord(model.state_dict())
    roster = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)
    outcome = play_round(
        EchoGrid(), strategy, personal, 1, arrays,
        (ConfigRecord(), ConfigRecord()), Participants(roster), 10.0,
    )  # fmt: skip
    # client k replies with the model + k + 1: the largest is client 1's, + 2
    for key, value in start.items():
        np.testing.assert_allclose(outcome.arrays[key].numpy(), value + 2, rtol=1e-6)


def test_validating_settings_imports_no_torch() -> None:
    """The CLI validates every run config before anything runs, with the
    parts' rules, and still without the seconds torch's import takes."""
    code = (
        "import sys; from pollen.settings import Settings\n"
        "for config in ({}, {'strategy': 'scaffold'}, {'strategy': 'feddyn'},\n"
        "               {'strategy': 'fedadam'}, {'strategy': 'fedbuff'},\n"
        "               {'aggregator': 'bulyan', 'num-clients': 40},\n"
        "               {'strategy': 'fedsam', 'central-dp': 'fixed'}):\n"
        "    Settings.from_run_config(config)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr

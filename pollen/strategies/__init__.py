"""Server updates. `build_strategy` turns settings into a Flower strategy."""

from __future__ import annotations

from ..settings import Settings
from .fedavg import FedAvg
from .sampling import Roster

STRATEGIES = {"fedavg": FedAvg}


def build_strategy(settings: Settings, roster: Roster) -> FedAvg:
    """The strategy preset named by `strategy`, configured from `settings`."""
    return STRATEGIES[settings.strategy](
        roster=roster,
        num_clients=settings.num_clients,
        client_frac=settings.client_frac,
        seed=settings.seed,
    )

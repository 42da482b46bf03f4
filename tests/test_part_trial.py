"""A user's aggregator and server update tried on a made-up round in the
command: what failed about 19 s into the run, after Flower and Ray started,
is refused before anything starts; pollen's own parts all pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.catalog import AGGREGATORS, SERVER_UPDATES
from pollen.deployment.run_config import prepare_run
from pollen.settings import Settings, SettingsError
from pollen.strategies.compose import build_strategy
from pollen.strategies.part_trial import made_up_update, round_trial_problem
from pollen.task.inputs import shape_model
from tests.conftest import PROJECT
from tests.user_package import PACKAGE, on_path, write_user_package

BROKEN = f"{PACKAGE}.broken_parts"
TRIAL = "(on a made-up round of 2 replies, before the run starts)"


@pytest.fixture(scope="module", autouse=True)
def user_package(tmp_path_factory) -> Iterator[Path]:
    with on_path(write_user_package(tmp_path_factory.mktemp("user"))) as root:
        yield root


@pytest.mark.parametrize(
    ("parts", "said"),
    [
        (f"aggregator='{BROKEN}:DictMean'",
         f"aggregator '{BROKEN}:DictMean' returned a dict; expected "
         f"pollen.strategies.aggregation.Aggregate(arrays, updates) "
         f"(docs/extending.md) {TRIAL}"),
        (f"aggregator='{BROKEN}:Raises'",
         f"aggregator '{BROKEN}:Raises' raised KeyError: 'num-examples' on a "
         "made-up round of 2 replies, before the run starts"),
        (f"server-update='{BROKEN}:Dropping'",
         f"server update '{BROKEN}:Dropping' returned no entry '1.weight'; "
         f"expected every one of the 6 shared entries {TRIAL}"),
    ],
    ids=["dict", "raises", "dropping"],
)  # fmt: skip
def test_a_broken_aggregator_or_server_update_is_refused_before_anything_starts(
    parts: str, said: str, tmp_path: Path
) -> None:
    with pytest.raises(SettingsError) as refused:
        prepare_run(PROJECT, [f"{parts} output-dir='{tmp_path}'"])
    assert str(refused.value) == said
    assert not any(tmp_path.iterdir())


def test_sound_user_parts_pass_and_a_float64_update_is_cast(tmp_path: Path) -> None:
    for parts in (
        f"aggregator='{PACKAGE}.rules:UniformMean' "
        f"server-update='{PACKAGE}.updates:DampedAverage'",
        f"server-update='{BROKEN}:Float64Update'",
    ):
        prepare_run(PROJECT, [f"{parts} output-dir='{tmp_path}'"])


def test_made_up_replies_differ_per_client_and_keep_each_dtype() -> None:
    current = {"w": np.zeros(2, np.float32), "n": np.array(3, np.int64)}
    first, second = (made_up_update(c, current, ("effective-steps",)) for c in (0, 1))
    np.testing.assert_allclose(first.arrays["w"], [0.01, 0.01])
    np.testing.assert_allclose(second.arrays["w"], [0.02, 0.02])
    assert first.arrays["w"].dtype == np.float32 and second.arrays["n"] == 4
    assert second.num_examples == 11.0 and second.metrics["effective-steps"] == 1.0


def allowed_pairs() -> list[Settings]:
    """Every pairing of a built-in aggregator and server update the settings
    allow (FedDyn takes the mean only), on 12 clients a round."""
    allowed = []
    for aggregator in sorted(AGGREGATORS):
        for server_update in sorted(SERVER_UPDATES):
            config = {"aggregator": aggregator, "server-update": server_update,
                      "num-clients": 12, "client-frac": 1.0, "byzantine-clients": 1}  # fmt: skip
            try:
                allowed.append(Settings.from_run_config(config))
            except SettingsError:
                continue
    return allowed


@pytest.mark.parametrize(
    "settings", allowed_pairs(), ids=lambda s: f"{s.aggregator}-{s.server_update}"
)
def test_every_built_in_aggregator_and_server_update_passes_the_trial(
    settings: Settings,
) -> None:
    """The trial runs pollen's own part beside a user's: it must never
    refuse one of them."""
    model = shape_model(settings)
    strategy, _ = build_strategy(settings, model)
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert round_trial_problem(strategy, arrays) is None

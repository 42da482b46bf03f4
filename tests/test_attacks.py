"""Malicious clients: what each attack sends, by hand, who attacks, and
which settings are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from pollen.protocol import ARRAYS, CLIENT, CONFIG, SERVER_ROUND
from pollen.settings import Settings, SettingsError
from pollen.task.attacks import (
    flipped_labels,
    poisoned,
    poisoning_mod,
    trained_labels,
)
from pollen.task.train import client_seed

SENT = ArrayRecord(
    {
        "w": Array(np.array([1.0, 2.0], dtype=np.float32)),
        "count": Array(np.array(7, dtype=np.int64)),
    }
)
TRAINED = ArrayRecord(
    {
        "w": Array(np.array([2.0, 1.5], dtype=np.float32)),
        "count": Array(np.array(9, dtype=np.int64)),
    }
)


@pytest.mark.parametrize(
    ("attack", "expected"),
    [
        ("sign-flip", [1 - 10 * 1.0, 2 - 10 * -0.5]),  # x_sent - s Delta
        ("scale", [1 + 10 * 1.0, 2 + 10 * -0.5]),  # x_sent + s Delta
    ],
)
def test_model_poisoning_by_hand(attack: str, expected: list[float]) -> None:
    """Delta = [1, -0.5], s = 10; the integer counter keeps its trained value."""
    lie = poisoned(attack, SENT, TRAINED, 10.0, seed=0)
    np.testing.assert_allclose(lie["w"].numpy(), expected)
    assert lie["w"].numpy().dtype == np.float32
    assert int(lie["count"].numpy()) == 9


def test_noise_replaces_the_update_with_gaussian_noise() -> None:
    """x_sent + N(0, s^2): around the sent model, not the trained one, with
    standard deviation s; the same seed gives the same noise."""
    sent = ArrayRecord({"w": Array(np.zeros(20_000, dtype=np.float32))})
    trained = ArrayRecord({"w": Array(np.full(20_000, 5.0, dtype=np.float32))})
    lie = poisoned("noise", sent, trained, 3.0, seed=1)["w"].numpy()
    assert abs(lie.mean()) < 0.1 and lie.std() == pytest.approx(3.0, rel=0.03)
    again = poisoned("noise", sent, trained, 3.0, seed=1)["w"].numpy()
    np.testing.assert_array_equal(lie, again)
    with pytest.raises(ValueError, match="allowed: sign-flip, scale, noise"):
        poisoned("label-flip", sent, trained, 3.0, seed=1)


def test_label_flip_maps_each_class_to_its_mirror() -> None:
    y = torch.tensor([0, 1, 9, 4])
    assert flipped_labels(y, 10).tolist() == [9, 8, 0, 5]


def settings(**overrides: object) -> Settings:
    config = {
        "num-clients": 20,
        **{k.replace("_", "-"): v for k, v in overrides.items()},
    }
    return Settings.from_run_config(config)


def test_attacking_clients_drawn_by_seed_or_named() -> None:
    drawn = settings(attack="sign-flip", attackers=0.2).attacking_clients
    assert len(drawn) == 4 and drawn <= set(range(20))
    assert settings(attack="sign-flip", attackers=0.2).attacking_clients == drawn
    assert (
        settings(attack="sign-flip", attackers=0.2, seed=2).attacking_clients != drawn
    )
    named = settings(attack="noise", attacker_clients="3,7")
    assert named.attacking_clients == {3, 7}
    assert settings().attacking_clients == frozenset()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attackers": 0.2}, r"without an attack: set attack to one of sign-flip"),
        ({"attack": "scale"}, r"without attackers"),
        ({"attack": "scale", "attackers": 0.1, "attacker_clients": "1"}, r"not both"),
        ({"attack": "scale", "attacker_clients": "3,20"}, r"clients are 0 to 19"),
        ({"attack": "scale", "attacker_clients": "a,2"}, r"'i,j,...' of integers"),
        ({"attack": "scale", "attackers": 0.01}, r"rounds to no client; .*0.05"),
        ({"attack": "flood", "attackers": 0.1}, r"one of none, sign-flip"),
    ],
)
def test_bad_attack_settings_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(**overrides)


def test_only_a_label_flipping_attacker_trains_on_flipped_labels() -> None:
    y = torch.tensor([0, 1, 9])
    flipping = settings(attack="label-flip", attacker_clients="3")
    assert trained_labels(flipping, 3, y).tolist() == [9, 8, 0]
    assert trained_labels(flipping, 4, y) is y  # an honest client
    poisoning = settings(attack="sign-flip", attacker_clients="3")
    assert trained_labels(poisoning, 3, y) is y  # it lies later, about its model


def poisoning_reply(s: Settings, client: int) -> ArrayRecord:
    """What `poisoning_mod` makes of a handler that trained SENT to TRAINED."""
    config = ConfigRecord({CLIENT: client, SERVER_ROUND: 2})
    msg = Message(
        RecordDict({ARRAYS: SENT, CONFIG: config}), dst_node_id=1, message_type="train"
    )

    def trained(msg: Message, context: Context) -> Message:
        return Message(RecordDict({ARRAYS: TRAINED}), reply_to=msg)

    context = Context(1, 1, {}, RecordDict(), s.to_run_config())
    return poisoning_mod(msg, context, trained).content[ARRAYS]


@pytest.mark.usefixtures("task_identity")
def test_poisoning_mod_lies_for_the_attackers_only() -> None:
    """Client 3 sends x_sent - s Delta (s = 10) instead of TRAINED; client 4
    sends TRAINED; the noise attack draws from the round's training seed."""
    sign_flip = settings(attack="sign-flip", attacker_clients="3")
    lie = poisoning_reply(sign_flip, 3)
    np.testing.assert_allclose(lie["w"].numpy(), [1 - 10 * 1.0, 2 - 10 * -0.5])
    honest = poisoning_reply(sign_flip, 4)
    np.testing.assert_array_equal(honest["w"].numpy(), TRAINED["w"].numpy())
    noisy = settings(attack="noise", attacker_clients="3", seed=5)
    seed = client_seed(5, 2, 3)
    expected = poisoned("noise", SENT, TRAINED, 10.0, seed)["w"].numpy()
    np.testing.assert_array_equal(poisoning_reply(noisy, 3)["w"].numpy(), expected)
    labels = settings(attack="label-flip", attacker_clients="3")
    np.testing.assert_array_equal(
        poisoning_reply(labels, 3)["w"].numpy(), TRAINED["w"].numpy()
    )

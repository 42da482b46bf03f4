"""LoRA layers, the frozen-backbone model, FedSA's `lora-a` sharing and cached
features: the formula by hand, what travels, and what survives on a client."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.settings import Settings, SettingsError
from pollen.task.data import load_dataset
from pollen.task.inputs import settings_model
from pollen.task.lora import FrozenBackboneClassifier, LoRALinear
from pollen.task.models import ModelOptions, build_model
from pollen.task.sharing import Sharing, count_parameters, entry_kinds
from tests.test_sharing import message

pytestmark = pytest.mark.usefixtures("task_identity")


def test_lora_linear_is_base_plus_scaled_b_a_by_hand() -> None:
    layer = LoRALinear(2, 2, rank=1, alpha=4.0)  # scaling alpha / rank = 4
    with torch.no_grad():
        layer.base.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        layer.base.bias.copy_(torch.tensor([0.5, -0.5]))
        layer.lora_a.weight.copy_(torch.tensor([[1.0, 1.0]]))  # A: 1x2
        layer.lora_b.weight.copy_(torch.tensor([[2.0], [-1.0]]))  # B: 2x1
    x = torch.tensor([[3.0, 1.0]])
    # W0 x + b = [3.5, 1.5]; A x = 4; B A x = [8, -4]; times 4 = [32, -16]
    assert layer(x).tolist() == [[35.5, -14.5]]


def test_fresh_lora_layer_equals_its_base() -> None:
    layer = LoRALinear(5, 3, rank=2, alpha=2.0, dropout=0.0)
    assert torch.count_nonzero(layer.lora_b.weight) == 0
    x = torch.randn(4, 5)
    assert torch.equal(layer(x), layer.base(x))


class Named(nn.Module):
    """A LoRA layer called `base` and a plain Linear called `lora_a`."""

    def __init__(self) -> None:
        super().__init__()
        self.base = LoRALinear(3, 3, rank=2, alpha=2.0)
        self.lora_a = nn.Linear(3, 3)


def test_lora_kinds_come_from_the_owning_module() -> None:
    kinds = entry_kinds(Named())
    assert kinds["base.lora_a.weight"] == "lora-a"
    assert kinds["base.lora_b.weight"] == "lora-b"
    assert kinds["base.base.weight"] == "weight"
    # a plain Linear named lora_a is no LoRA matrix; as the last Linear it is
    # the model's classifier
    assert kinds["lora_a.weight"] == "head"
    assert Sharing.of("lora-a", Named()).shared == ("base.lora_a.weight",)
    both = Sharing.of("lora", Named())
    assert set(both.shared) == {"base.lora_a.weight", "base.lora_b.weight"}
    assert "lora_a.weight" in both.local  # a plain Linear stays on the client


def test_vgg16_lora_shape_counts_and_frozen_backbone() -> None:
    model = build_model("vgg16-lora", (3, 32, 32), 10, 0)
    assert isinstance(model, FrozenBackboneClassifier)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    counts = count_parameters(model)
    # 13 VGG16 conv layers (14,714,688) + head: 512x512+512 and 10x512+10 base
    # weights, rank-8 A (8x512 twice) and B (512x8, 10x8)
    assert counts["total"] == 14_714_688 + 262_656 + 5_130 + 8_192 + 4_176
    assert counts["lora-a"] == 8_192 and counts["lora-b"] == 4_176
    assert counts["trainable"] == 262_656 + 5_130 + 8_192 + 4_176
    sharing = Sharing.of("lora-a", model)
    assert sharing.shared == ("head.0.lora_a.weight", "head.2.lora_a.weight")
    assert not any(k.startswith("backbone") for k in sharing.shared + sharing.local)
    model.train()
    assert not model.backbone.training and model.head.training


def test_vgg16_needs_32px_colour_images() -> None:
    with pytest.raises(ValueError, match="needs colour images of at least 32x32"):
        build_model("vgg16-lora", (1, 28, 28), 10, 0)


def test_backbone_weights_from_a_file(tmp_path) -> None:
    source = build_model("vgg16-lora", (3, 32, 32), 10, 1)
    features = source.backbone[0]
    path = tmp_path / "vgg16.pt"
    torch.save({f"features.{k}": v for k, v in features.state_dict().items()}, path)
    loaded = build_model(
        "vgg16-lora", (3, 32, 32), 10, 2, ModelOptions(backbone_weights=str(path))
    )
    assert loaded.source == f"file {path}"
    for key, value in features.state_dict().items():
        assert torch.equal(loaded.backbone[0].state_dict()[key], value)
    (tmp_path / "bad.pt").write_bytes(b"not a state dict")
    with pytest.raises(ValueError, match="not a VGG16 weights file"):
        build_model(
            "vgg16-lora",
            (3, 32, 32),
            10,
            0,
            ModelOptions(backbone_weights=str(tmp_path / "bad.pt")),
        )


def test_cached_features_give_the_same_logits() -> None:
    model = build_model("vgg16-lora", (3, 32, 32), 10, 0).eval()
    x = torch.rand(3, 3, 32, 32)
    assert torch.allclose(model(model.features(x)), model(x))


@pytest.mark.parametrize(
    ("overrides", "message_part"),
    [
        ({"sharing": "lora-a", "model": "cnn"}, "needs a model with LoRA layers"),
        (
            {"strategy": "fedsa", "model": "cnn-lora", "bn-policy": "fedbn"},
            "leave bn-policy at shared",
        ),
        (
            {"model": "vgg16-lora", "data-set": "cifar10", "augment": True},
            "set augment=false",
        ),
    ],
)
def test_settings_refuse_combinations_that_cannot_work(overrides, message_part) -> None:
    with pytest.raises(SettingsError, match=message_part):
        Settings.from_run_config(overrides)


def test_fedsa_preset_shares_lora_a() -> None:
    settings = Settings.from_run_config({"strategy": "fedsa", "model": "cnn-lora"})
    assert settings.sharing == "lora-a" and settings.sharing_policy == "lora-a"
    assert settings.server_update == "fedavg" and settings.local_objective == "plain"


def lora_run_config(**overrides) -> dict:
    config = {
        "data-set": "digits", "model": "cnn-lora", "strategy": "fedsa",
        "num-clients": 2, "batch-size": 32, "lr": 0.05, "partition": "silos",
        "device": "cpu", "lora-rank": 2, "lora-dropout": 0.0, **overrides,
    }  # fmt: skip
    return Settings.from_run_config(config).to_run_config()


def test_only_a_travels_and_b_survives_rounds_on_its_client() -> None:
    run_config = lora_run_config()
    settings = Settings.from_run_config(run_config)
    model = settings_model(settings, load_dataset("digits", "data", False))
    sharing = Sharing.of("lora-a", model)
    assert sharing.shared == ("1.0.lora_a.weight", "1.2.lora_a.weight")
    context = Context(1, 1, {}, RecordDict(), run_config)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    b_after = []
    for rnd in (1, 2):
        reply = client_app.train(message("train", sent, 1, rnd), context)
        assert set(reply.content["arrays"]) == set(sharing.shared)  # A only, up
        local = context.state["local-1"]
        assert set(local) == set(sharing.local)  # B, base layers, conv body
        b_after.append(local["1.0.lora_b.weight"].numpy().copy())
        sent = reply.content["arrays"]
    assert np.abs(b_after[0]).sum() > 0  # B learnt in round 1 (it starts at zero)
    assert not np.allclose(b_after[0], b_after[1])  # and kept learning from there
    assert "local-0" not in context.state
    with pytest.raises(ValueError, match="sharing policy lora-a"):
        client_app.train(
            message("train", ArrayRecord(model.state_dict()), 0, 3), context
        )


@pytest.fixture
def tiny_cifar(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8),
        "y_train": np.arange(40) % 10,
        "x_test": rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
        "y_test": np.arange(20) % 10,
    }
    np.savez(tmp_path / "cifar10.npz", **arrays)
    return tmp_path


def test_cached_features_train_like_images(tiny_cifar) -> None:
    """The head trains the same on stored features as on images through the
    backbone, and the features are computed once per process."""
    from pollen.task import inputs

    replies = {}
    for cache in (False, True):
        run_config = lora_run_config(**{
            "data-set": "cifar10", "data-root": str(tiny_cifar), "download": False,
            "model": "vgg16-lora", "backbone-weights": "random", "augment": False,
            "cache-features": cache, "batch-size": 10, "momentum": 0.0,
            "test-batch-size": 7,
        })  # fmt: skip
        settings = Settings.from_run_config(run_config)
        model = settings_model(settings, load_dataset("cifar10", tiny_cifar, False))
        sent = ArrayRecord(
            {k: model.state_dict()[k] for k in Sharing.of("lora-a", model).shared}
        )
        context = Context(1, 1, {}, RecordDict(), run_config)
        cached = len(inputs._FEATURES)
        replies[cache] = client_app.train(message("train", sent, 0, 1), context)
        assert len(inputs._FEATURES) == cached + cache  # one entry: client 0's shard
        client_app.train(message("train", sent, 0, 2), context)
        assert len(inputs._FEATURES) == cached + cache  # reused, not recomputed
    for key, value in replies[True].content["arrays"].items():
        np.testing.assert_allclose(
            value.numpy(), replies[False].content["arrays"][key].numpy(), atol=1e-5
        )

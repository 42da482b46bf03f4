"""Batched preprocessing, local SGD and evaluation on tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord

from pollen.settings import Settings
from pollen.task.data import load_dataset
from pollen.task.inputs import placed_model
from pollen.task.models import build_model
from pollen.task.train import (
    ClientOptimizer,
    Preprocess,
    evaluate,
    placed,
    random_crop_flip,
    train_local,
)

CPU = torch.device("cpu")


def test_crop_without_padding_is_identity_up_to_flip() -> None:
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    out = random_crop_flip(x, 0, torch.Generator().manual_seed(0))
    for i in range(2):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))


def test_crop_with_padding_shifts_content() -> None:
    x = torch.ones(64, 3, 8, 8)
    out = random_crop_flip(x, 2, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    assert (out == 0).any()  # some crops include the zero padding
    assert (out.flatten(1).sum(1) == 3 * 64).any()  # and some are the centre


def test_preprocess_normalises_per_channel() -> None:
    x = torch.full((2, 3, 2, 2), 255, dtype=torch.uint8)
    out = Preprocess((0.5, 0.5, 0.0), (0.5, 0.25, 1.0))(x, None)
    assert out[:, 0].unique().tolist() == [1.0] and out[:, 1].unique().tolist() == [2.0]
    assert out[:, 2].unique().tolist() == [1.0]


def test_local_sgd_learns_digits_and_is_deterministic() -> None:
    ds = load_dataset("digits", "unused", download=False)
    prep = Preprocess(ds.mean, ds.std)

    def run() -> tuple[float, dict]:
        model = build_model("mlp", ds.input_shape, 10, seed=1)
        train_local(
            model, ds.x_train, ds.y_train, epochs=3, batch_size=32,
            optimizer=ClientOptimizer("sgd", 0.05, momentum=0.9), preprocess=prep, seed=7,
        )  # fmt: skip
        return evaluate(model, ds.x_test, ds.y_test, batch_size=100, preprocess=prep)[
            1
        ], model.state_dict()

    accuracy, state = run()
    assert accuracy > 0.9
    again, state_again = run()
    assert accuracy == again
    assert all(torch.equal(state[k], state_again[k]) for k in state)


def test_placed_on_the_cpu_trains_channels_last_to_the_same_values() -> None:
    """Channels-last weights change the layout, not the model: a few steps
    of FedAvg's CNN reach the NCHW model's values up to summation order,
    and the state travels (ArrayRecord) as the same logical arrays."""
    noise = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (200, 1, 28, 28), dtype=torch.uint8, generator=noise)
    y = torch.randint(0, 10, (200,), generator=noise)
    prep = Preprocess((0.5,), (0.25,))

    def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        train_local(
            model, x, y, epochs=1, batch_size=20,
            optimizer=ClientOptimizer("sgd", 0.05, momentum=0.9), preprocess=prep, seed=3,
        )  # fmt: skip
        return model.state_dict()

    nchw = build_model("fedavg-cnn", (1, 28, 28), 10, seed=1)
    ours = Settings.from_run_config({"model": "fedavg-cnn", "data-set": "mnist"})
    model = placed_model(ours, build_model("fedavg-cnn", (1, 28, 28), 10, seed=1), CPU)
    conv = model[3].weight  # 32 -> 64 channels: its layout differs from NCHW's
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert not conv.is_contiguous()
    assert model[7].weight.is_contiguous()  # a linear layer's is unchanged

    expected, state = trained(nchw), trained(model)
    assert state["3.weight"].is_contiguous(memory_format=torch.channels_last)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)
    travelled = ArrayRecord(state).to_torch_state_dict()
    assert all(torch.equal(travelled[k], state[k]) for k in state)
    assert travelled["3.weight"].is_contiguous()


class Viewed(torch.nn.Module):
    """A user's CNN written as PyTorch's tutorials write one: `.view` flattens."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).view(len(x), -1))


def test_a_users_model_keeps_nchw_which_its_view_needs() -> None:
    x = torch.randn(2, 3, 8, 8)
    users = SimpleNamespace(model="mypkg.nets:viewed", dp=False,
                            client_execution="sequential")  # fmt: skip
    assert placed_model(users, Viewed(), CPU)(x).shape == (2, 2)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        placed(Viewed(), CPU, channels_last=True)(x)


@pytest.mark.parametrize(
    "overrides", [{"dp": True}, {"client-execution": "cohort"}], ids=["dp", "cohort"]
)
def test_dp_sgd_and_cohorts_train_the_catalogues_cnns_in_nchw(overrides: dict) -> None:
    """Opacus's per-sample convolution gradients and a cohort's stacked,
    fused steps read NCHW strides: neither may see channels-last weights."""
    settings = Settings.from_run_config(
        {"model": "cnn-gn", "data-set": "cifar10", **overrides}
    )
    model = placed_model(settings, build_model("cnn-gn", (3, 32, 32), 10, 1), CPU)
    assert all(p.is_contiguous() for p in model.parameters())


def test_dropout_masks_follow_the_seed_not_the_process_history() -> None:
    """A replayed round (a resumed run, another Ray actor) repeats its dropout."""
    ds = load_dataset("digits", "unused", download=False)
    x, y = ds.x_train[:256], ds.y_train[:256]

    def run() -> dict:
        model = build_model("cnn-lora", ds.input_shape, 10, seed=1)
        train_local(
            model, x, y, epochs=1, batch_size=64,
            optimizer=ClientOptimizer("sgd", 0.1), preprocess=Preprocess(ds.mean, ds.std),
            seed=3,
        )  # fmt: skip
        return model.state_dict()

    first = run()
    torch.rand(1000)  # the process's generator moves on, as it does between rounds
    again = run()
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_a_single_sample_batch_is_skipped_only_under_batchnorm() -> None:
    """9 examples in batches of 4: 4, 4, 1; BatchNorm cannot train on the 1."""
    x = torch.randint(0, 256, (9, 1, 2, 2), dtype=torch.uint8)
    y = torch.randint(0, 3, (9,))

    def steps(model: torch.nn.Module, n: int = 9) -> int:
        return train_local(
            model, x[:n], y[:n], epochs=2, batch_size=4,
            optimizer=ClientOptimizer("sgd", 0.1), preprocess=Preprocess((0.5,), (0.5,)),
            seed=0,
        ).steps  # fmt: skip

    flat = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    assert steps(flat) == 6
    assert steps(torch.nn.Sequential(flat, torch.nn.BatchNorm1d(3))) == 4
    with pytest.raises(ValueError, match="a shard of 1 samples gives no training step"):
        steps(torch.nn.Sequential(flat, torch.nn.BatchNorm1d(3)), n=1)


def test_evaluate_counts_correct_predictions() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(1, 2, bias=False))
    model[1].weight.data = torch.tensor([[-1.0], [1.0]])
    x = torch.tensor([0, 255, 255, 0], dtype=torch.uint8).view(4, 1, 1, 1)
    y = torch.tensor([0, 1, 0, 1])
    loss, accuracy = evaluate(
        model, x, y, batch_size=3, preprocess=Preprocess((0.5,), (0.5,))
    )
    assert accuracy == 0.5
    expected = torch.nn.functional.cross_entropy(
        torch.tensor([[1.0, -1.0], [-1.0, 1.0], [-1.0, 1.0], [1.0, -1.0]]), y
    )
    assert abs(loss - float(expected)) < 1e-6


def test_models_fit_their_inputs() -> None:
    for name, shape in [("mlp", (1, 28, 28)), ("mlp-bn", (1, 8, 8)), ("cnn", (1, 28, 28)),
                        ("cnn", (3, 32, 32)), ("mobilenet", (3, 32, 32)),
                        ("simple-cnn", (1, 28, 28)), ("simple-cnn", (3, 32, 32)),
                        ("fedavg-cnn", (1, 28, 28)), ("fedavg-cnn", (3, 32, 32))]:  # fmt: skip
        model = build_model(name, shape, 10, seed=0).eval()
        assert model(torch.zeros(2, *shape)).shape == (2, 10), name


def test_simple_cnn_has_niid_benchs_layer_sizes() -> None:
    """Parameter counts by hand: conv 5x5 (c -> 6), conv 5x5 (6 -> 16), then
    16*4*4 = 256 (28x28) or 16*5*5 = 400 (32x32) features into 120-84-10."""
    convs = {1: 1 * 6 * 25 + 6, 3: 3 * 6 * 25 + 6}
    head = 6 * 16 * 25 + 16 + 120 * 84 + 84 + 84 * 10 + 10
    for shape, features in [((1, 28, 28), 256), ((3, 32, 32), 400)]:
        model = build_model("simple-cnn", shape, 10, seed=0)
        expected = convs[shape[0]] + features * 120 + 120 + head
        assert sum(p.numel() for p in model.parameters()) == expected
    assert expected == 62006  # LeNet-5 on CIFAR-10, as published
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model("simple-cnn", (1, 8, 8), 10, seed=0)


def test_fedavg_cnn_has_pfllibs_layer_sizes() -> None:
    """Parameter counts by hand: unpadded 5x5 convs (c -> 32 -> 64), then
    64*4*4 = 1024 (28x28: PFLlib's dim for MNIST) or 64*5*5 = 1600 (32x32:
    its dim for CIFAR-10) features into 512 and the classes."""
    counts = {}
    for shape, features in [((1, 28, 28), 1024), ((3, 32, 32), 1600)]:
        model = build_model("fedavg-cnn", shape, 10, seed=0)
        convs = shape[0] * 32 * 25 + 32 + 32 * 64 * 25 + 64
        expected = convs + features * 512 + 512 + 512 * 10 + 10
        counts[shape] = sum(p.numel() for p in model.parameters())
        assert counts[shape] == expected
    assert counts[(1, 28, 28)] == 582026
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model("fedavg-cnn", (1, 15, 15), 10, seed=0)
    assert build_model("fedavg-cnn", (1, 16, 16), 10, seed=0)(
        torch.zeros(1, 1, 16, 16)
    ).shape == (1, 10)

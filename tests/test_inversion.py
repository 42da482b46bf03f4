"""Gradient inversion: the labels and the simulated update by hand, the three
attacks rebuilding an image from an exact update (and failing on a noised
one), a part of the update, several steps and clients, what is refused."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pollen.audit.images import psnr
from pollen.audit.inversion import (
    LocalTraining,
    infer_labels,
    reconstruct,
    simulated_update,
)

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
BOX = (-MNIST_MEAN / MNIST_STD, (1 - MNIST_MEAN) / MNIST_STD)
SHAPE = (1, 28, 28)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (two spin against each other on
    a busy two-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 32), nn.Sigmoid(), nn.Linear(32, 10)
    )


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 5, stride=2, padding=2),
        nn.Sigmoid(),
        nn.Conv2d(4, 8, 5, stride=2, padding=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 10),
    )


def pictures(count: int, seed: int = 1) -> torch.Tensor:
    """Smooth synthetic 28 x 28 grey images in [0, 1], like blurred strokes."""
    coarse = torch.randn(
        (count, 1, 7, 7), generator=torch.Generator().manual_seed(seed)
    )
    return torch.sigmoid(3 * F.interpolate(coarse, size=28, mode="bilinear"))


def normalised(images: torch.Tensor) -> torch.Tensor:
    return (images - MNIST_MEAN) / MNIST_STD


def pixels(images: torch.Tensor) -> torch.Tensor:
    return images * MNIST_STD + MNIST_MEAN


def sent(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    training: LocalTraining,
) -> dict[str, torch.Tensor]:
    """The update a client sends after training on these pixels."""
    update = simulated_update(model, normalised(images), labels, training)
    return {name: value.detach() for name, value in update.items()}


def scores(originals: torch.Tensor, rebuilt: torch.Tensor) -> list[float]:
    return [psnr(a, pixels(b)) for a, b in zip(originals, rebuilt, strict=True)]


def attack(name: str, model: nn.Module, observed, count: int = 1, **options):
    options = {
        "training": LocalTraining(lr=0.1),
        "iterations": 100,
        "seed": 0,
        **options,
    }
    return reconstruct(
        name,
        model,
        observed,
        count=count,
        input_shape=SHAPE,
        box=BOX,
        **options,
    )


# --- by hand ---------------------------------------------------------------


def zero_linear() -> nn.Linear:
    """Four classes from three inputs, all weights zero: p is uniform, so
    the cross-entropy gradient is (1/4 - onehot(y)) for the bias and its
    outer product with x for the weight."""
    layer = nn.Linear(3, 4)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def test_one_step_update_by_hand() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]])
    update = simulated_update(
        zero_linear(), x, torch.tensor([2]), LocalTraining(lr=0.5)
    )
    bias_gradient = torch.tensor([0.25, 0.25, -0.75, 0.25])
    torch.testing.assert_close(update["bias"], -0.5 * bias_gradient)
    torch.testing.assert_close(
        update["weight"], -0.5 * torch.outer(bias_gradient, x[0])
    )


def test_a_clipped_step_by_hand() -> None:
    """The same step with the gradient clipped to a total norm of 0.5: the
    gradient above has norm ||b|| sqrt(1 + ||x||^2) = 0.8660 x 2.5 = 2.1651,
    so it is scaled by 0.5 / 2.1651 (as torch's clip_grad_norm_ scales it),
    and a bound above 2.1651 leaves it as it was."""
    x = torch.tensor([[1.0, -2.0, 0.5]])
    bias_gradient = torch.tensor([0.25, 0.25, -0.75, 0.25])
    scale = 0.5 / (2.1651 + 1e-6)
    clipped = simulated_update(
        zero_linear(), x, torch.tensor([2]), LocalTraining(lr=0.5, max_grad_norm=0.5)
    )
    torch.testing.assert_close(
        clipped["bias"], -0.5 * scale * bias_gradient, rtol=1e-4, atol=0
    )
    loose = simulated_update(
        zero_linear(), x, torch.tensor([2]), LocalTraining(lr=0.5, max_grad_norm=2.3)
    )
    torch.testing.assert_close(loose["bias"], -0.5 * bias_gradient)
    layer = zero_linear()
    F.cross_entropy(layer(x), torch.tensor([2])).backward()
    torch.nn.utils.clip_grad_norm_(list(layer.parameters()), 0.5)
    torch.testing.assert_close(clipped["weight"], -0.5 * layer.weight.grad)


def test_labels_from_a_hand_computed_update() -> None:
    layer = zero_linear()
    update = {"bias": -0.5 * torch.tensor([0.25, 0.25, -0.75, 0.25])}
    assert infer_labels(update, layer, 1).tolist() == [2]
    # the weight alone: its row sums carry the sign when x >= 0
    x = torch.tensor([1.0, 2.0, 0.5])
    weight = -0.5 * torch.outer(torch.tensor([0.25, 0.25, -0.75, 0.25]), x)
    assert infer_labels({"weight": weight}, layer, 1).tolist() == [2]


def test_labels_for_a_batch() -> None:
    """Most negative gradient (most positive update) first, each once, then
    repeated in that order when too few are negative."""
    layer = nn.Linear(3, 5)
    update = {"bias": torch.tensor([0.3, -0.1, 0.5, 0.2, -0.4])}
    assert infer_labels(update, layer, 2).tolist() == [2, 0]
    assert infer_labels(update, layer, 3).tolist() == [2, 0, 3]
    assert infer_labels(update, layer, 5).tolist() == [2, 0, 3, 2, 0]
    nowhere = {"bias": torch.tensor([-0.3, -0.1, -0.5, -0.2, -0.4])}
    assert infer_labels(nowhere, layer, 2).tolist() == [1, 1]


def test_labels_of_a_real_batch() -> None:
    model, images = mlp(), pictures(3)
    labels = torch.tensor([7, 1, 4])
    update = sent(model, images, labels, LocalTraining(lr=0.1))
    assert sorted(infer_labels(update, model, 3).tolist()) == [1, 4, 7]


def test_one_step_is_minus_lr_times_the_gradient() -> None:
    model, images, labels = cnn(), normalised(pictures(3)), torch.tensor([1, 2, 3])
    update = simulated_update(model, images, labels, LocalTraining(lr=0.05))
    F.cross_entropy(model(images), labels).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(update[name], -0.05 * parameter.grad)


def test_steps_follow_plain_sgd_on_consecutive_batches() -> None:
    """Three steps of batch 2 over 3 examples: [0, 1], [2], then [0, 1] again."""
    model, images = mlp(), normalised(pictures(3))
    labels = torch.tensor([5, 6, 7])
    training = LocalTraining(lr=0.1, steps=3, batch_size=2)
    update = simulated_update(model, images, labels, training)
    client = copy.deepcopy(model)
    for batch in (slice(0, 2), slice(2, 3), slice(0, 2)):
        client.zero_grad()
        F.cross_entropy(client(images[batch]), labels[batch]).backward()
        with torch.no_grad():
            for parameter in client.parameters():
                parameter -= 0.1 * parameter.grad
    for (name, before), after in zip(
        model.named_parameters(), client.parameters(), strict=True
    ):
        torch.testing.assert_close(update[name], after - before)


def test_clients_are_summed() -> None:
    model, images, labels = mlp(), normalised(pictures(4)), torch.tensor([0, 1, 2, 3])
    one = LocalTraining(lr=0.1, steps=2, batch_size=1)
    summed = simulated_update(
        model, images, labels, LocalTraining(lr=0.1, steps=2, batch_size=1, clients=2)
    )
    first = simulated_update(model, images[:2], labels[:2], one)
    second = simulated_update(model, images[2:], labels[2:], one)
    for name, value in summed.items():
        torch.testing.assert_close(value, first[name] + second[name])


# --- the attacks -------------------------------------------------------------


def test_idlg_rebuilds_an_image_from_its_update() -> None:
    model, image = mlp(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    result = attack("idlg", model, update)
    assert result.labels.tolist() == [3]
    assert result.images.shape == (1, *SHAPE)
    assert scores(image, result.images)[0] > 30
    assert result.loss < 1e-6


def test_dlg_finds_the_label_and_the_image() -> None:
    model, image = mlp(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    result = attack("dlg", model, update)
    assert result.labels.tolist() == [3]
    assert scores(image, result.images)[0] > 30


def test_inverting_gradients_beats_a_random_image_in_few_iterations() -> None:
    model, image = cnn(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    result = attack("ig", model, update, iterations=150)
    stranger = psnr(image[0], pictures(1, seed=9)[0])  # about 8 dB
    assert scores(image, result.images)[0] > stranger + 10
    assert BOX[0] <= result.images.min() and result.images.max() <= BOX[1]
    assert result.iterations == 150


@pytest.mark.parametrize("name", ["idlg", "ig"])
def test_noise_far_above_the_update_defeats_the_attack(name: str) -> None:
    model, image = mlp(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    noise = torch.Generator().manual_seed(5)
    noised = {
        key: value + 10 * value.std() * torch.randn(value.shape, generator=noise)
        for key, value in update.items()
    }
    assert scores(image, attack(name, model, noised).images)[0] < 10


def test_a_part_of_the_update_is_enough() -> None:
    """The first layer's weight alone (no output layer: DLG), and with the
    output bias (iDLG's labels)."""
    model, image = mlp(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    first = {"1.weight": update["1.weight"]}
    assert scores(image, attack("dlg", model, first).images)[0] > 30
    with_bias = {**first, "3.bias": update["3.bias"]}
    assert scores(image, attack("idlg", model, with_bias).images)[0] > 30


@pytest.mark.parametrize(("steps", "batch_size"), [(4, None), (3, 1)])
def test_several_local_steps_on_two_examples(
    steps: int, batch_size: int | None
) -> None:
    """Full batches, and one example a step (the first twice: its label has
    the larger update, so iDLG places both labels where the client had
    them); the best of three restarts."""
    model, images = mlp(), pictures(2)
    training = LocalTraining(lr=0.1, steps=steps, batch_size=batch_size)
    update = sent(model, images, torch.tensor([3, 7]), training)
    result = attack("idlg", model, update, count=2, training=training, restarts=3)
    assert result.labels.tolist() == [3, 7]
    assert min(scores(images, result.images)) > 30


def test_a_seed_gives_one_reconstruction() -> None:
    model, image = cnn(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    once, again, other = (
        attack("ig", model, update, iterations=5, seed=seed) for seed in (0, 0, 1)
    )
    assert torch.equal(once.images, again.images)
    assert not torch.equal(once.images, other.images)


def test_the_model_keeps_its_modes() -> None:
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 8), nn.Dropout(0.5), nn.Linear(8, 10)
    )
    model.train()
    model[2].eval()
    update = {"3.bias": torch.ones(10)}
    attack("idlg", model, update, iterations=2)
    assert model.training and model[1].training and not model[2].training


def test_restarts_keep_the_lowest_loss() -> None:
    model, image = cnn(), pictures(1)
    update = sent(model, image, torch.tensor([3]), LocalTraining(lr=0.1))
    best = attack("ig", model, update, iterations=5, seed=0, restarts=3)
    first = attack("ig", model, update, iterations=5, seed=0)  # the first restart
    assert best.loss <= first.loss


# --- what is refused ---------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attack": "gia"}, "unknown attack 'gia'; choose one of dlg, idlg, ig"),
        ({"count": 0}, "count .* at least 1, not 0"),
        ({"observed": {"9.weight": torch.ones(1)}}, "'9.weight' is not a trained"),
        ({"observed": {"3.bias": torch.ones(3)}}, r"shape \(3,\); .* has \(10,\)"),
        ({"observed": {}}, "holds no entry"),
        ({"observed": {"3.bias": torch.zeros(10)}}, "zero everywhere"),
        ({"input_shape": (784,)}, r"\(channels, height, width\)"),
        ({"box": (1.0, 0.0)}, "low < high"),
        ({"iterations": 0}, "at least 1"),
        ({"count": 3, "training": LocalTraining(lr=0.1, clients=2)}, "multiple"),
    ],
)
def test_bad_requests_are_refused(change: dict, message: str) -> None:
    request = {
        "attack": "idlg",
        "model": mlp(),
        "observed": {"3.bias": torch.ones(10)},
        "count": 1,
        "input_shape": SHAPE,
        "training": LocalTraining(lr=0.1),
        "box": BOX,
        "iterations": 1,
        "seed": 0,
        **change,
    }
    with pytest.raises(ValueError, match=message):
        reconstruct(
            request.pop("attack"),
            request.pop("model"),
            request.pop("observed"),
            **request,
        )


def test_labels_need_the_output_layer() -> None:
    with pytest.raises(ValueError, match=r"none of 3\.bias, 3\.weight; attack 'dlg'"):
        attack("idlg", mlp(), {"1.bias": torch.ones(32)})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, "learning rate must be positive"),
        ({"lr": 0.1, "steps": 0}, "local steps"),
        ({"lr": 0.1, "batch_size": 0}, "batch size"),
        ({"lr": 0.1, "clients": 0}, "clients"),
    ],
)
def test_bad_local_training_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalTraining(**options)

"""Gradient inversion: the client's training images, rebuilt from its update.

An honest-but-curious server knows the model a client started the round
from (theta_0) and receives its update Delta = theta_T - theta_0, perhaps
only some entries of it, perhaps clipped or noised, perhaps summed over k
clients. The three attacks here draw dummy examples x' (and, for DLG, dummy
labels y'), replay the client's local training on them and move x' until
the simulated update Delta' matches Delta:

- DLG, Zhu et al. 2019, https://arxiv.org/abs/1906.08935:
  x'*, y'* = argmin ||Delta' - Delta||^2 with y' = softmax of learnable
  logits, by L-BFGS.
- iDLG, Zhao et al. 2020, https://arxiv.org/abs/2001.02610: the labels
  first, from the output layer (`infer_labels`), then L-BFGS over x' alone
  on the same distance.
- Inverting Gradients, Geiping et al. 2020, https://arxiv.org/abs/2003.14053:
  x'* = argmin 1 - <Delta, Delta'> / (||Delta|| ||Delta'||)
  + alpha TV(x') over the valid input box, with iDLG's labels, by Adam on
  the gradient's signs, the step size cut tenfold at 3/8, 5/8 and 7/8 of the
  iterations, x' projected into the box after every step, the best of a few
  random restarts.

The observed thing is an update, not a gradient. `LocalTraining` says how
the client made it (plain SGD, no momentum), and the attack unrolls that
training on x' with `torch.func.functional_call`, differentiably:

    theta_{t+1} = theta_t - lr * grad L(theta_t; x'_t, y'_t),  t < T,

L the mean cross-entropy of step t's batch (soft labels for DLG). With T = 1
this is gradient matching up to the factor -lr; for T > 1 it is Geiping et
al.'s attack on federated averaging (section 5). Every trained parameter
moves in the simulation; only the observed entries are compared.

The model is put in train mode for the attack, as the client trains it
(BatchNorm normalises with each batch's statistics, on copies of its
buffers), and given back in the modes it had. Dropout would draw masks the
replay cannot know: `pollen audit` refuses models with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

ATTACKS = ("dlg", "idlg", "ig")
IG_STEP_SIZE = 0.1  # Adam's step size in Geiping et al.'s experiments


@dataclass(frozen=True)
class LocalTraining:
    """How the client turned the round's model into its update.

    `steps` plain SGD steps of learning rate `lr`, each on the next
    `batch_size` of the client's examples (all of them when None) in a fixed
    order, the last batch of a pass shorter if they do not divide evenly,
    as a `torch.split` of the examples. The attacker does not know the
    client's shuffle, so dummy example i is simply the i-th one the client
    used. Where the server saw the sum of `clients` clients' updates, each
    client trained from the same model on its own consecutive share of the
    dummy examples, and their updates are summed (divide the observed mean
    of an aggregate by k yourself, or use "ig", which ignores scale). Where
    `max_grad_norm` > 0 each step's gradient is clipped to that total L2
    norm first, as `torch.nn.utils.clip_grad_norm_` clips it. Where the
    server knows each client's batches (`order`), they replace the fixed
    order.
    """

    lr: float
    steps: int = 1
    batch_size: int | None = None
    clients: int = 1
    max_grad_norm: float = 0.0
    # each client's steps as the indices of its examples (within its share),
    # where the server knows them (pollen's shuffle is seeded by the run's
    # seed); empty: the fixed order above
    order: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"the learning rate must be positive, not {self.lr}")
        if self.steps < 1:
            raise ValueError(f"local steps must be at least 1, not {self.steps}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(
                f"the batch size must be at least 1 (or None: all examples), "
                f"not {self.batch_size}"
            )
        if self.clients < 1:
            raise ValueError(f"clients must be at least 1, not {self.clients}")
        if self.max_grad_norm < 0:
            raise ValueError(
                f"max_grad_norm must be 0 (none) or positive, not {self.max_grad_norm}"
            )
        if self.order and (
            len(self.order) != self.clients
            or any(len(steps) != self.steps for steps in self.order)
        ):
            raise ValueError(
                f"order must give each of the {self.clients} clients its "
                f"{self.steps} steps' examples"
            )

    def clipped(
        self, grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """`grads` scaled by min(1, C / (||g|| + 1e-6)), C = `max_grad_norm`
        (torch's rule; differentiable), or as they are without a bound."""
        if not self.max_grad_norm:
            return list(grads)
        present = [g for g in grads if g is not None]
        norm = torch.sqrt(sum((g**2).sum() for g in present))
        scale = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        return [None if g is None else g * scale for g in grads]

    def batches(self, examples: int, client: int = 0) -> Iterator[slice | list[int]]:
        """`client`'s batch for each step, over its `examples` examples."""
        if self.order:
            yield from (list(step) for step in self.order[client])
            return
        size = self.batch_size or examples
        per_pass = math.ceil(examples / size)
        for step in range(self.steps):
            start = (step % per_pass) * size
            yield slice(start, min(start + size, examples))


@dataclass(frozen=True)
class Reconstruction:
    """What an attack rebuilt.

    `images` (n, C, H, W) in the model's input (normalised) space, inside the
    box; `labels` (n,) those used (iDLG, IG) or found (DLG: the argmax of its
    soft labels); `loss` the attack's objective at these images (IG: with
    the TV term); `iterations` the optimiser's iterations of the best restart.
    """

    images: torch.Tensor
    labels: torch.Tensor
    loss: float
    iterations: int


def infer_labels(
    observed: Mapping[str, torch.Tensor], model: nn.Module, count: int
) -> torch.Tensor:
    """The `count` labels the update's output layer points to (iDLG).

    For cross-entropy on one example, the output layer's bias gradient is
    p - onehot(y): negative at the true label only, and so is each weight
    row's sum when the layer's inputs are non-negative (after a ReLU or a
    sigmoid; Zhao et al. 2020, section 3.1). The update is -lr times a sum
    of such gradients, so the sign flips. The output layer is the last
    `nn.Linear` that is as wide as the model's last `nn.Linear`; its
    observed bias is used, else its observed weight's row sums.

    For `count` > 1 (pollen's extension, not the paper's): the `count`
    classes with the most negative gradient, each once; where fewer than
    `count` are negative, the negative ones (or, where none is, the most
    negative) are repeated in that order until there are `count`.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    gradient = -_output_evidence(observed, model)  # the update is -lr * gradient
    order = torch.argsort(gradient, stable=True)
    negative = order[: int((gradient < 0).sum())]
    if len(negative) >= count:
        return negative[:count]
    pool = negative if len(negative) else order[:1]
    return pool.repeat(math.ceil(count / len(pool)))[:count]


def simulated_update(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    training: LocalTraining,
) -> dict[str, torch.Tensor]:
    """theta_T - theta_0 for every trained parameter, had the client(s)
    trained on (`inputs`, `targets`) as `training` says; differentiable in
    both (the gradients are taken with create_graph). `targets` holds class
    indices (n,) or class probabilities (n, classes). The model runs in the
    mode it is in (`reconstruct` puts it in train mode, as the client
    trained: BatchNorm normalises with each batch's statistics); its
    buffers are copied for each client, so running statistics the replay
    updates never reach the model."""
    start = _trained(model)
    share = len(inputs) // training.clients
    total = {name: torch.zeros_like(value) for name, value in start.items()}
    for client in range(training.clients):
        mine = slice(client * share, (client + 1) * share)
        buffers = {name: value.clone() for name, value in model.named_buffers()}
        theta = {
            name: value.requires_grad_() for name, value in _trained(model).items()
        }
        for batch in training.batches(share, client):
            logits = functional_call(
                model, {**buffers, **theta}, (inputs[mine][batch],)
            )
            loss = F.cross_entropy(logits, targets[mine][batch])
            grads = training.clipped(
                torch.autograd.grad(
                    loss, list(theta.values()), create_graph=True, allow_unused=True
                )
            )
            theta = {
                name: value if grad is None else value - training.lr * grad
                for (name, value), grad in zip(theta.items(), grads, strict=True)
            }
        total = {name: total[name] + theta[name] - start[name] for name in start}
    return total


def reconstruct(
    attack: str,
    model: nn.Module,
    observed: Mapping[str, torch.Tensor],
    *,
    count: int,
    input_shape: tuple[int, ...],
    training: LocalTraining,
    box: tuple[float, float],
    iterations: int,
    seed: int,
    tv_weight: float = 1e-4,
    restarts: int = 1,
) -> Reconstruction:
    """`count` examples of shape `input_shape` (C, H, W) rebuilt from the
    `observed` update by `attack` (one of `ATTACKS`).

    `model` holds the weights the client started from; `observed` maps some
    of its trained parameters' names to their update (new - old). `box`
    (low, high) bounds a valid input in normalised units (for pixels in
    [0, 1] normalised by mean m and std s: (-m / s, (1 - m) / s)); IG stays
    inside it, and the L-BFGS attacks' result is clipped to it. `tv_weight`
    is IG's alpha. The best of `restarts` runs (by the final loss) is kept,
    for every attack. The dummy inputs (and DLG's label logits) are drawn
    N(0, 1) from a generator seeded with `seed`: a seed gives one
    reconstruction. The number of classes is the width of the model's output.

    iDLG and IG put the inferred labels on the dummy examples in
    `infer_labels`' order. Where a client took more than one batch, which
    label went into which batch is unknown, and a wrong placement can stall
    these two (DLG learns its labels in place).

    `iterations` bounds Adam's steps (IG), or L-BFGS's iterations, at most
    1.25 times as many evaluations of the objective (DLG, iDLG; torch's
    default); L-BFGS stops early where it no longer makes progress.

    The L2 distance is divided by ||Delta||^2, which leaves its minimum
    where it is and keeps L-BFGS's tolerances meaningful for small
    learning rates. It assumes Delta is the update as sent: for a clipped
    or rescaled one use "ig" (the cosine ignores scale).
    """
    _check(attack, model, observed, count, input_shape, box, iterations, restarts)
    if tv_weight < 0:
        raise ValueError(f"tv_weight must be non-negative, not {tv_weight}")
    if count % training.clients:
        raise ValueError(
            f"count ({count}) must be a multiple of the clients summed "
            f"({training.clients}): each has the same number of examples"
        )
    device = next(model.parameters()).device
    problem = _Problem(
        model=model,
        target={k: v.detach().to(device, torch.float32) for k, v in observed.items()},
        training=training,
        box=box,
        iterations=iterations,
    )
    generator = torch.Generator().manual_seed(seed)
    runs = []
    with _mode(model, train=True):
        classes = _output_width(model, input_shape, device)
        if attack != "dlg":
            labels = infer_labels(observed, model, count).to(device)
        for _ in range(restarts):
            images = torch.randn((count, *input_shape), generator=generator)
            images = images.to(device).requires_grad_()
            if attack == "dlg":
                logits = torch.randn((count, classes), generator=generator)
                runs.append(_dlg(problem, images, logits.to(device).requires_grad_()))
            elif attack == "idlg":
                runs.append(_idlg(problem, images, labels))
            else:
                runs.append(_ig(problem, images, labels, tv_weight))
    return min(runs, key=lambda run: run.loss if math.isfinite(run.loss) else math.inf)


Objective = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class _Problem:
    """What every attack matches against, and within which budget."""

    model: nn.Module
    target: dict[str, torch.Tensor]
    training: LocalTraining
    box: tuple[float, float]
    iterations: int

    def update(
        self, images: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return simulated_update(self.model, images, targets, self.training)


def _dlg(
    problem: _Problem, images: torch.Tensor, logits: torch.Tensor
) -> Reconstruction:
    """DLG: L-BFGS over x' and the label logits on the L2 distance."""

    def objective() -> torch.Tensor:
        return _l2(problem.update(images, logits.softmax(-1)), problem.target)

    done = _lbfgs([images, logits], objective, problem.iterations)
    with torch.no_grad():
        images.clamp_(*problem.box)
    return _result(images, logits.argmax(-1), objective, done)


def _idlg(
    problem: _Problem, images: torch.Tensor, labels: torch.Tensor
) -> Reconstruction:
    """iDLG: L-BFGS over x' on the L2 distance, the labels fixed."""

    def objective() -> torch.Tensor:
        return _l2(problem.update(images, labels), problem.target)

    done = _lbfgs([images], objective, problem.iterations)
    with torch.no_grad():
        images.clamp_(*problem.box)
    return _result(images, labels, objective, done)


def _ig(
    problem: _Problem, images: torch.Tensor, labels: torch.Tensor, tv_weight: float
) -> Reconstruction:
    """Inverting Gradients: signed Adam on the cosine distance + alpha TV,
    projected into the box after every step."""

    def objective() -> torch.Tensor:
        distance = _cosine(problem.update(images, labels), problem.target)
        return distance + tv_weight * _total_variation(images)

    with torch.no_grad():
        images.clamp_(*problem.box)
    optimizer = torch.optim.Adam([images], lr=IG_STEP_SIZE)
    drops = [problem.iterations * eighths // 8 for eighths in (3, 5, 7)]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, drops, gamma=0.1)
    for _ in range(problem.iterations):
        optimizer.zero_grad()
        objective().backward()
        images.grad.sign_()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            images.clamp_(*problem.box)
    return _result(images, labels, objective, problem.iterations)


def _lbfgs(variables: list[torch.Tensor], objective: Objective, iterations: int) -> int:
    """Minimise `objective` over `variables` with up to `iterations` L-BFGS
    iterations (strong-Wolfe line search); the iterations it took."""
    optimizer = torch.optim.LBFGS(
        variables,
        max_iter=iterations,
        history_size=100,
        tolerance_grad=1e-10,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
    return optimizer.state[variables[0]].get("n_iter", 0)


def _result(
    images: torch.Tensor, labels: torch.Tensor, objective: Objective, iterations: int
) -> Reconstruction:
    return Reconstruction(
        images=images.detach().cpu(),
        labels=labels.detach().cpu(),
        loss=float(objective().detach()),
        iterations=iterations,
    )


def _l2(
    simulated: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """||Delta' - Delta||^2 / ||Delta||^2 over the observed entries."""
    distance = sum(
        ((simulated[name] - value) ** 2).sum() for name, value in target.items()
    )
    scale = sum((value**2).sum() for value in target.values())
    return distance / scale


def _cosine(
    simulated: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """1 - <Delta, Delta'> / (||Delta|| ||Delta'||) over the observed entries."""
    dot = sum((simulated[name] * value).sum() for name, value in target.items())
    norm = sum((simulated[name] ** 2).sum() for name in target).sqrt()
    target_norm = sum((value**2).sum() for value in target.values()).sqrt()
    tiny = torch.finfo(dot.dtype).tiny
    return 1 - dot / (norm * target_norm).clamp_min(tiny)


def _total_variation(images: torch.Tensor) -> torch.Tensor:
    """The mean absolute difference of neighbouring pixels, down and across."""
    down = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    across = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return down + across


def _trained(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters' values, detached."""
    return {
        name: value.detach()
        for name, value in model.named_parameters()
        if value.requires_grad
    }


def _output_evidence(
    observed: Mapping[str, torch.Tensor], model: nn.Module
) -> torch.Tensor:
    """Per class, the observed update's output bias, else its weight's row sums."""
    linears = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
    ]
    if not linears:
        raise ValueError(
            "labels are inferred from an nn.Linear output layer; the model has none"
        )
    width = linears[-1][1].out_features
    heads = [name for name, m in linears if m.out_features == width]
    for kind in ("bias", "weight"):
        seen = [_join(head, kind) for head in heads if _join(head, kind) in observed]
        if seen:
            update = observed[seen[-1]].detach().float().cpu()
            return update if kind == "bias" else update.sum(dim=1)
    names = dict(model.named_parameters())
    wanted = ", ".join(
        name
        for head in heads
        for name in (_join(head, "bias"), _join(head, "weight"))
        if name in names
    )
    raise ValueError(
        f"labels are inferred from the output layer's update, and the observed "
        f"update holds none of {wanted}; attack 'dlg' finds labels itself"
    )


def _join(module: str, parameter: str) -> str:
    return f"{module}.{parameter}" if module else parameter


def _output_width(
    model: nn.Module, input_shape: tuple[int, ...], device: torch.device
) -> int:
    """The number of classes: the width of the model's output (in eval
    mode: a batch of one leaves BatchNorm's statistics alone)."""
    with _mode(model, train=False), torch.no_grad():
        return int(model(torch.zeros((1, *input_shape), device=device)).shape[-1])


@contextmanager
def _mode(model: nn.Module, train: bool) -> Iterator[None]:
    """`model` in train (or eval) mode, each module's own mode restored
    after. The attacks run in train mode, as the client trains; the model's
    buffers are never written (`simulated_update` replays on copies)."""
    modes = [(module, module.training) for module in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _check(
    attack: str,
    model: nn.Module,
    observed: Mapping[str, torch.Tensor],
    count: int,
    input_shape: tuple[int, ...],
    box: tuple[float, float],
    iterations: int,
    restarts: int,
) -> None:
    """ValueError naming what is wrong and what is allowed."""
    if attack not in ATTACKS:
        raise ValueError(
            f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}"
        )
    if count < 1:
        raise ValueError(f"count (examples to rebuild) must be at least 1, not {count}")
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(
            f"input_shape must be (channels, height, width), not {input_shape}"
        )
    if not box[0] < box[1]:
        raise ValueError(f"the box (low, high) must have low < high, not {box}")
    if iterations < 1 or restarts < 1:
        raise ValueError(
            f"iterations and restarts must be at least 1, not {iterations} and {restarts}"
        )
    if not observed:
        raise ValueError("the observed update holds no entry")
    trained = {
        name: value.shape
        for name, value in model.named_parameters()
        if value.requires_grad
    }
    for name, value in observed.items():
        if name not in trained:
            shown = ", ".join(list(trained)[:6]) + (", ..." if len(trained) > 6 else "")
            raise ValueError(
                f"observed entry {name!r} is not a trained parameter of the model; "
                f"it trains {len(trained)}: {shown}"
            )
        if tuple(value.shape) != tuple(trained[name]):
            raise ValueError(
                f"observed entry {name!r} has shape {tuple(value.shape)}; "
                f"the model's parameter has {tuple(trained[name])}"
            )
    if not any(bool(value.any()) for value in observed.values()):
        raise ValueError("the observed update is zero everywhere: nothing to match")

"""The cohort trainer: K clients' local epochs as one vectorised computation.

Cross-device rounds train many clients, each a small model on a few small
batches; one client after another, that is mostly per-step overhead. Here
the trainable parameters of K clients are stacked on a leading client
dimension, and each local step is one `torch.func.vmap` of
`grad_and_value(functional_call(model, ...))` over every client's batch
(Flower-free, model-agnostic; torch.func:
https://pytorch.org/docs/stable/func.html). The optimiser's and the
objective's updates are elementwise on the stacked tensors.

Each client trains exactly as `pollen.task.train.train_local` trains it:

- its batches are those its own `ShuffledBatches` draws (same seeds, order
  and augmentation). Clients are ordered by their number of steps, so at
  step t those that still train are a prefix of the stack, stepped in
  place; a short last batch is padded with samples of weight 0 (masked:
  they add exact zeros to the loss and its gradient), and a client without
  a batch is not stepped. Once no more than `SOLO_CLIENTS` still train,
  each finishes alone on `train_loop`, its optimiser state carried over;
- BatchNorm's running statistics are stacked over clients like the
  parameters, and each client's forward pass updates its own; a BatchNorm
  model's batches are never padded (padding would enter its batch
  statistics): a step whose batches differ in size takes one `vmap` call
  per size (`pollen.task.cohort_norm`);
- per step, as the sequential loop: g = grad F_k on the batch (with SAM, at
  theta + rho g / (||g|| + 1e-12) instead, Foret et al. 2021, a pass that
  leaves the running statistics as the clean pass left them), plus the
  regulariser's gradient in its affine form pull (theta - anchor) + offset
  (`objectives.AffineGradient`: FedProx, FedDyn, SCAFFOLD), the client's
  total norm clipped to `max-grad-norm` as `clip_grad_norm_` does, then
  torch's own SGD (momentum, weight decay), Adam or AdamW update, its fused
  functional form over the stacked tensors;
- the reported loss is the mean clean-pass loss over its steps.

A node's clients train in consecutive chunks whose sizes differ by at most
one, largest shards first (a chunk's clients then take similar numbers of
steps): as many as `cohort-memory-mib` holds and, on the CPU, as keep every
tensor of a step below glibc's mmap threshold (`HEAP_TENSOR_BYTES`).

Afterwards each client's model holds its trained parameters and running
statistics, so the objective's `save` and the ClientApp's reply read them
as they would after `train_local`. What a cohort cannot reproduce it
refuses (`cohort_problem`): BatchNorm with `momentum=None` (its cumulative
factor 1 / num_batches_tracked is read as a Python number, per client,
which `vmap` cannot do), dropout (vmap cannot draw each client's masks), a
regulariser without the affine form, an optimiser other than
sgd/adam/adamw.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from .cohort_norm import Call, Stacked, gradients, running_statistics, step_calls
from .objectives import LocalObjective, frozen_bn_statistics
from .train import (
    Batch,
    Batches,
    ClientOptimizer,
    OptimizerStep,
    ShuffledBatches,
    TrainResult,
    Transform,
    has_batch_norm,
    no_preprocess,
    train_loop,
    trainable,
)

# when no more clients than this still train, each finishes alone
SOLO_CLIENTS = 2
ADAM_EPS = 1e-8  # torch.optim.Adam's and AdamW's default
# glibc serves an allocation above 32 MiB (its largest dynamic mmap
# threshold on 64-bit Linux, DEFAULT_MMAP_THRESHOLD_MAX in malloc/malloc.c)
# from fresh mapped pages and unmaps them when it is freed: a stacked
# gradient or activation that large is page-faulted and zeroed anew at every
# step (a vectorised step of 100 Fashion-MNIST `mlp` clients, whose first
# layer's gradient is 40 MB: 24.9 ms, 12.6 ms with glibc's threshold
# raised). A CPU chunk keeps each of its tensors below it, by its estimate
# (`client_footprint`), less a page for malloc's header and alignment.
HEAP_TENSOR_BYTES = 32 * 2**20 - 4096


def cohort_problem(
    model: nn.Module, objective: LocalObjective, optimizer: ClientOptimizer
) -> str | None:
    """Why the cohort trainer cannot train this combination, or None."""
    modules = list(model.modules())
    refused = "; allowed: client-execution='sequential'"
    if any(isinstance(m, _BatchNorm) and m.momentum is None for m in modules):
        return (
            "client-execution='cohort': the model has BatchNorm with "
            "momentum=None, whose cumulative average reads each client's "
            "batch counter as a number, which a vectorised cohort cannot" + refused
        )
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in modules):
        return (
            "client-execution='cohort': the model has dropout, and a vectorised "
            "cohort cannot draw each client's own masks" + refused
        )
    if optimizer.name not in ("sgd", "adam", "adamw"):
        return (
            f"client-execution='cohort': client-optimizer={optimizer.name!r}{refused}"
        )
    if objective.batch_term is not None:
        return (
            "client-execution='cohort': the local objective's term on each batch "
            f"({type(objective.batch_term).__name__}) needs one client's forward "
            "pass" + refused
        )
    term = objective.regularizer
    if term is not None and not callable(getattr(term, "affine", None)):
        return (
            f"client-execution='cohort': the local objective's term "
            f"{type(term).__name__} has no affine() gradient form "
            "(pollen.task.objectives.AffineGradient)" + refused
        )
    return None


@dataclass(frozen=True)
class Footprint:
    """What one client of a vectorised chunk takes: `bytes` in all, and its
    share of the largest single tensor a step allocates (`largest`)."""

    bytes: int
    largest: int


def client_footprint(
    model: nn.Module,
    sample: torch.Tensor,
    batch_size: int,
    optimizer: ClientOptimizer,
    objective: LocalObjective,
    examples: int = 0,
) -> Footprint:
    """Estimated memory of one client in a vectorised chunk: its trainable
    parameters with their gradient, optimiser and objective copies, the
    activations autograd saves for a batch (measured on `sample`, one input
    batch, and scaled to `batch_size`), and its `examples` inputs of the
    round (every epoch's batches are made before the chunk trains); and the
    larger of its largest parameter (a gradient) and its largest saved
    activation, scaled to `batch_size`."""
    params = trainable(model).values()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    largest_param = max((p.numel() * p.element_size() for p in params), default=0)
    copies = 2  # the parameters and their gradient
    copies += {"sgd": int(optimizer.momentum > 0), "adam": 2, "adamw": 2}.get(
        optimizer.name, 2
    )
    copies += 2 if objective.regularizer is not None else 0  # anchor, offset
    copies += 1 if objective.sam_rho > 0 else 0  # SAM's perturbed point
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[int] = []  # activations; a layer saves its weight too

    def count(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
    with hooks, frozen_bn_statistics(model):  # client 0's statistics stay
        F.cross_entropy(
            model(sample),
            torch.zeros(len(sample), dtype=torch.long, device=sample.device),
        ).backward()
    model.zero_grad(set_to_none=True)
    per_sample = sample[0].numel() * sample.element_size()
    scale = batch_size / max(len(sample), 1)
    activations = int(sum(saved) * scale)
    return Footprint(
        copies * param_bytes + activations + examples * per_sample,
        max(largest_param, int(max(saved, default=0) * scale)),
    )


@dataclass
class _Client:
    """One member: its steps' batches (all epochs, in order), its objective."""

    shard: tuple[torch.Tensor, torch.Tensor]
    steps: list[Batch]
    objective: LocalObjective


class _Cohort:
    """A chunk of clients' stacked parameters, BatchNorm statistics,
    optimiser and objective state.

    The clients are ordered by their number of steps, most first, so the
    clients that still train at step t are always a prefix of the stack:
    each step works on leading slices, in place, with no gather or scatter
    (but for a BatchNorm model's batches of unequal sizes:
    `cohort_norm.step_calls`).
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        clients: Sequence[_Client],
        optimizer: ClientOptimizer,
        max_grad_norm: float,
    ) -> None:
        self.template = models[0]
        self.clients = clients
        names = list(trainable(models[0]))
        self.params: Stacked = {
            n: torch.stack([trainable(m)[n].detach() for m in models]) for n in names
        }
        self.stats: Stacked = {
            n: torch.stack([dict(m.named_buffers())[n] for m in models])
            for n in running_statistics(models[0])
        }
        self.fixed = _fixed_entries(models, {*names, *self.stats})
        self.batch_norm = has_batch_norm(models[0])
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        self.state = _optimizer_state(optimizer, self.params)
        self.sam_rho = clients[0].objective.sam_rho
        self.terms = _stacked_terms([c.objective for c in clients])
        device = next(iter(self.params.values())).device
        self.loss_sum = torch.zeros(len(clients), device=device)
        # over params, per-client fixed entries, running statistics (updated
        # in place), inputs, targets, sample weights; a function of the
        # template, not of self: no reference cycle keeps a finished chunk's
        # tensors alive until the next GC
        loss = partial(_masked_loss, self.template, self.fixed.shared)
        self.vmapped = vmap(grad_and_value(loss))

    def step(self, n: int, t: int) -> None:
        """Step `t` (0-based) of the first `n` clients, each on its own batch."""
        params = {name: v[:n] for name, v in self.params.items()}
        fixed = {name: v[:n] for name, v in self.fixed.stacked.items()}
        stats = {name: v[:n] for name, v in self.stats.items()}
        batches = [c.steps[t] for c in self.clients[:n]]
        calls = step_calls(batches, self.batch_norm)
        grads, loss = gradients(self.vmapped, params, fixed, stats, calls)
        if self.sam_rho > 0:
            grads = self._sam_gradient(params, fixed, stats, calls, grads)
        self.loss_sum[:n] += loss.detach()
        self._add_regularizer(grads, params, n)
        clip = None
        if self.max_grad_norm > 0:
            clip = _clip_factors(grads, self.max_grad_norm)
        state = {
            k: {name: v[:n] for name, v in s.items()} for k, s in self.state.items()
        }
        _optimizer_step(self.optimizer, params, grads, state, t + 1, clip)

    def _sam_gradient(
        self,
        params: Stacked,
        fixed: Stacked,
        stats: Stacked,
        calls: list[Call],
        grads: Stacked,
    ) -> Stacked:
        """The data gradient at theta + eps, eps = rho g / (||g|| + 1e-12);
        the running statistics stay as the clean pass left them (as
        `frozen_bn_statistics` keeps them in the sequential loop)."""
        scale = self.sam_rho / (_client_norms(grads) + 1e-12)
        moved = {n: p + grads[n] * _per_client(scale, p) for n, p in params.items()}
        scratch = {name: v.clone() for name, v in stats.items()}
        again, _ = gradients(self.vmapped, moved, fixed, scratch, calls)
        return again

    def _add_regularizer(self, grads: Stacked, params: Stacked, n: int) -> None:
        """g += pull (theta - anchor) + offset over the anchored entries."""
        if self.terms is None:
            return
        pull, anchor, offset = self.terms
        for name in anchor:
            term = (params[name] - anchor[name][:n]).mul_(pull) if pull else None
            if name in offset:
                term = offset[name][:n] if term is None else term.add_(offset[name][:n])
            if term is not None:
                grads[name].add_(term)

    def write_back(self, models: Sequence[nn.Module]) -> None:
        """Each client's trained parameters and running statistics into its
        model."""
        with torch.no_grad():
            for k, model in enumerate(models):
                for name, param in trainable(model).items():
                    param.copy_(self.params[name][k])
                buffers = dict(model.named_buffers())
                for name, stacked in self.stats.items():
                    buffers[name].copy_(stacked[k])


def _masked_loss(
    template: nn.Module,
    shared: dict[str, torch.Tensor],
    params: Stacked,
    fixed: Stacked,
    stats: Stacked,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """One client's mean cross-entropy over its batch's real samples (weight
    1; padding weighs 0, so it adds exact zeros to the sum). The forward
    pass updates the running statistics `stats` in place."""
    entries = {**shared, **fixed, **stats, **params}
    logits = functional_call(template, entries, (inputs,))
    losses = F.cross_entropy(logits, targets, reduction="none")
    return (losses * weights).sum() / weights.sum()


@dataclass
class _Fixed:
    """The entries no step moves: those equal on every client (`shared`),
    the others stacked over clients."""

    shared: dict[str, torch.Tensor]
    stacked: Stacked


def _fixed_entries(models: Sequence[nn.Module], moved: set[str]) -> _Fixed:
    states = [{**dict(m.named_parameters()), **dict(m.named_buffers())} for m in models]
    shared, stacked = {}, {}
    for name in states[0]:
        if name in moved:
            continue
        values = [s[name].detach() for s in states]
        if all(torch.equal(v, values[0]) for v in values[1:]):
            shared[name] = values[0]
        else:
            stacked[name] = torch.stack(values)
    return _Fixed(shared, stacked)


def _per_client(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[clients] -> broadcastable against `like` ([clients, ...])."""
    return values.view(-1, *([1] * (like.dim() - 1)))


def _client_norms(tensors: Stacked) -> torch.Tensor:
    """Each client's norm over all its entries, as torch's total norm."""
    norms = [torch.linalg.vector_norm(t.flatten(1), dim=1) for t in tensors.values()]
    return torch.linalg.vector_norm(torch.stack(norms, dim=1), dim=1)


def _clip_factors(grads: Stacked, max_norm: float) -> torch.Tensor:
    """`nn.utils.clip_grad_norm_`'s factor per client, min(1, C / (||g|| +
    1e-6)), by which its gradient is scaled."""
    return (max_norm / (_client_norms(grads) + 1e-6)).clamp(max=1.0)


def _optimizer_state(optimizer: ClientOptimizer, params: Stacked) -> dict[str, Stacked]:
    """Zeroed per-client optimiser state: SGD's momentum buffer (rho * 0 + g
    is g exactly, torch's first step), Adam's two moments."""
    if optimizer.name == "sgd":
        if not optimizer.momentum:
            return {}
        return {"momentum": {n: torch.zeros_like(p) for n, p in params.items()}}
    return {
        key: {n: torch.zeros_like(p) for n, p in params.items()}
        for key in ("exp_avg", "exp_avg_sq")
    }


def _optimizer_step(
    optimizer: ClientOptimizer,
    params: Stacked,
    grads: Stacked,
    state: dict[str, Stacked],
    step: int,
    clip: torch.Tensor | None = None,
) -> None:
    """torch.optim's own update (its functional SGD or Adam, `fused`: one
    pass over each stacked tensor, where the plain update takes four, and
    for 100 clients the tensors exceed the caches), in place on the (sliced)
    stacked parameters and state, of the gradients scaled by the clients'
    `clip` factors (None: 1). The update is elementwise, so on stacked
    tensors it is each client's own; `step` is the 1-based step of every
    client stepped here."""
    names = list(params)
    # the fused kernels read a gradient laid out as its parameter is; vmap
    # may return one transposed or broadcast (a user's model)
    tensors = [params[n] for n in names]
    updates = [grads[n].contiguous() for n in names]
    if clip is not None:
        for g in updates:
            g.mul_(_per_client(clip, g))
    if optimizer.name == "sgd":
        momentum = [state["momentum"][n] for n in names] if optimizer.momentum else []
        sgd(
            tensors, updates, momentum or [None] * len(names), fused=True,
            weight_decay=optimizer.weight_decay, momentum=optimizer.momentum,
            lr=optimizer.lr, dampening=0.0, nesterov=False, maximize=False,
        )  # fmt: skip
        return
    # one count per tensor, on its device (fused Adam adds the step itself)
    steps = [torch.full((), step - 1.0, device=t.device) for t in tensors]
    beta1, beta2 = optimizer.betas
    adam(
        tensors, updates, [state["exp_avg"][n] for n in names],
        [state["exp_avg_sq"][n] for n in names], [], steps, fused=True,
        decoupled_weight_decay=optimizer.name == "adamw", amsgrad=False,
        beta1=beta1, beta2=beta2, lr=optimizer.lr,
        weight_decay=optimizer.weight_decay, eps=ADAM_EPS, maximize=False,
    )  # fmt: skip


def _stacked_terms(
    objectives: Sequence[LocalObjective],
) -> tuple[float, Stacked, Stacked] | None:
    """The regularisers' affine forms, stacked over clients (None without one)."""
    if objectives[0].regularizer is None:
        return None
    forms = [o.regularizer.affine() for o in objectives]  # type: ignore[union-attr]
    anchor = {n: torch.stack([f.anchor[n] for f in forms]) for n in forms[0].anchor}
    offset = {n: torch.stack([f.offset[n] for f in forms]) for n in forms[0].offset}
    return forms[0].pull, anchor, offset


def _client_steps(
    x: torch.Tensor,
    y: torch.Tensor,
    prep: Transform,
    batch_size: int,
    epochs: int,
    seed: int,
    skip_single: bool,
) -> list[Batch]:
    """Every batch the client's sequential training takes, in order."""
    batches = ShuffledBatches(
        x, y, prep, batch_size=batch_size, num_epochs=epochs, seed=seed,
        skip_single=skip_single,
    )  # fmt: skip
    return [batch for epoch in batches.epochs() for batch in epoch]


def _train_chunk(
    models: Sequence[nn.Module],
    clients: Sequence[_Client],
    optimizer: ClientOptimizer,
    max_grad_norm: float,
) -> list[TrainResult]:
    """One vectorised cohort of `clients` (results in their order): stacked
    steps while more than `SOLO_CLIENTS` clients still train, then each
    remaining client's last steps by the sequential loop."""
    for model in models:  # as `train_loop`: BatchNorm normalises by its batch
        model.train()
    order = sorted(range(len(clients)), key=lambda k: -len(clients[k].steps))
    ordered = [clients[k] for k in order]
    ordered_models = [models[k] for k in order]
    cohort = _Cohort(ordered_models, ordered, optimizer, max_grad_norm)
    lengths = [len(c.steps) for c in ordered]
    t = 0
    while t < lengths[0] and (n := sum(1 for s in lengths if s > t)) > SOLO_CLIENTS:
        cohort.step(n, t)
        t += 1
    cohort.write_back(ordered_models)
    loss_sums = cohort.loss_sum.tolist()
    for i, client in enumerate(ordered):
        stacked = min(t, len(client.steps))
        if client.objective.regularizer is not None:
            client.objective.regularizer.count_steps(stacked)
        if stacked < len(client.steps):
            state = {
                k: {n: v[i] for n, v in s.items()} for k, s in cohort.state.items()
            }
            loss_sums[i] += _finish_alone(
                ordered_models[i], client, state, stacked, optimizer, max_grad_norm
            )
    by_client = dict(zip(order, loss_sums, strict=True))
    return [
        TrainResult(by_client[k] / len(c.steps), len(c.shard[1]), len(c.steps))
        for k, c in enumerate(clients)
    ]


@dataclass
class _Remaining(Batches):
    """A client's steps after the first `done`, as one pass."""

    rest: list[Batch] = field(default_factory=list)

    def epochs(self) -> Iterator[Iterator[Batch]]:
        yield iter(self.rest)


def _finish_alone(
    model: nn.Module,
    client: _Client,
    state: dict[str, dict[str, torch.Tensor]],
    done: int,
    optimizer: ClientOptimizer,
    max_grad_norm: float,
) -> float:
    """The client's steps from step `done` on, by the sequential loop
    (`train.train_loop`), from the parameters and running statistics
    `_Cohort.write_back` gave `model` and the optimiser state its stacked
    steps left; the sum of their losses. Once a cohort has shrunk to a few
    clients, a plain step costs less than a vectorised one."""
    rule = OptimizerStep(model, optimizer, max_grad_norm)
    if done:
        _carry_state(rule.optimizer, trainable(model), state, done)
    x, y = client.shard
    rest = _Remaining(x, y, no_preprocess, client.steps[done:])
    result = train_loop(model, rest, rule, client.objective)
    return result.loss * result.steps


def _carry_state(
    optimizer: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    state: dict[str, dict[str, torch.Tensor]],
    done: int,
) -> None:
    """Give torch's optimiser the state `done` stacked steps left."""
    for name, param in params.items():
        if "momentum" in state:
            optimizer.state[param]["momentum_buffer"] = state["momentum"][name].clone()
        if "exp_avg" in state:
            optimizer.state[param].update(
                step=torch.tensor(float(done)),
                exp_avg=state["exp_avg"][name].clone(),
                exp_avg_sq=state["exp_avg_sq"][name].clone(),
            )


def chunk_count(
    clients: int, footprint: Footprint, memory_bytes: int, device: torch.device
) -> int:
    """Into how many vectorised chunks a node's `clients` split: each holds
    no more than `memory_bytes` (> 0) and, on the CPU, than keep every tensor
    of a step below `HEAP_TENSOR_BYTES`."""
    limit = clients
    if memory_bytes > 0:
        limit = min(limit, memory_bytes // max(footprint.bytes, 1))
    if device.type == "cpu":
        limit = min(limit, HEAP_TENSOR_BYTES // max(footprint.largest, 1))
    return -(-clients // max(limit, 1))


def split_evenly(order: Sequence[int], count: int) -> list[list[int]]:
    """`order` cut into `count` consecutive parts whose sizes differ by at
    most one (a last chunk of a few clients would step them at a cohort's
    per-step cost, or alone)."""
    bounds = [i * len(order) // count for i in range(count + 1)]
    return [list(order[a:b]) for a, b in pairwise(bounds)]


def check_steps(
    model: nn.Module, num_examples: int, batch_size: int, epochs: int
) -> None:
    """Raise, as `train_local` would after its epochs, when a shard of
    `num_examples` gives `model` no training step (BatchNorm skips 1-sample
    batches)."""
    skip_single = has_batch_norm(model)
    if not ShuffledBatches.give_a_step(num_examples, batch_size, epochs, skip_single):
        raise ValueError(f"a shard of {num_examples} samples gives no training step")


def train_cohort(
    models: Sequence[nn.Module],
    shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    epochs: int,
    batch_size: int,
    optimizer: ClientOptimizer,
    preprocess: Sequence[Transform],
    seeds: Sequence[int],
    objectives: Sequence[LocalObjective],
    max_grad_norm: float = 0.0,
    memory_bytes: int = 0,
) -> list[TrainResult]:
    """`train_local` of every `models[k]` on `shards[k]` (its `preprocess`,
    `seeds` and loaded `objectives`), as one vectorised computation per
    chunk of clients; each model is trained in place. The clients train in
    `chunk_count` consecutive chunks of (nearly) equal size, largest shards
    first, so that a chunk's clients take similar numbers of steps; a
    client's footprint is estimated on the largest shard, so that the first
    chunk fits."""
    for model, (_, y) in zip(models, shards, strict=True):
        check_steps(model, len(y), batch_size, epochs)  # before any chunk trains
    skip_single = has_batch_norm(models[0])
    x, _ = shards[0]
    sample = preprocess[0](x[:batch_size], None)
    examples = epochs * max(len(y) for _, y in shards)
    footprint = client_footprint(
        models[0], sample, batch_size, optimizer, objectives[0], examples
    )
    device = next(iter(trainable(models[0]).values())).device
    count = chunk_count(len(models), footprint, memory_bytes, device)
    order = sorted(range(len(models)), key=lambda k: -len(shards[k][1]))
    results: dict[int, TrainResult] = {}
    for members in split_evenly(order, count):
        clients = []
        for k in members:  # a chunk's batches are made when it trains
            x, y = shards[k]
            steps = _client_steps(
                x, y, preprocess[k], batch_size, epochs, seeds[k], skip_single
            )
            clients.append(_Client((x, y), steps, objectives[k]))
        chunk_models = [models[k] for k in members]
        trained = _train_chunk(chunk_models, clients, optimizer, max_grad_norm)
        results.update(zip(members, trained, strict=True))
    return [results[k] for k in range(len(models))]

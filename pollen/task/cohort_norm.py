"""A cohort step's `vmap` calls (`pollen.task.cohort`), exact for BatchNorm.

A step takes every client's batch in one `vmap` call, a shorter batch
padded with samples of weight 0: exact for the loss and its gradient (the
padding weighs nothing), but not for BatchNorm, whose training-mode batch
mean and variance take every sample of the batch, padding included. So
where the model has BatchNorm and the clients' batches differ in size, the
step takes one call per size over the clients of that size, gathered by
row and scattered back: a few calls at most (the full batches, and the
short last batches of the clients whose epoch ends at that step).

BatchNorm's running statistics (mean, variance, batch counter) are stacked
over clients like the parameters and go through `vmap` into
`functional_call`: torch's batching rule for batch norm updates each
client's row in place, as `nn.BatchNorm*d` does in the sequential loop
(momentum's running average, the counter up by one per forward pass).
`momentum=None`'s cumulative average reads the counter as a Python number,
which `vmap` cannot; `cohort.cohort_problem` refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .train import Batch

Stacked = dict[str, torch.Tensor]  # entry name -> [clients, ...]
Padded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, targets, weights
# (params, fixed entries, running statistics, *padded batch) -> (grads, losses)
Vmapped = Callable[..., tuple[Stacked, torch.Tensor]]


@dataclass
class Call:
    """One `vmap` call of a step: the rows of the clients it takes (None:
    every client stepped) and their batches."""

    rows: torch.Tensor | None
    batch: Padded


def running_statistics(model: nn.Module) -> list[str]:
    """The names of the BatchNorm buffers a training-mode forward pass
    updates: running mean, variance and batch counter (none without
    `track_running_stats`)."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, _BatchNorm)
        for name, _ in module.named_buffers(recurse=False)
    ]


def step_calls(batches: list[Batch], batch_norm: bool) -> list[Call]:
    """The `vmap` calls of a step on the clients' `batches`: one over all of
    them, padded, but for a `batch_norm` model whose batches differ in size
    one per size."""
    sizes = [len(y) for _, y in batches]
    if not batch_norm or len(set(sizes)) == 1:
        return [Call(None, padded(batches))]
    calls = []
    for size in sorted(set(sizes)):
        members = [k for k, s in enumerate(sizes) if s == size]
        rows = torch.tensor(members, device=batches[0][1].device)
        calls.append(Call(rows, padded([batches[k] for k in members])))
    return calls


def padded(batches: list[Batch]) -> Padded:
    """Inputs [n, B, ...], targets [n, B] and sample weights [n, B] of the
    clients' batches, a shorter batch padded to the longest with zeros that
    weigh nothing."""
    sizes = [len(y) for _, y in batches]
    longest = max(sizes)
    device = batches[0][1].device
    inputs, targets = [], []
    for x, y in batches:
        if short := longest - len(y):
            x = torch.cat([x, x.new_zeros(short, *x.shape[1:])])
            y = torch.cat([y, y.new_zeros(short)])
        inputs.append(x), targets.append(y)
    if min(sizes) == longest:  # most steps; no copy from the host
        weights = torch.ones(len(sizes), longest, device=device)
    else:
        lengths = torch.tensor(sizes).unsqueeze(1)
        weights = (torch.arange(longest) < lengths).float().to(device)
    return torch.stack(inputs), torch.stack(targets), weights


def gradients(
    vmapped: Vmapped,
    params: Stacked,
    fixed: Stacked,
    stats: Stacked,
    calls: list[Call],
) -> tuple[Stacked, torch.Tensor]:
    """Each client's data gradient and loss on its batch, by `calls`; the
    forward passes update the running statistics `stats` in place. The
    clients of a call that is not everyone's are gathered by row, and their
    gradients, losses and statistics scattered back."""
    if calls[0].rows is None:
        return vmapped(params, fixed, stats, *calls[0].batch)
    grads = {name: torch.empty_like(p) for name, p in params.items()}
    first = next(iter(grads.values()))
    loss = first.new_empty(len(first))
    for call in calls:
        rows = call.rows
        taken = {name: v[rows] for name, v in stats.items()}
        group_grads, group_loss = vmapped(
            {name: v[rows] for name, v in params.items()},
            {name: v[rows] for name, v in fixed.items()},
            taken,
            *call.batch,
        )
        loss[rows] = group_loss
        for name, v in group_grads.items():
            grads[name][rows] = v
        for name, v in taken.items():
            stats[name][rows] = v
    return grads, loss

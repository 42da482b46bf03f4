"""Sharing policies: which model entries travel, decided by the module that owns them.

Every state-dict entry gets a kind from the module type that owns it and
whether it is trained, never from its name:

- `weight`: a trained parameter outside BatchNorm;
- `head`: a trained parameter of the model's last `nn.Linear`, its
  classifier (FedPer's personal layer, Arivazhagan et al. 2019,
  https://arxiv.org/abs/1912.00818);
- `bn-affine`: BatchNorm's trained scale and shift;
- `bn-stat`: BatchNorm's running mean, variance and batch counter;
- `buffer`: any other persistent buffer;
- `lora-a`, `lora-b`: the A and B matrices of a `LoRALinear`;
- `frozen`: a parameter that is not trained (it never travels).

A policy is the set of kinds that travel; everything else stays on the
client, in `context.state`, and is restored before its next local training.
`shared`, `fedbn` (Li et al. 2021, https://arxiv.org/abs/2102.07623) and
`silobn` (Andreux et al. 2020, https://arxiv.org/abs/2008.07424) differ in
BatchNorm entries only; `lora-a` (FedSA) sends the A matrices alone, `lora`
both A and B; `fedper` sends everything but the classifier, so each client
keeps a personal classifier over the shared base layers, restored from
`context.state` like every local entry (FedPer needs no training schedule of
its own; FedRep, on the same policy, adds one: `pollen.task.fedrep`); `lg`
is its mirror, LG-FedAvg (Liang et al. 2020, https://arxiv.org/abs/2001.01523,
Algorithm 1): only the classifier travels, so each client keeps its own
representation (every layer below the classifier, BatchNorm included) and
the federation learns one global classifier over them (the authors keep
the top few layers global; one is PFLlib's form). `local` sends nothing of
the model: each client trains its own alone (the local-training baseline),
or shares only what its local objective sends beside the model (FedProto's
prototypes, `pollen.task.fedproto`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from .lora import LoRALinear

Kind = Literal[
    "weight", "head", "bn-affine", "bn-stat", "buffer", "lora-a", "lora-b", "frozen"
]
LORA: frozenset[Kind] = frozenset({"lora-a", "lora-b"})
TRAINED: frozenset[Kind] = frozenset({"weight", "head", "bn-affine"}) | LORA

POLICIES: dict[str, frozenset[Kind]] = {
    "shared": frozenset({"weight", "head", "bn-affine", "bn-stat", "buffer"}) | LORA,
    "fedbn": frozenset({"weight", "head", "buffer"}) | LORA,
    "silobn": frozenset({"weight", "head", "bn-affine", "buffer"}) | LORA,
    "lora-a": frozenset({"lora-a"}),
    "lora": LORA,
    "fedper": frozenset({"weight", "bn-affine", "bn-stat", "buffer"}),
    "lg": frozenset({"head"}),
    "local": frozenset(),
}


def classifier_name(model: nn.Module) -> str | None:
    """The module name of `model`'s classifier, its last `nn.Linear` ("" for
    a model that is one), or None without one."""
    linears = [
        p
        for p, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, nn.Linear)
    ]
    return linears[-1] if linears else None


def entry_kinds(model: nn.Module) -> dict[str, Kind]:
    """The kind of every state-dict entry of `model`, in state-dict order."""
    kinds: dict[str, Kind] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm)
        dot = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                kinds[dot + name] = "frozen"
            else:
                kinds[dot + name] = "bn-affine" if is_bn else "weight"
        for name, _ in module.named_buffers(recurse=False):
            kinds[dot + name] = "bn-stat" if is_bn else "buffer"
    head = classifier_name(model)
    if head is not None:
        dot = f"{head}." if head else ""
        for name in ("weight", "bias"):
            if kinds.get(dot + name) == "weight":
                kinds[dot + name] = "head"
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, LoRALinear):
            for part, kind in (("lora_a", "lora-a"), ("lora_b", "lora-b")):
                name = f"{prefix}.{part}.weight" if prefix else f"{part}.weight"
                if kinds[name] != "frozen":
                    kinds[name] = kind
    return {name: kinds[name] for name in model.state_dict()}


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts by role: total, trainable, LoRA A and LoRA B."""
    kinds = entry_kinds(model)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return {
        "total": sum(sizes.values()),
        "trainable": sum(n for k, n in sizes.items() if kinds[k] != "frozen"),
        "lora-a": sum(n for k, n in sizes.items() if kinds[k] == "lora-a"),
        "lora-b": sum(n for k, n in sizes.items() if kinds[k] == "lora-b"),
    }


@dataclass(frozen=True)
class Sharing:
    """A policy applied to one model: which entries travel and which are trained."""

    policy: str
    kinds: Mapping[str, Kind]

    @classmethod
    def of(cls, policy: str, model: nn.Module) -> Sharing:
        if policy not in POLICIES:
            raise ValueError(
                f"unknown sharing policy {policy!r}; allowed: {', '.join(POLICIES)}"
            )
        return cls(policy, entry_kinds(model))

    @property
    def shared(self) -> tuple[str, ...]:
        """Entries that travel, in both directions."""
        travels = POLICIES[self.policy]
        return tuple(k for k, kind in self.kinds.items() if kind in travels)

    @property
    def local(self) -> tuple[str, ...]:
        """Trained or tracked entries that stay on the client."""
        travels = POLICIES[self.policy]
        return tuple(
            k
            for k, kind in self.kinds.items()
            if kind not in travels and kind != "frozen"
        )

    def trained_shared(self, exclude_bn: bool = False) -> tuple[str, ...]:
        """Shared entries a server optimiser may step (never buffers or statistics)."""
        kinds = TRAINED - {"bn-affine"} if exclude_bn else TRAINED
        return tuple(k for k in self.shared if self.kinds[k] in kinds)

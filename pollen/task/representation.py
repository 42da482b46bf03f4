"""A model's representation: the input of its classifier, seen by a hook.

The classifier is the model's last `nn.Linear` (the `head` of
`pollen.task.sharing`); what it takes in is what personalised methods call
the representation (MOON's z, FedProto's and FedRoD's features): the
output of the model's body, flattened. A forward hook reads it off the
model's own forward pass, so no model needs a `features` method.
"""

from __future__ import annotations

import torch
from torch import nn

from .sharing import classifier_name


def classifier(model: nn.Module, method: str) -> nn.Linear:
    """The model's classifier (its last `nn.Linear`); `method` names who
    asked, in the error for a model without one."""
    name = classifier_name(model)
    if name is None:
        raise ValueError(f"{method} needs a model whose classifier is an nn.Linear")
    return model.get_submodule(name)


class Representation:
    """The input of `model`'s classifier at its latest forward pass, flattened."""

    def __init__(self, model: nn.Module, method: str) -> None:
        self.model = model
        self.value: torch.Tensor | None = None
        self._hook = classifier(model, method).register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.value = args[0].flatten(1)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's representation of `inputs` (a forward pass)."""
        self.model(inputs)
        if self.value is None:
            raise RuntimeError("the model's forward pass skipped its classifier")
        return self.value

    def close(self) -> None:
        self._hook.remove()

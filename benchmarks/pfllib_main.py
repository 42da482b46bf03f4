"""PFLlib's own `main.py`, with one of pollen's catalogue models for its `-m CNN`.

    <PFLlib's python> benchmarks/pfllib_main.py MODEL C,H,W <main.py's arguments>
    (run in PFLlib's `system/` folder, with pollen's repository on PYTHONPATH)

Run by `pfllib_side_by_side.py` for a method that FedAvg's CNN cannot show:
FedBN (Li et al., ICLR 2021, https://arxiv.org/abs/2102.07623) keeps each
client's BatchNorm layers local, and PFLlib's only model with BatchNorm
for 28x28 grey images is a ResNet, days of CPU time here. PFLlib's
`main.py` runs unchanged; only the class its `-m CNN` builds for an
*MNIST data set (`FedAvgCNN`) is replaced, before `main.py` imports it, by
pollen's `MODEL` for C x H x W inputs and `main.py`'s classes, so both
frameworks train the same architecture. PFLlib's FedBN keeps local the
parameters whose name holds "bn" (`clientBN.set_parameters`); each
BatchNorm layer is therefore put under a child named `bn`, which renames
its parameters and leaves the computation as it is. Its running
statistics are buffers, which PFLlib never sends, and pollen's FedBN keeps
local too.
"""

from __future__ import annotations

import runpy
import sys

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pollen.task.models import MODELS


class NamedBatchNorm(nn.Module):
    """A BatchNorm layer under a child named `bn`: PFLlib's FedBN's mark."""

    def __init__(self, norm: _BatchNorm) -> None:
        super().__init__()
        self.bn = norm

    def forward(self, x):
        return self.bn(x)


def bn_named(model: nn.Module) -> nn.Module:
    """`model` with each BatchNorm layer in a `NamedBatchNorm`, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm):
                setattr(parent, name, NamedBatchNorm(child))
    return model


def main() -> None:
    name, shape, *arguments = sys.argv[1:]
    input_shape = tuple(int(side) for side in shape.split(","))

    def pollen_model(in_features: int, num_classes: int, dim: int) -> nn.Module:
        # FedAvgCNN's arguments as `main.py` passes them; `dim` is its own
        if in_features != input_shape[0]:
            raise ValueError(f"main.py builds for {in_features} channels, not {shape}")
        return bn_named(MODELS[name](input_shape, num_classes))

    sys.path.insert(0, ".")  # PFLlib's `system/`, the working directory
    import flcore.trainmodel.models as pfllib_models

    pfllib_models.FedAvgCNN = pollen_model  # before `main.py` imports * from it
    sys.argv = ["main.py", *arguments]
    runpy.run_path("main.py", run_name="__main__")


if __name__ == "__main__":
    main()

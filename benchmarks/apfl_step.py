"""One CPU thread's APFL step beside FedAvg's: what the personal mixture costs.

    .venv/bin/python benchmarks/apfl_step.py [--repeat 5] [--steps 200]

APFL's client steps the global model as FedAvg does and, on the same batch,
its personal model v and mixing weight alpha on the mixture's gradient
(`pollen.task.apfl.PersonalMixture.step`). Prints, per model and batch
size, the milliseconds of FedAvg's step (plain SGD) and of APFL's (that
step and the mixture's), each the median over `--repeat` measurements of
`--steps` steps in which the two alternate, and their ratio: 2 would be a
second training step's cost, anything above it the mixture's own. The
models are laid out as pollen's client lays them out on the CPU
(channels-last); one thread, as each ClientApp actor trains.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pollen.task.apfl import PersonalMixture
from pollen.task.models import build_model
from pollen.task.train import ClientOptimizer, placed

CASES = (("fedavg-cnn", (1, 28, 28), 10), ("cnn", (3, 32, 32), 32))
WARM_STEPS = 10


def stepper(name: str, shape: tuple[int, ...], apfl: bool) -> Callable[..., None]:
    """One training step of a fresh `name` on a batch, with APFL's mixture
    stepped on the same batch where `apfl`."""
    cpu = torch.device("cpu")
    model = placed(build_model(name, shape, 10, seed=0), cpu, True)
    sgd = ClientOptimizer(lr=0.005, momentum=0.0)
    optimizer = sgd.build(list(model.parameters()))
    personal = placed(build_model(name, shape, 10, seed=1), cpu, True)
    mixture = PersonalMixture(model, personal, 0.5, sgd) if apfl else None

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if mixture is not None:
            mixture.step(inputs, targets)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    return step


def timed(step: Callable[..., None], batches: list[tuple[torch.Tensor, ...]]) -> float:
    """Milliseconds a step, over `batches` after the first WARM_STEPS."""
    for batch in batches[:WARM_STEPS]:
        step(*batch)
    started = time.perf_counter()
    for batch in batches[WARM_STEPS:]:
        step(*batch)
    return (time.perf_counter() - started) / (len(batches) - WARM_STEPS) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; ms a step, median of {args.repeat}")
    print(f"{'model':12} {'batch':>5} | {'FedAvg':>7} {'APFL':>7} {'ratio':>5}")
    for name, shape, batch in CASES:
        generator = torch.Generator().manual_seed(0)
        count = WARM_STEPS + args.steps
        inputs = torch.randn(count * batch, *shape, generator=generator)
        targets = torch.randint(0, 10, (count * batch,), generator=generator)
        batches = list(zip(inputs.split(batch), targets.split(batch), strict=True))
        arms: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for apfl, times in arms.items():
                times.append(timed(stepper(name, shape, apfl), batches))
        fedavg, apfl = (statistics.median(arms[arm]) for arm in (False, True))
        print(f"{name:12} {batch:>5} | {fedavg:7.2f} {apfl:7.2f} {apfl / fedavg:5.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

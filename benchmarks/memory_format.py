"""One CPU thread's training step and evaluation of each catalogue CNN, with
its weights in PyTorch's default NCHW layout and as `placed` lays them out
on the CPU (channels-last).

    .venv/bin/python benchmarks/memory_format.py [--repeat 5] [--batch 10,32]

Prints one row per model and batch size: the milliseconds of a training
step (plain SGD on random inputs of the data set's shape, the first steps
left out) and of an evaluation of 1,000 examples in batches of 500
(pollen's `test-batch-size`), each the median over `--repeat` measurements
in which the two layouts alternate, and their ratio. One thread, as each
ClientApp actor trains (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pollen.task.models import build_model
from pollen.task.train import placed

MODELS = {  # the catalogue's models with convolutions, on their data's shape
    "fedavg-cnn": (1, 28, 28),
    "simple-cnn": (3, 32, 32),
    "cnn": (3, 32, 32),
    "cnn-gn": (3, 32, 32),
    "mobilenet": (3, 32, 32),
}
WARM_STEPS, STEPS, EVALUATED = 3, 30, 1000


def timed(
    model: torch.nn.Module, shape: tuple[int, ...], batch: int
) -> tuple[float, float]:
    """(ms a training step, ms an evaluation of EVALUATED examples)."""
    inputs = torch.randn(batch * (WARM_STEPS + STEPS), *shape)
    targets = torch.randint(0, 10, (len(inputs),))
    optimizer = torch.optim.SGD(model.parameters(), 0.01)
    model.train()
    for step, (x, y) in enumerate(
        zip(inputs.split(batch), targets.split(batch), strict=True)
    ):
        if step == WARM_STEPS:
            started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    step_ms = (time.perf_counter() - started) / STEPS * 1e3
    model.eval()
    started = time.perf_counter()
    with torch.no_grad():
        for x in torch.randn(EVALUATED, *shape).split(500):
            model(x)
    return step_ms, (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", default="10,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, 1 thread; ms, median of {args.repeat}")
    print(f"{'model':12} {'batch':>5} | {'step NCHW':>9} {'channels-last':>13} {'ratio':>5} "
          f"| {'eval NCHW':>9} {'channels-last':>13} {'ratio':>5}")  # fmt: skip
    for name, shape in MODELS.items():
        for batch in map(int, args.batch.split(",")):
            arms: dict[str, list[tuple[float, float]]] = {"nchw": [], "last": []}
            for _ in range(args.repeat):
                fresh = build_model(name, shape, 10, seed=0)
                arms["nchw"].append(timed(fresh, shape, batch))
                fresh = build_model(name, shape, 10, seed=0)
                arms["last"].append(timed(placed(fresh, cpu, True), shape, batch))
            step, evaluation = (
                {
                    arm: statistics.median(t[i] for t in runs)
                    for arm, runs in arms.items()
                }
                for i in (0, 1)
            )
            print(f"{name:12} {batch:>5} | {step['nchw']:9.2f} {step['last']:13.2f} "
                  f"{step['last'] / step['nchw']:5.2f} | {evaluation['nchw']:9.0f} "
                  f"{evaluation['last']:13.0f} "
                  f"{evaluation['last'] / evaluation['nchw']:5.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

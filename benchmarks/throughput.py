"""pollen against the compute floor and against a plain PyTorch loop, on the same work.

    .venv/bin/python benchmarks/throughput.py [--workloads fmnist-mlp ...]
        [--rounds 10] [--data-root ../shared/data]

Per workload (10 clients, all participating every round, FedAvg, IID
shards, the same seed; 1 local epoch of SGD at batch 32 with pollen's
default momentum, weight decay and gradient clip, or seed 003's Adam at
batch 1024 for 3 local epochs in `fmnist-mlp-seed003`) four arms run one
after another in this one invocation:

1. pollen: `pollen run` through Flower's Ray simulation, end to end, with
   its default of one CPU per ClientApp actor (as many clients train at
   once as there are cores, one torch thread each). Its start-up is its
   wall time less the rounds' own seconds (as the ServerApp times them); a
   round includes testing the global model on the test set.
   pollen-serial: the same with `client-resources-num-cpus` = all cores, so
   one client trains at a time on every core, as in the floor: its rounds
   less the floor's are the cost of federation itself.
2. floor: the same optimiser steps on the same shards, in one process, on
   tensors loaded before the clock starts: pollen's own partition, seeds and
   `train_local`, the clients' models averaged, nothing else (no federation,
   no messages, no evaluation).
3. plain: the loop users write first (the seeds' style): a torchvision-style
   data set that turns each sample into a PIL image and runs per-sample
   transforms, a DataLoader, a deep copy of the global model per client,
   clients one after another, state dicts averaged, the global model tested
   with a DataLoader after every round.

Each arm is a fresh process, measured by the same sampler (benchmarks/measure.py):
peak resident memory of its whole process tree. The table gives seconds per
round (mean; the first round apart, since it pays one-time warm-up), start-up
(wall time not spent in rounds), per-round overhead (pollen's round less the
floor's; negative where pollen's parallel clients beat the serial floor), the
ratios pollen/floor (rounds only, and end to end) and plain/pollen (rounds
only), and each arm's final test accuracy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from measure import PROJECT, measure, run_pollen, settings_of

# 1 local epoch of SGD at batch 32 (pollen's default momentum, weight decay
# and clip), except seed 003's own workload: Adam lr 1e-3, batch 1024, 3
# local epochs, inputs in [0, 1] unnormalised
SGD_BATCH_32 = "client-optimizer='sgd' lr=0.01 batch-size=32 local-epochs=1"
WORKLOADS = {
    "fmnist-mlp": f"data-set='fashion-mnist' model='mlp' augment=false {SGD_BATCH_32}",
    "fmnist-cnn": f"data-set='fashion-mnist' model='cnn' augment=false {SGD_BATCH_32}",
    "cifar10-cnn": f"data-set='cifar10' model='cnn' augment=true {SGD_BATCH_32}",
    "fmnist-mlp-seed003": (
        "data-set='fashion-mnist' model='mlp' augment=false normalize=false "
        "client-optimizer='adam' lr=0.001 momentum=0.0 weight-decay=0.0 "
        "batch-size=1024 local-epochs=3"
    ),
}
COMMON = "strategy='fedavg' num-clients=10 client-frac=1.0 partition='iid'"


def run_config(workload: str, rounds: int, data_root: str) -> str:
    return f"{COMMON} {WORKLOADS[workload]} rounds={rounds} data-root='{data_root}'"


def floor_arm(config: str) -> dict:
    """pollen's client computation alone: train_local per client, then average."""
    from pollen.experiments.floor import fedavg_floor

    return fedavg_floor(settings_of(config))


def plain_arm(config: str) -> dict:
    """The first loop users write: PIL images, per-sample transforms, a
    DataLoader, a deep copy of the model per client, clients in turn."""
    import numpy as np
    import torch
    from PIL import Image
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, Subset
    from torchvision import transforms

    from pollen.task.inputs import settings_model
    from pollen.task.shards import federated_data
    from pollen.task.train import ClientOptimizer

    class ImageArrays(torch.utils.data.Dataset):
        """Like torchvision's MNIST/CIFAR10 classes: uint8 arrays in memory,
        each sample made a PIL image and transformed when it is read."""

        def __init__(self, images: np.ndarray, labels: np.ndarray, transform) -> None:
            self.images, self.labels, self.transform = images, labels, transform

        def __len__(self) -> int:
            return len(self.labels)

        def __getitem__(self, i: int):
            return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])

    s = settings_of(config)
    torch.manual_seed(s.seed)
    dataset, shards = federated_data(s)
    model = settings_model(s, dataset)
    as_hwc = (lambda x: x[:, 0]) if dataset.input_shape[0] == 1 else (
        lambda x: x.permute(0, 2, 3, 1))  # fmt: skip
    normalize = [transforms.ToTensor()] + (
        [transforms.Normalize(dataset.mean, dataset.std)] if s.normalize else [])  # fmt: skip
    augment = [transforms.RandomCrop(dataset.input_shape[1], padding=4),
               transforms.RandomHorizontalFlip()]  # fmt: skip
    train_transform = transforms.Compose(
        (augment if s.augment and dataset.augmentable else []) + normalize
    )
    train = ImageArrays(as_hwc(dataset.x_train).numpy(), dataset.y_train.numpy(),
                        train_transform)  # fmt: skip
    test = ImageArrays(as_hwc(dataset.x_test).numpy(), dataset.y_test.numpy(),
                       transforms.Compose(normalize))  # fmt: skip
    seconds, accuracy = [], 0.0
    for _ in range(s.rounds):
        started = time.perf_counter()
        states, sizes = [], []
        for shard in shards:
            local = copy.deepcopy(model)
            local.train()
            opt = ClientOptimizer(s.client_optimizer, s.lr, s.momentum, s.weight_decay,
                                  s.client_betas).build(list(local.parameters()))  # fmt: skip
            loader = DataLoader(Subset(train, shard.tolist()), batch_size=s.batch_size,
                                shuffle=True)  # fmt: skip
            for _ in range(s.local_epochs):
                for xb, yb in loader:
                    opt.zero_grad()
                    F.cross_entropy(local(xb), yb).backward()
                    torch.nn.utils.clip_grad_norm_(local.parameters(), s.max_grad_norm)
                    opt.step()
            states.append(local.state_dict())
            sizes.append(len(shard))
        model.load_state_dict({
            name: sum(st[name].float() * n for st, n in zip(states, sizes, strict=True))
            .div(sum(sizes)).to(states[0][name].dtype)
            for name in states[0]
        })  # fmt: skip
        model.eval()
        correct = 0
        with torch.no_grad():
            for xb, yb in DataLoader(test, batch_size=s.test_batch_size):
                correct += int((model(xb).argmax(1) == yb).sum())
        accuracy = correct / len(test)
        seconds.append(time.perf_counter() - started)
    return {"rounds": seconds, "accuracy": accuracy}


ARMS = {"floor": floor_arm, "plain": plain_arm}


def run_arm(arm: str, config: str) -> dict:
    """One arm in a fresh process: its rounds, accuracy, wall and peak memory."""
    command = [sys.executable, __file__, "--arm", arm, "--config", config]
    wall, peak, done = measure(command)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall": wall, "start-up": wall - sum(result["rounds"]),
            "peak-rss": peak}  # fmt: skip


def warm_data_cache(config: str) -> None:
    """Decode the data set once, so that no arm pays for the first decode."""
    from pollen.task.shards import federated_data

    federated_data(settings_of(config))


def later_mean(rounds: list[float]) -> float:
    """Mean seconds of the rounds after the first (the first if only one)."""
    later = rounds[1:] or rounds
    return sum(later) / len(later)


def row(workload: str, arm: str, r: dict, pollen: dict, floor: dict) -> str:
    rounds, mean = r["rounds"], later_mean(r["rounds"])
    if arm.startswith("pollen"):
        versus = (
            f"{sum(rounds) / sum(floor['rounds']):.2f}x floor "
            f"({r['wall'] / floor['wall']:.2f}x end to end)"
        )
        overhead = f"{mean - later_mean(floor['rounds']):.2f}"
    elif arm == "plain":
        versus = f"{sum(rounds) / sum(pollen['rounds']):.1f}x pollen"
        overhead = "-"
    else:
        versus, overhead = "1", "-"
    return (
        f"| {workload} | {arm} | {r['wall']:.1f} | {r['start-up']:.1f} | "
        f"{rounds[0]:.2f} | {mean:.2f} | {overhead} | {versus} | "
        f"{r['peak-rss'] / 2**30:.2f} | {100 * r['accuracy']:.2f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                        default=["fmnist-mlp", "fmnist-cnn"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-root", default=str(PROJECT.parent / "shared" / "data"))
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:  # a child process: one arm, its result as the last line
        print(json.dumps(ARMS[args.arm](args.config)))
        return
    print(
        "| workload | arm | wall s | start-up s | round 1 s | later rounds s | "
        "overhead s/round | rounds time | peak RSS GiB | accuracy |\n"
        "|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for workload in args.workloads:
        config = run_config(workload, args.rounds, args.data_root)
        warm_data_cache(config)
        with tempfile.TemporaryDirectory() as out:
            pollen = run_pollen([config], Path(out), "run")
            serial = run_pollen([config], Path(out), "serial", federation=(
                f"client-resources-num-cpus={os.cpu_count()}",))  # fmt: skip
        floor = run_arm("floor", config)
        plain = run_arm("plain", config)
        arms = {"floor": floor, "pollen": pollen, "pollen-serial": serial,
                "plain": plain}  # fmt: skip
        for arm, result in arms.items():
            print(row(workload, arm, result, pollen, floor), flush=True)


if __name__ == "__main__":
    main()

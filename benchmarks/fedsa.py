"""FedSA-FTL measured on this machine: bytes per round, cached features, the
accuracy cost of DP-SGD, and personalised B matrices.

    .venv/bin/python benchmarks/fedsa.py bytes    [--data-root D] [--out DIR]
    .venv/bin/python benchmarks/fedsa.py cache    [--data-root D]
    .venv/bin/python benchmarks/fedsa.py dp       [--data-root D] [--out DIR]
    .venv/bin/python benchmarks/fedsa.py personal [--data-root D] [--out DIR]

`bytes`: one round of vgg16-lora on CIFAR-10 (random backbone: ImageNet
weights cannot be downloaded here) with sharing lora-a (fedsa), lora (A and
B) and all (the whole trained head); bytes up/down per round are read from
each run's history.json, i.e. from the records actually sent. Beside them,
the byte size of every entry of vgg16-lora and of torchvision's complete
VGG16 (what a full-model FedAvg would send per client and direction).

`cache`: local training of vgg16-lora on 1,000 real CIFAR-10 images for
2 rounds of 2 epochs, side by side in one process: images through the
frozen backbone at every step, against features computed once.

`dp`: cnn-gn on real MNIST, 10 IID clients, half per round, 5 rounds,
without DP and with DP-SGD at epsilon 10 and 3 (delta 1e-5, C = 1).

`personal`: cnn-lora on real Fashion-MNIST, 10 Dirichlet(0.3) clients,
half per round, 10 rounds: sharing lora-a (each client keeps its B),
lora (B averaged too) and all (plain FedAvg of the whole model). Reports
the clients' own models on their own test shards and on the whole test set.

Runs go through `pollen run`; their directories under --out are kept and
read back on a second call, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import run

from pollen.task.data import load_dataset
from pollen.task.models import build_model
from pollen.task.train import (
    ClientOptimizer,
    Preprocess,
    backbone_features,
    no_preprocess,
    train_local,
)

VGG = (
    "data-set='cifar10' model='vgg16-lora' backbone-weights='random' augment=false "
    "num-clients=10 client-frac=0.3 rounds=1 local-epochs=1 batch-size=32"
)


def mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def measure_bytes(out: Path, data_root: str) -> None:
    from flwr.app import ArrayRecord

    print(
        "| sharing | entries sent | up per round | down per round | per client, each way |"
    )
    print("|---|---|---|---|---|")
    for sharing in ("lora-a", "lora", "all"):
        strategy = "fedsa" if sharing == "lora-a" else "fedavg"
        result = run(out, f"bytes-{sharing}", VGG,
                     f"strategy='{strategy}' sharing='{sharing}' data-root='{data_root}'")  # fmt: skip
        row = result["history"][0]
        clients = len(row["clients"])
        entries = {"lora-a": "A", "lora": "A, B", "all": "A, B, W0, bias"}[sharing]
        print(f"| {sharing} | {entries} | {mb(row['bytes-up'])} | "
              f"{mb(row['bytes-down'])} | {mb(row['bytes-up'] / clients)} |")  # fmt: skip
    model = build_model("vgg16-lora", (3, 32, 32), 10, 0)
    whole = ArrayRecord(model.state_dict()).count_bytes()
    print(f"\nvgg16-lora, every entry (backbone included): {mb(whole)} per client "
          "and direction")  # fmt: skip
    from torchvision.models import vgg16

    full = vgg16(num_classes=10)
    params = sum(p.numel() for p in full.parameters())
    print(f"torchvision VGG16 (4096-wide classifier, 10 classes): {params:,} "
          f"parameters = {mb(4 * params)} per client and direction")  # fmt: skip


def measure_cache(data_root: str) -> None:
    torch.manual_seed(0)
    data = load_dataset("cifar10", data_root, download=False)
    x, y = data.x_train[:1000], data.y_train[:1000]
    prep = Preprocess(data.mean, data.std)
    rounds, epochs = 2, 2
    times: dict[str, list[float]] = {"images": [], "features": []}
    for mode in times:
        model = build_model("vgg16-lora", (3, 32, 32), 10, 0)
        inputs, transform = x, prep
        for r in range(rounds):
            start = time.perf_counter()
            if mode == "features" and r == 0:
                inputs = backbone_features(model, x, prep, batch_size=250)
                transform = no_preprocess
            train_local(model, inputs, y, epochs=epochs, batch_size=32,
                        optimizer=ClientOptimizer("sgd", 0.05), preprocess=transform,
                        seed=r)  # fmt: skip
            times[mode].append(time.perf_counter() - start)
    print(f"vgg16-lora, 1,000 CIFAR-10 images, {epochs} local epochs per round, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(
        "| round | images through the backbone (s) | cached features (s) | speed-up |"
    )
    print("|---|---|---|---|")
    for r in range(rounds):
        a, b = times["images"][r], times["features"][r]
        note = " (features computed)" if r == 0 else ""
        print(f"| {r + 1} | {a:.1f} | {b:.1f}{note} | {a / b:.1f}x |")
    a, b = sum(times["images"]), sum(times["features"])
    print(f"| total | {a:.1f} | {b:.1f} | {a / b:.1f}x |")


def measure_dp(out: Path, data_root: str) -> None:
    base = (
        f"data-set='mnist' data-root='{data_root}' model='cnn-gn' num-clients=10 "
        "client-frac=0.5 rounds=5 local-epochs=1 batch-size=64 lr=0.05 "
        "weight-decay=0.0 lr-patience=1000"
    )
    print(
        "| training | final accuracy | best accuracy | largest client epsilon | seconds |"
    )
    print("|---|---|---|---|---|")
    for name, extra in (("no DP", ""), ("DP-SGD eps 10", "dp=true dp-epsilon=10"),
                        ("DP-SGD eps 3", "dp=true dp-epsilon=3")):  # fmt: skip
        tag = name.lower().replace(" ", "-").replace("-sgd", "")
        s = run(out, f"dp-{tag}", base, extra)["summary"]
        eps = s["final-dp-epsilon"]
        print(f"| {name} | {100 * s['final-accuracy']:.2f}% | "
              f"{100 * s['best-accuracy']:.2f}% | {(eps and f'{eps:.2f}') or '-'} | "
              f"{s['total-seconds']:.0f} |")  # fmt: skip


def measure_personal(out: Path, data_root: str) -> None:
    base = (
        f"data-set='fashion-mnist' data-root='{data_root}' model='cnn-lora' "
        "num-clients=10 client-frac=0.5 partition='niid' alpha=0.3 rounds=10 "
        "local-epochs=1 batch-size=64 lr=0.05 lora-rank=8 lr-patience=1000"
    )
    print("| sharing | clients' own models, own test shard | clients' own models, "
          "whole test set | global model | up per round |")  # fmt: skip
    print("|---|---|---|---|---|")
    for sharing in ("lora-a", "lora", "all"):
        strategy = "fedsa" if sharing == "lora-a" else "fedavg"
        result = run(out, f"personal-{sharing}", base,
                     f"strategy='{strategy}' sharing='{sharing}'")  # fmt: skip
        last = result["history"][-1]
        summary = result["summary"]
        personal = summary["final-personal"]
        own = glob = "-"
        if personal:
            own = "{:.2f}% [{:.2f}, {:.2f}]".format(
                *(100 * v for v in personal["local"])
            )
            glob = "{:.2f}% [{:.2f}, {:.2f}]".format(
                *(100 * v for v in personal["global"])
            )
        print(f"| {sharing} | {own} | {glob} | {100 * last['accuracy']:.2f}% | "
              f"{mb(last['bytes-up'])} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("bytes", "cache", "dp", "personal"))
    parser.add_argument("--data-root", default=str(Path("../shared/data").resolve()))
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args()
    out = args.out.resolve()
    if args.what == "bytes":
        measure_bytes(out, args.data_root)
    elif args.what == "cache":
        measure_cache(args.data_root)
    elif args.what == "dp":
        measure_dp(out, args.data_root)
    else:
        measure_personal(out, args.data_root)


if __name__ == "__main__":
    main()

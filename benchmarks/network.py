"""Strategies compared over a real, shaped network: a `pollen compare --network`.

    .venv/bin/python benchmarks/network.py [--nodes 3] [--rounds 4]
        [--shape "delay=50ms,up=10mbit,down=50mbit" | --network mixed]
        [--only fedavg feddyn ...] [--train 9000]
        [--data-root ../shared/data] [--out bench-out/network]

A thin caller of the product command: it writes a grid (FedAvg, FedDyn,
FedAdam, FedBN and FedSA on the same data, partition and seed) and a network
profile (every node behind the link `--shape` describes, or the profile or
preset `--network` names), then runs `pollen compare GRID --out OUT --network
PROFILE`, which deploys each strategy over namespaced, shaped links (TLS,
node authentication, warm executor), records the bytes on the wire per node
and direction in each cell's `network.json`, tears everything down after
each cell and resumes where a rerun with the same --out left off. Its table
(with "link MB", the interfaces' count) and plots are in OUT.

Data: a Fashion-MNIST subset (the first `--train` training and 2,000 test
images, written under --out) split over the nodes by Dirichlet(0.5), model
`cnn`, one local epoch per round, every node in every round. `fedsa` uses
`cnn-lora` (only its LoRA A matrices travel).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from pollen.common.links import LinkShape  # noqa: E402

STRATEGIES = {  # cell name -> the keys it sets
    "fedavg": {"strategy": "fedavg", "model": "cnn"},
    "feddyn": {"strategy": "feddyn", "model": "cnn"},
    "fedadam": {"strategy": "fedadam", "server-lr": 0.003, "model": "cnn"},
    "fedbn": {"strategy": "fedavg", "bn-policy": "fedbn", "model": "cnn"},
    "fedsa": {"strategy": "fedsa", "model": "cnn-lora"},
}
COMMON = {
    "data-set": "fashion-mnist", "download": False, "partition": "niid",
    "alpha": 0.5, "client-frac": 1.0, "local-epochs": 1, "batch-size": 32,
    "lr": 0.05, "seed": 845,
}  # fmt: skip


def subset(source: Path, target: Path, train: int) -> Path:
    """The first `train` training and 2,000 test images of Fashion-MNIST."""
    target.mkdir(parents=True, exist_ok=True)
    path = target / "fashion_mnist.npz"
    if not path.exists():
        with np.load(source / "fashion_mnist.npz") as full:
            np.savez(
                path,
                x_train=full["x_train"][:train], y_train=full["y_train"][:train],
                x_test=full["x_test"][:2000], y_test=full["y_test"][:2000],
            )  # fmt: skip
    return target


def toml_table(values: dict) -> str:
    """`key = value` lines (JSON scalars are TOML scalars)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


def grid_text(base: dict) -> str:
    """One cell per strategy, named after it."""
    cells = ", ".join(
        "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in
                        {"name": name, **keys}.items()) + "}"
        for name, keys in STRATEGIES.items()
    )  # fmt: skip
    return f"[base]\n{toml_table(base)}\n[grid]\nstrategy = [{cells}]\n"


def profile_text(shape: LinkShape) -> str:
    """A profile giving every node the link `shape`."""
    return f'description = "every node: {shape}"\n\n[default]\n' + toml_table({
        "delay-ms": shape.delay_ms, "jitter-ms": shape.jitter_ms,
        "up-mbit": shape.up_mbit, "down-mbit": shape.down_mbit,
        "loss-pct": shape.loss_pct,
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--shape", default="delay=50ms,up=10mbit,down=50mbit")
    parser.add_argument(
        "--network", default=None,
        help="a profile file or preset (configs/networks/) instead of --shape",
    )  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=list(STRATEGIES))
    parser.add_argument("--train", type=int, default=9000)
    parser.add_argument("--data-root", default=str(PROJECT.parent / "shared" / "data"))
    parser.add_argument("--out", default="bench-out/network", type=Path)
    args = parser.parse_args()
    out = args.out.resolve()
    data = subset(Path(args.data_root), out / "data", args.train)
    base = {**COMMON, "data-root": str(data), "rounds": args.rounds,
            "num-clients": args.nodes}  # fmt: skip
    (out / "grid.in.toml").write_text(grid_text(base))
    network = args.network
    if network is None:
        network = str(out / "profile.toml")
        Path(network).write_text(profile_text(LinkShape.parse(args.shape)))
    command = [
        str(Path(sys.executable).parent / "pollen"), "compare",
        str(out / "grid.in.toml"), str(PROJECT), "--out", str(out / "compare"),
        "--network", network,
    ]  # fmt: skip
    for name in args.only or ():
        command += ["--only", f"strategy={name}"]
    sys.exit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()

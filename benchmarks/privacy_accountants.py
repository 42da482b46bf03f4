"""Epsilon under each accountant for pollen's DP settings, and the noise
each needs for the same budget.

    .venv/bin/python benchmarks/privacy_accountants.py [--write]

Each row is one of the DP configurations pollen documents: the private
FedSA preset (`configs/fedsa-cifar100-dp.toml`), the DP-SGD runs of
`benchmarks/fedsa.py dp` and the central-DP table of docs/results.md. For
each, the noise multiplier z that RDP calibrates for the target epsilon
(what pollen ran), that z's epsilon under RDP, PRV and PLD, and the z that
PLD would calibrate for the same target (the noise a tighter accountant
saves). DP-SGD's releases are one client's steps over the whole planned
run (sample rate q = batch / shard size, every round x local epochs x 1/q
steps), as `pollen.task.privacy` counts them; central DP's are one
Gaussian per round without sampling. `--write` refreshes
benchmarks/measured/privacy-accountants.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from pollen.common.accountants import epsilons, noise_multiplier

DELTA = 1e-5
MEASURED = Path(__file__).resolve().parent / "measured" / "privacy-accountants.json"


@dataclass(frozen=True)
class Releases:
    """`steps` Gaussian releases at sample rate `q`, budgeted at `epsilon`."""

    name: str
    epsilon: float
    q: float
    steps: int


def dp_sgd(name: str, epsilon: float, shard: int, batch: int, epochs: int,
           rounds: int) -> Releases:  # fmt: skip
    q = min(1.0, batch / shard)
    return Releases(name, epsilon, q, rounds * epochs * max(1, round(1 / q)))


SETTINGS = [
    # configs/fedsa-cifar100-dp.toml: 5,000 examples a client (10 clients)
    dp_sgd(
        "DP-SGD, fedsa-cifar100-dp preset (shard 5,000, batch 64, 5 epochs, "
        "100 rounds)",
        10.0,
        5000,
        64,
        5,
        100,
    ),
    # benchmarks/fedsa.py dp: MNIST, 10 IID clients (6,000 each), batch 32
    dp_sgd(
        "DP-SGD, MNIST cnn-gn (shard 6,000, batch 32, 1 epoch, 5 rounds)",
        10.0,
        6000,
        32,
        1,
        5,
    ),
    dp_sgd(
        "DP-SGD, MNIST cnn-gn (shard 6,000, batch 32, 1 epoch, 5 rounds)",
        3.0,
        6000,
        32,
        1,
        5,
    ),
    # docs/results.md, central DP on MNIST: 10 rounds, no sampling amplification
    *(Releases("central DP, MNIST (10 rounds)", e, 1.0, 10) for e in (1.0, 3.0, 8.0)),
]


def row(setting: Releases) -> list[str]:
    z = noise_multiplier("rdp", epsilon=setting.epsilon, delta=DELTA,
                         sample_rate=setting.q, steps=setting.steps)  # fmt: skip
    spent = epsilons(noise_multiplier=z, sample_rate=setting.q, steps=setting.steps,
                     delta=DELTA)  # fmt: skip
    tight = noise_multiplier("pld", epsilon=setting.epsilon, delta=DELTA,
                             sample_rate=setting.q, steps=setting.steps)  # fmt: skip
    return [
        setting.name, f"{setting.epsilon:g}", f"{setting.q:.4g}", f"{setting.steps:,}",
        f"{z:.3f}", *(f"{spent[name]:.2f}" for name in ("rdp", "prv", "pld")),
        f"{tight:.3f} ({100 * (1 - tight / z):.1f} % less)",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="refresh the measured table"
    )
    args = parser.parse_args()
    started = time.monotonic()
    rows = [row(setting) for setting in SETTINGS]
    columns = ["setting", "target epsilon", "q", "releases", "z (RDP's)",
               "epsilon RDP", "epsilon PRV", "epsilon PLD", "z (PLD's)"]  # fmt: skip
    for line in [columns, *rows]:
        print(" | ".join(line))
    print(f"{time.monotonic() - started:.0f} s")
    if args.write:
        table = {
            "title": "Privacy accountants: epsilon for the same noise",
            "kind": "privacy",
            "setting": "Each of pollen's documented DP settings at delta 1e-5: the "
            "noise multiplier z that RDP calibrates for the target epsilon, that "
            "z's epsilon under RDP (Opacus), PRV (Opacus) and PLD (dp-accounting), "
            "and the z that PLD calibrates for the same target.",
            "columns": columns,
            "rows": rows,
            "machine": f"{platform.machine()}, {platform.system()}",
            "date": date.today().isoformat(),
            "command": ".venv/bin/python benchmarks/privacy_accountants.py --write",
            "order": 1,
        }
        MEASURED.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""`pollen audit` against every defence pollen offers, on MNIST and CIFAR-10.

    .venv/bin/python benchmarks/privacy_audit.py [--data-root D] [--out DIR] [--write]

One client (the first sampled in round 1 of 10 clients, 2 a round, seed 0)
and one round throughout; `cnn-gn` (GroupNorm: the model DP-SGD needs),
plain SGD lr 0.1 without momentum or weight decay, no augmentation, one
local epoch of batch 32 on the client's first example(s). Each defence
changes only what it must. Attack: Inverting Gradients, 2,000 Adam steps,
one start; FedSA's A matrices carry no output layer for IG's labels, so
that cell runs DLG (best of 8 starts: its L-BFGS often stops within
seconds), on 2 examples (cnn-lora has BatchNorm, which skips a
batch of one) for 2 local steps (in a client's first step B is zero, so A
does not move: one step would send zeros). Each cell runs `pollen audit` in this process; its
folder under --out holds audit.json and audit.png, and a cell whose folder
holds audit.json is read back, not rerun (an interrupted run resumes).
`--write` refreshes benchmarks/measured/privacy-audit.json and the two
pictures in docs/images/ (every cell's audit.png side by side: the
client's examples above their reconstructions).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pollen.audit.run import AuditRequest, run_audit

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured" / "privacy-audit.json"
PICTURES = ROOT / "docs" / "images"
DATA_SETS = {"mnist": "MNIST", "cifar10": "CIFAR-10"}
BASE = (
    "model='cnn-gn' momentum=0.0 weight-decay=0.0 augment=false num-clients=10 "
    "client-frac=0.2 lr=0.1 local-epochs=1 batch-size=32 rounds=10 seed=0 "
    "device='cpu'"
)
# name: (what the row says, run-config overrides, attack, examples)
CELLS = {
    "none": ("none: the client's update, 1 example, 1 step", "", "ig", 1),
    "dp-sgd-100": ("DP-SGD, epsilon 100 over 10 rounds", "dp=true dp-epsilon=100.0",
                   "ig", 1),
    "dp-sgd-8": ("DP-SGD, epsilon 8 over 10 rounds", "dp=true dp-epsilon=8.0", "ig",
                 1),
    "central-server": ("central DP, clipped and noised by the server",
                       "central-dp='fixed' central-clip-norm=0.1", "ig", 1),
    "central-client": ("central DP, clipped by the client (C = 0.1)",
                       "central-dp='fixed' central-clip-on='client' "
                       "central-clip-norm=0.1", "ig", 1),
    "fedsa": ("FedSA: LoRA A matrices only (cnn-lora, 2 examples, 2 steps), DLG, "
              "best of 8 starts",
              "strategy='fedsa' model='cnn-lora' lora-dropout=0.0 local-epochs=2",
              "dlg", 2),
    "secagg": ("SecAgg+: the sum of the round's 3 clients",
               "secure-aggregation='secagg+' client-frac=0.3", "ig", 1),
    "steps-5": ("5 local steps (5 epochs of 1 example)", "local-epochs=5", "ig", 1),
    "batch-8": ("a batch of 8 examples, 1 step", "batch-size=8", "ig", 8),
    "batch-2x4": ("8 examples in 4 steps of 2", "batch-size=2", "ig", 8),
}  # fmt: skip


def run_cell(data_set: str, name: str, data_root: str, out: Path) -> dict:
    folder = out / f"{data_set}-{name}"
    if (folder / "audit.json").is_file():
        return json.loads((folder / "audit.json").read_text())
    _, overrides, attack, examples = CELLS[name]
    config = [f"{BASE} data-set='{data_set}' data-root='{data_root}'", overrides]
    restarts = 8 if attack == "dlg" else 1  # L-BFGS often stops at once: cheap
    request = AuditRequest(attack=attack, examples=examples, restarts=restarts,
                           out=folder)  # fmt: skip
    run_audit(ROOT, config, request)
    return json.loads((folder / "audit.json").read_text())


def picture(data_set: str, out: Path, path: Path) -> None:
    """Each cell's first original above its reconstruction, a column each."""
    figure = Figure(figsize=(1.5 * len(CELLS), 3.6))
    axes = figure.subplots(2, len(CELLS), squeeze=False)
    for column, name in enumerate(CELLS):
        image = np.asarray(_image(out / f"{data_set}-{name}" / "audit.png"))
        halves = np.array_split(image, 2, axis=0)
        for row, half in enumerate(halves):
            axes[row][column].imshow(half)
            axes[row][column].axis("off")
        axes[0][column].set_title(name, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)


def _image(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    return imread(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/pollen-privacy-audit"))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows, psnr = [], {}
    for data_set, title in DATA_SETS.items():
        for name, (what, *_) in CELLS.items():
            started = time.monotonic()
            report = run_cell(data_set, name, args.data_root, args.out)
            scores = report["images"]
            row = [
                title, what,
                f"{np.mean([m['psnr'] for m in scores]):.1f}",
                f"{np.mean([m['ssim'] for m in scores]):.2f}",
                f"{report['seconds-per-image']:.1f}",
            ]  # fmt: skip
            print(" | ".join(row), f"({time.monotonic() - started:.0f} s)", flush=True)
            rows.append(row)
            psnr[data_set, name] = row[2]
    if args.write:
        for data_set in DATA_SETS:
            picture(data_set, args.out, PICTURES / f"audit-{data_set}.png")
        table = {
            "title": "Gradient inversion against each defence",
            "kind": "privacy",
            "setting": "pollen audit, Inverting Gradients (DLG for FedSA) on the "
            "update the server receives from one client in round 1: cnn-gn, plain "
            "SGD lr 0.1, one local epoch of batch 32 on the client's first "
            "example(s), 10 clients, 2 a round, seed 0; PSNR and SSIM against the "
            "client's own images (higher: more leaked), mean over its examples.",
            "columns": [
                "data set",
                "what the server receives",
                "PSNR (dB)",
                "SSIM",
                "s per image",
            ],
            "rows": rows,
            "machine": f"{platform.machine()}, {platform.system()}, 1 thread",
            "date": date.today().isoformat(),
            "command": ".venv/bin/python benchmarks/privacy_audit.py --write",
            "notes": [
                "Pictures: docs/images/audit-mnist.png and "
                "docs/images/audit-cifar10.png (every cell's examples above "
                "their reconstructions)."
            ],
            "more": "privacy.md#what-each-defence-keeps-from-the-server",
            "readme": [
                "Gradient inversion: what a curious server rebuilds",
                f"MNIST, PSNR: no defence {psnr['mnist', 'none']} dB, DP-SGD "
                f"{psnr['mnist', 'dp-sgd-8']} dB, SecAgg+ of 3 "
                f"{psnr['mnist', 'secagg']} dB",
            ],
            "order": 2,
        }
        MEASURED.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()

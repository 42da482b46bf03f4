"""Do two checkouts compute the same runs? Histories side by side, bit for bit.

    .venv/bin/python benchmarks/same_histories.py --against DIR [-c "key=value"]

Runs each algorithm below in this checkout and in DIR (another checkout,
e.g. `git worktree add DIR <commit>`, run with this one's environment) with
the same settings and seed, and compares their `history.json` rows exactly,
every column except `seconds` (wall time). A refactoring that changes no
behaviour shows `identical` for every row but DP-SGD: its noise and Poisson
sampling draw from operating-system entropy by design (see
`pollen.task.privacy`), so for it only the columns the seed decides
(rounds, clients, bytes, learning rate, epsilon spent) are compared.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from measure import run_pollen, side_by_side

COMMON = "rounds=3 num-clients=4 client-frac=0.5 partition='niid'"
RUNS = {
    "FedAvg": "strategy='fedavg' model='mlp'",
    "FedDyn": "strategy='feddyn' model='mlp-bn'",
    "FedAdam": "strategy='fedadam' model='mlp-bn'",
    "FedBN + Yogi": "strategy='fedyogi' bn-policy='fedbn' model='mlp-bn'",
    "FedSAM": "strategy='fedsam' model='mlp-bn'",
    "FedProx": "strategy='fedprox' model='mlp'",
    "DP-SGD": "strategy='fedavg' model='cnn-gn' dp=true dp-epsilon=4",
    "FedSA": "strategy='fedsa' model='cnn-lora'",
}
SEEDED = ("round", "lr", "clients", "bytes-up", "bytes-down", "dp-epsilon")


def comparable(path: Path, private: bool) -> list[dict]:
    """The history's rows without wall time (only the seeded columns under DP)."""
    rows = json.loads(path.read_text())
    if private:
        return [{k: row.get(k) for k in SEEDED} for row in rows]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def main() -> None:
    args, trees = side_by_side(__doc__.split("\n")[0])
    if "against" not in trees:
        raise SystemExit("--against DIR is required: the checkout to compare with")
    print("| algorithm | config | history.json (less seconds) |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, config in RUNS.items():
            histories = []
            for tree_label, tree in trees.items():
                name = f"{tree_label}-{label.replace(' ', '')}"
                run_pollen([COMMON, config, *args.run_config], Path(tmp), name, tree)
                path = Path(tmp) / name / "history.json"
                histories.append(comparable(path, "dp=true" in config))
            same = histories[0] == histories[1]
            what = "seeded columns " if "dp=true" in config else ""
            verdict = f"{what}identical" if same else f"{what}DIFFERENT"
            print(f"| {label} | `{config}` | {verdict} |", flush=True)


if __name__ == "__main__":
    main()

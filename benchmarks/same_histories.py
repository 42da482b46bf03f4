"""Do two checkouts compute the same runs? Histories side by side, bit for bit.

    .venv/bin/python benchmarks/same_histories.py --against DIR [-c "key=value"]

Runs each configuration below (every strategy preset, aggregator, local
objective and sharing policy, an attack on three aggregators, central DP
clipped on the client, DP-SGD) in this checkout and in DIR (another checkout,
e.g. `git worktree add DIR <commit>`, run with this one's environment) with
the same settings and seed, and compares their `history.json` rows exactly,
every column except wall times (`seconds`, and SecAgg+'s `secagg-*-seconds`
inside `aggregation`). A refactoring that changes no
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
# Robust aggregators need more replies a round than 2 (Krum: n >= 2f + 3,
# Bulyan: n >= 4f + 3), so their runs sample 7 of 8 clients
EIGHT = "num-clients=8 client-frac=0.875"
RUNS = {
    # every strategy preset
    "FedAvg": "strategy='fedavg' model='mlp'",
    "FedAvgM": "strategy='fedavgm' model='mlp'",
    "FedProx": "strategy='fedprox' model='mlp'",
    "FedSAM": "strategy='fedsam' model='mlp-bn'",
    "SCAFFOLD": "strategy='scaffold' model='mlp'",
    "FedDyn": "strategy='feddyn' model='mlp-bn'",
    "FedAdagrad": "strategy='fedadagrad' model='mlp'",
    "FedAdam": "strategy='fedadam' model='mlp-bn'",
    "FedYogi": "strategy='fedyogi' model='mlp'",
    "FedSA": "strategy='fedsa' model='cnn-lora'",
    "FedPer": "strategy='fedper' model='mlp'",
    "Ditto": "strategy='ditto' model='mlp'",
    "FedRep": "strategy='fedrep' model='mlp'",
    # one client in flight: with more, arrival order (so the history) is timing's
    "FedBuff": "strategy='fedbuff' model='mlp' concurrency=1 buffer-size=1",
    # sharing policies beyond the presets'
    "FedBN + Yogi": "strategy='fedyogi' bn-policy='fedbn' model='mlp-bn'",
    "SiloBN + Adam": "strategy='fedadam' bn-policy='silobn' model='mlp-bn'",
    # every aggregator beside the mean
    "median": f"{EIGHT} aggregator='median' model='mlp'",
    "trimmed mean": f"{EIGHT} aggregator='trimmed-mean' model='mlp'",
    "Krum": f"{EIGHT} aggregator='krum' byzantine-clients=1 model='mlp'",
    "multi-Krum": f"{EIGHT} aggregator='multi-krum' byzantine-clients=1 model='mlp'",
    "Bulyan": f"{EIGHT} aggregator='bulyan' byzantine-clients=1 model='mlp'",
    "FedNova": "aggregator='fednova' local-objective='prox' model='mlp'",
    # every local objective beside the presets'
    "FedDyn + SAM": "strategy='feddyn' local-objective='feddyn-sam' model='mlp'",
    "FedProx + SAM": "local-objective='prox-sam' model='mlp'",
    "SCAFFOLD + SAM": "strategy='scaffold' local-objective='scaffold-sam' model='mlp'",
    # what wraps training: attacks, central DP (clipped on the client too)
    "sign-flip on Krum": f"{EIGHT} aggregator='krum' byzantine-clients=1 "
    "attack='sign-flip' attackers=0.25 model='mlp'",
    "label-flip": "attack='label-flip' attacker-clients='1' model='mlp'",
    "noise on median": f"{EIGHT} aggregator='median' attack='noise' "
    "attacker-clients='0,3' model='mlp'",
    # the server's noise draws from OS entropy: at z = 1e-30 it moves no bit,
    # so the clipping (on the client, then on the server) is compared exactly
    "central DP, clipped on clients": "central-dp='fixed' central-clip-on='client' "
    "central-clip-norm=0.05 central-noise-multiplier=1e-30 model='mlp'",
    "DP-SGD": "strategy='fedavg' model='cnn-gn' dp=true dp-epsilon=4",
    # how a round runs: vectorised cohorts, SecAgg+ (its masks cancel exactly)
    "cohort": "strategy='fedprox' model='mlp' client-execution='cohort'",
    "SecAgg+": "strategy='fedadam' model='mlp' secure-aggregation='secagg+' "
    "num-clients=6",
}
SEEDED = ("round", "lr", "clients", "bytes-up", "bytes-down", "dp-epsilon")


def comparable(path: Path, private: bool) -> list[dict]:
    """The history's rows without wall time (only the seeded columns under DP)."""
    rows = json.loads(path.read_text())
    if private:
        return [{k: row.get(k) for k in SEEDED} for row in rows]
    return [_without_wall_times(row) for row in rows]


def run_histories(out: Path) -> dict[str, list[dict]]:
    """Every run's history in a comparison's `out` (`out/runs/<cell>`), by
    cell, less the wall times (`comparable`)."""
    return {
        run.name: comparable(run / "history.json", private=False)
        for run in sorted((out / "runs").iterdir())
    }


def _without_wall_times(row: dict) -> dict:
    """`row` less its wall times (keys ending in "seconds"), nested ones too."""
    return {
        k: _without_wall_times(v) if isinstance(v, dict) else v
        for k, v in row.items()
        if not k.endswith("seconds")
    }


def main() -> None:
    args, trees = side_by_side(__doc__.split("\n")[0])
    if "against" not in trees:
        raise SystemExit("--against DIR is required: the checkout to compare with")
    print("| algorithm | config | history.json (less seconds) |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, config in RUNS.items():
            histories = []
            for index, tree in enumerate(trees.values()):
                # paths of one length in both trees: SecAgg+'s bytes count the
                # whole message, whose config holds the run's output path
                out, name = Path(tmp) / f"tree-{index}", label.replace(" ", "")
                run_pollen([COMMON, config, *args.run_config], out, name, tree)
                path = out / name / "history.json"
                histories.append(comparable(path, "dp=true" in config))
            same = histories[0] == histories[1]
            what = "seeded columns " if "dp=true" in config else ""
            verdict = f"{what}identical" if same else f"{what}DIFFERENT"
            print(f"| {label} | `{config}` | {verdict} |", flush=True)


if __name__ == "__main__":
    main()

"""Deployed rounds on two Flower releases, alternated in one invocation: the
locked one (`.venv`, `make`) and the next (`.venv-flower-next`, `make
test-flower-next`).

    .venv/bin/python benchmarks/flower_releases.py [--turns 2] [--rounds 10]
        [--workload mnist-mlp-2] [--data-root ../shared/data]
        [--out bench-out/flower-releases]

Each turn runs `benchmarks/deployed_rounds.py` once per environment (A B A
B ...: this machine's speed drifts over minutes), with its interpreter, so
that every process of the deployment (SuperLink, `pollen supernode`, the
warm executors, the ServerApp) runs that environment's Flower: the workload
simulated, then deployed with `pollen supernode` (pollen's patches applied
where the release is verified, `pollen.flower_patches`). A release whose
patches are left out says so in its deployment's logs and is slower by
Flower's waits: the table shows it as the ratio to the other release.

Prints, and writes to `<out>/flower-releases.md`, per release and turn: the
Flower version, the mean deployed round (rounds 2..R), the mean simulated
round, their ratio, and the deployed round against the first environment's
in the same turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
ENVIRONMENTS = (PROJECT / ".venv", PROJECT / ".venv-flower-next")


def flower_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import flwr; print(flwr.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


def one_turn(python: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """deployed_rounds.py under `python`: its mean simulated and deployed rounds."""
    command = [
        str(python), str(PROJECT / "benchmarks" / "deployed_rounds.py"),
        "--workloads", args.workload, "--ways", "pollen", "--rounds", str(args.rounds),
        "--data-root", str(args.data_root), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "deployed-rounds.json").read_text())
    simulated = results[f"{args.workload}/simulated"]["rounds"][1:]
    deployed = results[f"{args.workload}/pollen supernode"]["rounds"][1:]
    return {
        "simulated": statistics.mean(simulated),
        "deployed": statistics.mean(deployed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workload", default="mnist-mlp-2",
                        choices=["mnist-mlp-2", "mnist-mlp-8", "fmnist-cnn-4"])  # fmt: skip
    parser.add_argument(
        "--data-root", type=Path, default=PROJECT.parent / "shared" / "data"
    )
    parser.add_argument(
        "--out", type=Path, default=PROJECT / "bench-out" / "flower-releases"
    )
    args = parser.parse_args()
    if args.turns < 1:
        parser.error("--turns: at least 1")
    pythons = [env / "bin" / "python" for env in ENVIRONMENTS]
    missing = [str(p) for p in pythons if not p.exists()]
    if missing:
        parser.error(
            f"no environment at {', '.join(missing)}: run `make test-flower-next`"
        )
    versions = [flower_version(python) for python in pythons]
    lines = [
        "| Flower | turn | deployed round 2.. (s) | simulated round (s) | deployed / simulated | deployed / first release's |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    out = args.out.resolve()
    for turn in range(1, args.turns + 1):
        first = None
        for python, version in zip(pythons, versions, strict=True):
            result = one_turn(python, args, out / f"{version}-{turn}")
            first = first or result["deployed"]
            lines.append(
                f"| {version} | {turn} | {result['deployed']:.2f} | "
                f"{result['simulated']:.2f} | "
                f"{result['deployed'] / result['simulated']:.2f}x | "
                f"{result['deployed'] / first:.2f}x |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    (out / "flower-releases.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())

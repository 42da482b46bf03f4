"""Wall time of complete `pollen run` simulations, split into start-up and rounds.

    .venv/bin/python benchmarks/run_time.py [-c "key=value ..."]... [--repeat N]

Prints one row per run: total wall time of the command (SuperLink start to
exit), time before the first round finished, the mean of the later rounds,
and the final accuracy. Start-up = total - sum of per-round seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def one_run(config: list[str], out: Path, name: str) -> dict[str, float]:
    args = [str(Path(sys.executable).parent / "pollen"), "run", str(PROJECT)]
    for value in [*config, f"output-dir='{out}' run-name='{name}'"]:
        args += ["-c", value]
    started = time.monotonic()
    subprocess.run(args, check=True, capture_output=True)
    wall = time.monotonic() - started
    history = json.loads((out / name / "history.json").read_text())
    later = [r["seconds"] for r in history[1:]] or [0.0]
    return {
        "wall": wall,
        "first-round": history[0]["seconds"],
        "later-rounds-mean": sum(later) / len(later),
        "start-up": wall - sum(r["seconds"] for r in history),
        "rounds": len(history),
        "accuracy": history[-1]["accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            one_run(args.run_config, Path(tmp), f"r{i}") for i in range(args.repeat)
        ]
    print(
        "| run | wall s | start-up s | round 1 s | later rounds s | rounds | accuracy |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i} | {r['wall']:.1f} | {r['start-up']:.1f} | {r['first-round']:.2f} | "
            f"{r['later-rounds-mean']:.2f} | {r['rounds']} | {100 * r['accuracy']:.2f}% |"
        )


if __name__ == "__main__":
    main()

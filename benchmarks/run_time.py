"""Wall time of complete `pollen run` simulations, split into start-up and rounds.

    .venv/bin/python benchmarks/run_time.py [-c "key=value ..."]... [--repeat N]

Prints one row per run: total wall time of the command (SuperLink start to
exit), time before the first round finished, the mean of the later rounds,
and the final accuracy. Start-up = total - sum of per-round seconds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from measure import run_pollen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            run_pollen(args.run_config, Path(tmp), f"r{i}") for i in range(args.repeat)
        ]
    print(
        "| run | wall s | start-up s | round 1 s | later rounds s | rounds | accuracy |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        later = r["rounds"][1:] or [0.0]
        print(
            f"| {i} | {r['wall']:.1f} | {r['start-up']:.1f} | {r['rounds'][0]:.2f} | "
            f"{sum(later) / len(later):.2f} | {len(r['rounds'])} | "
            f"{100 * r['accuracy']:.2f}% |"
        )


if __name__ == "__main__":
    main()

"""When each step of a `pollen run`'s start-up is reached, from the command's
own clock: where the seconds of a short run go.

    .venv/bin/python benchmarks/startup_timeline.py [-c "key=value ..."]...
        [--repeat N] [--warm]

Runs `pollen run --verbose` (the default digits run, 2 rounds, unless `-c`
says otherwise) N times and notes when each milestone's line arrives:
the run submitted (`flwr run` has connected), Flower's simulation process
started, the ServerApp running (its first line), the ServerApp ready to
play round 1 (data, model, strategy), round 1 done, the run completed, and
the command's exit. Flower's log stream delivers the ServerApp's lines in
batches every 0.5 s, so a milestone inside the run may read up to 0.5 s
late. `--warm` alternates runs on a federation of their own with runs on a
warm one (`pollen warm up`'s, started once before the first run).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
POLLEN = str(Path(sys.executable).with_name("pollen"))
MILESTONES = (
    ("submitted", "Successfully started run"),
    ("simulation process", "Starting Flower Simulation"),
    ("ServerApp running", "pollen: results go to"),
    ("round 1 starts", "[ROUND 1]"),
    ("round 1 done", "round 1/"),
    ("completed", "pollen: completed"),
)


def timeline(config: list[str], out: Path, cwd: Path) -> dict[str, float]:
    """Seconds from the command's start to each milestone, and to its exit."""
    argv = [POLLEN, "run", str(PROJECT), "--verbose", "-c", f"output-dir='{out}'"]
    for value in config:
        argv += ["-c", value]
    started = time.monotonic()
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=cwd)  # fmt: skip
    assert run.stdout is not None
    seen: dict[str, float] = {}
    for line in run.stdout:
        for name, marker in MILESTONES:
            if name not in seen and marker in line:
                seen[name] = time.monotonic() - started
    run.wait()
    seen["exit"] = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"pollen run failed ({run.returncode})")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", action="store_true")
    args = parser.parse_args()
    config = args.run_config or ["rounds=2"]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        kinds = {"own": root / "own"}
        kinds["own"].mkdir()
        if args.warm:
            kinds["warm"] = root / "warm"
            kinds["warm"].mkdir()
            started = time.monotonic()
            subprocess.run([POLLEN, "warm", "up"], cwd=kinds["warm"], check=True,
                           capture_output=True)  # fmt: skip
            print(f"warm federation up in {time.monotonic() - started:.1f} s")
        rows: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        try:
            for i in range(args.repeat):
                for kind, cwd in kinds.items():
                    rows[kind].append(timeline(config, root / f"{kind}-{i}", cwd))
        finally:
            if args.warm:
                subprocess.run([POLLEN, "warm", "down"], cwd=kinds["warm"],
                               check=False, capture_output=True)  # fmt: skip
    names = [name for name, _ in MILESTONES] + ["exit"]
    print("| federation | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for kind, runs in rows.items():
        for run in runs:
            cells = [f"{run[n]:.2f}" if n in run else "-" for n in names]
            print(f"| {kind} | " + " | ".join(cells) + " |")
        medians = [statistics.median(r[n] for r in runs if n in r) for n in names]
        print(
            f"| {kind}, median | " + " | ".join(f"**{m:.2f}**" for m in medians) + " |"
        )


if __name__ == "__main__":
    main()

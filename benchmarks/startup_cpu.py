"""Where a `pollen run`'s start-up CPU goes: seconds of CPU per process.

    .venv/bin/python benchmarks/startup_cpu.py [-c "key=value ..."]...
        [--repeat N] [--against DIR]

Start-up on a 2-core machine is CPU-bound once Ray starts
(docs/performance.md), so what shortens it is less CPU work, not less
waiting. This runs `pollen run` and samples every process of its tree every
0.1 s (Linux /proc: user + system time, and the command line, which Ray's
workers rename); a process's CPU is its last sample, its kind is read from
its last non-empty command line. It prints one row per kind of process: how
many there were, their CPU seconds until the first round began (the
ServerApp's `[ROUND 1]` line) and over the whole run; then the totals and
the wall time until round 1 and in all.

`--against DIR` alternates runs of this checkout and another one (`git
worktree add DIR <commit>`), N runs each, as `run_time.py` does, and prints
each tree's mean CPU seconds per kind of process side by side.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from measure import alternated, descendants, pollen_command, side_by_side

TICKS = os.sysconf("SC_CLK_TCK")
FIRST_ROUND = "[ROUND 1]"
# (what a command line contains, the name of that kind of process), first match
KINDS = (
    ("ClientAppActor", "ClientApp actor"),
    ("ray::IDLE", "Ray idle worker"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("RuntimeEnvAgent", "Ray runtime-env agent"),
    ("dashboard.py", "Ray dashboard (API server)"),
    ("log_monitor.py", "Ray log monitor"),
    ("monitor.py", "Ray autoscaler monitor"),
    ("gcs_server", "Ray GCS server"),
    ("raylet", "Ray raylet"),
    ("flwr-simulation", "simulation (ServerApp, Ray driver)"),
    ("flower-superexec", "SuperExec"),
    ("flower-superlink", "SuperLink"),
    ("bin/flwr", "flwr run"),
    ("bin/pollen", "pollen CLI"),
)


def kind_of(command_line: str) -> str:
    for needle, kind in KINDS:
        if needle in command_line:
            return kind
    return "other: " + command_line.split(" ", 1)[0].rsplit("/", 1)[-1][:30]


def _sample(pid: int) -> tuple[str, float] | None:
    """A process's command line and its CPU seconds (user + system) so far."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return raw.replace(b"\0", b" ").decode(errors="replace"), (
        int(fields[11]) + int(fields[12])
    ) / TICKS


def profile_run(config: list[str], out: Path, name: str, tree: Path) -> dict:
    """One `pollen run`: CPU seconds per kind of process until round 1 and in all."""
    args, popen = pollen_command(config, out, name, tree)
    started = time.monotonic()
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    seen: dict[int, tuple[str, float]] = {}
    at_round_1: dict[int, tuple[str, float]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            for pid in descendants(process.pid):
                if (sampled := _sample(pid)) is not None:
                    command_line, cpu = sampled
                    if not command_line and pid in seen:  # exiting: keep its kind
                        command_line = seen[pid][0]
                    seen[pid] = command_line, cpu

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    wall_to_round_1 = None
    assert process.stdout is not None
    output = []
    for line in process.stdout:
        output.append(line)
        if wall_to_round_1 is None and FIRST_ROUND in line:
            wall_to_round_1 = time.monotonic() - started
            at_round_1 = dict(seen)
    process.wait()
    done.set()
    sampler.join()
    if process.returncode != 0 or wall_to_round_1 is None:
        raise RuntimeError(f"{' '.join(args)} failed:\n{''.join(output)[-3000:]}")
    return {
        "wall": time.monotonic() - started,
        "wall to round 1": wall_to_round_1,
        "to round 1": _by_kind(at_round_1),
        "whole run": _by_kind(seen),
        "count": Counter(kind_of(command_line) for command_line, _ in seen.values()),
    }


def _by_kind(samples: dict[int, tuple[str, float]]) -> dict[str, float]:
    cpu: dict[str, float] = defaultdict(float)
    for command_line, seconds in samples.values():
        cpu[kind_of(command_line)] += seconds
    return cpu


def _mean(runs: list[dict], part: str, kind: str) -> float:
    return sum(run[part].get(kind, 0.0) for run in runs) / len(runs)


def main() -> None:
    args, trees = side_by_side(__doc__.split("\n")[0])
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for label, i, tree in alternated(trees, args.repeat):
            runs[label].append(
                profile_run(args.run_config, Path(tmp), f"{label}-{i}", tree)
            )
    kinds = sorted(
        {k for rs in runs.values() for r in rs for k in r["whole run"]},
        key=lambda k: -_mean(runs["this"], "to round 1", k),
    )
    columns = [
        f"{label}: {part}" for label in trees for part in ("to round 1", "whole run")
    ]
    print(f"CPU seconds, mean of {args.repeat} run(s) per tree\n")
    print("| process | count | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for kind in kinds:
        count = max(r["count"].get(kind, 0) for r in runs["this"])
        cells = [
            f"{_mean(rs, part, kind):.1f}"
            for rs in runs.values()
            for part in ("to round 1", "whole run")
        ]
        print(f"| {kind} | {count} | " + " | ".join(cells) + " |")
    totals = [
        f"**{sum(_mean(rs, part, k) for k in kinds):.1f}**"
        for rs in runs.values()
        for part in ("to round 1", "whole run")
    ]
    print("| **all** | | " + " | ".join(totals) + " |")
    walls = [
        f"{sum(r[key] for r in rs) / len(rs):.1f}"
        for rs in runs.values()
        for key in ("wall to round 1", "wall")
    ]
    print("| wall seconds | | " + " | ".join(walls) + " |")


if __name__ == "__main__":
    main()

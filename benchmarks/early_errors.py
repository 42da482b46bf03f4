"""Time from `pollen run` (or `pollen deploy up`, `pollen compare`) to its
error line, for each class of bad input in issue 46.

    .venv/bin/python benchmarks/early_errors.py [--repeat N]

Each case is a fresh command, as a user types it (Python's start and
pollen's imports included), in a temporary folder made for it; a row gives
the exit status, the median seconds of N tries and the start of the error
line. Every case must end with exit 2 before any Flower or Ray process
starts (the tests in tests/test_early_checks.py check that no app is staged
for Flower); the seconds are what a user waits.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
POLLEN = str(Path(sys.executable).with_name("pollen"))


def _damaged_checkpoint(tmp: Path) -> list[str]:
    """A run directory whose checkpoint's model.npz is truncated."""
    sys.path.insert(0, str(PROJECT))
    import numpy as np

    from pollen.deployment.run_config import resolve_settings
    from pollen.runs.checkpoints import Checkpoint, save_checkpoint

    config = f"output-dir='{tmp}' rounds=3"
    run_dir = tmp / "run"
    run_dir.mkdir()
    (run_dir / "settings.json").write_text('{"run-name": "run"}')
    settings = resolve_settings(PROJECT, [config])
    save_checkpoint(run_dir, Checkpoint(
        3, {"w": np.ones((64, 64), np.float32)}, {},
        {"settings": settings.to_run_config()},
    ), keep=1)  # fmt: skip
    model = run_dir / "checkpoints" / "round-00003" / "model.npz"
    model.write_bytes(model.read_bytes()[:200])
    return ["-c", f"output-dir='{tmp}' rounds=5 resume='{run_dir}'"]


def _file(tmp: Path, name: str, content: bytes = b"") -> Path:
    (tmp / name).write_bytes(content)
    return tmp / name


CASES: list[tuple[str, Callable[[Path], list[str]]]] = [
    ("run directory exists (another run's)",
     lambda t: ((t / "same").mkdir(), ["-c", f"output-dir='{t}' run-name='same'"])[1]),
    ("resume from a truncated model.npz", _damaged_checkpoint),
    ("num-supernodes=0",
     lambda t: ["-c", f"output-dir='{t}'", "--federation-config", "num-supernodes=0"]),
    ("output-dir under a file",
     lambda t: ["-c", f"output-dir='{_file(t, 'f')}/out'"]),
    ("data-root is a file",
     lambda t: ["-c", f"output-dir='{t}' data-set='mnist' data-root='{_file(t, 'd')}'"]),
    ("impossible min-size (niid)",
     lambda t: ["-c", f"output-dir='{t}' partition='niid' num-clients=1000"]),
    ("run-name='../../x'", lambda t: ["-c", f"output-dir='{t}' run-name='../../x'"]),
    ("unknown key (lrr)", lambda t: ["-c", f"output-dir='{t}' lrr=0.1"]),
]  # fmt: skip
OTHER_COMMANDS: list[tuple[str, Callable[[Path], list[str]]]] = [
    ("deploy up: partition-id outside num-partitions",
     lambda t: ["deploy", "up", "--dir", str(t / "d"), "--nodes", "2",
                "--node-config", "1:partition-id=2"]),
    ("compare: a grid that is not UTF-8",
     lambda t: ["compare", str(_file(t, "g.toml", b"# caf\xe9\n")), str(PROJECT),
                "--out", str(t / "o")]),
    ("compare: a list under [base]",
     lambda t: ["compare", str(_file(t, "g.toml", b"[base]\nstrategy=['a']\n")),
                str(PROJECT), "--out", str(t / "o")]),
]  # fmt: skip


def time_case(args: Callable[[Path], list[str]], run: bool) -> tuple[int, float, str]:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        argv = [POLLEN, *(["run", str(PROJECT)] if run else []), *args(tmp)]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - started
    line = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode, seconds, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    print("| bad input | exit | seconds to the error (median) | the error line |")
    print("|---|---|---|---|")
    for cases, run in ((CASES, True), (OTHER_COMMANDS, False)):
        for name, args in cases:
            results = [time_case(args, run) for _ in range(repeat)]
            code, _, line = results[-1]
            seconds = statistics.median(r[1] for r in results)
            shown = line if len(line) <= 110 else line[:107] + "..."
            print(f"| {name} | {code} | {seconds:.2f} | `{shown}` |")


if __name__ == "__main__":
    main()

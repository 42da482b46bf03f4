"""What the benchmarks measure: a command's wall time and its peak memory.

Peak memory is the largest sum, over samples every 0.2 s, of the resident
set sizes of a process and all its descendants (Linux /proc). A `pollen run`
is a tree (CLI, SuperLink, simulation, Ray's daemons and ClientApp actors),
so its memory is the tree's; pages shared between processes (torch's
libraries) count once per process, an overestimate stated with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pollen.deployment import processes

PROJECT = Path(__file__).resolve().parents[1]
POLLEN = str(Path(sys.executable).parent / "pollen")


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(root: int) -> list[int]:
    """`root` and every process below it, now."""
    return [root, *processes.descendants(root)]


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of `root` and every descendant, now."""
    return sum(_rss_bytes(pid) for pid in descendants(root))


def busy_cpu_seconds() -> float:
    """CPU-s all cores spent on work since boot (/proc/stat: user, nice,
    system, irq, softirq; not idle, iowait, steal, nor guest time, which
    user and nice already hold)."""
    fields = [
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(
    command: list[str], **popen
) -> tuple[float, int, subprocess.CompletedProcess]:
    """Run `command` to completion: (wall seconds, peak tree RSS bytes, result)."""
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_rss_bytes(process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    result = subprocess.CompletedProcess(command, process.returncode, output)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return wall, peak[0], result


def settings_of(config: str):
    """What `pollen run` validates: the project's defaults under one `-c` value."""
    # imported here: only scripts that ask pay for numpy and the settings
    from pollen.deployment.run_config import resolve_settings

    return resolve_settings(PROJECT, [config])


def pollen_command(
    config: list[str],
    out: Path,
    name: str,
    tree: Path = PROJECT,
    federation: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
    python: bool = False,
) -> tuple[list[str], dict]:
    """The `pollen run` of this project, or of the checkout `tree` (its app
    and, through PYTHONPATH, its `pollen` package), writing run `name` under
    `out`: the command and its Popen keywords. It starts in `tree`: a
    `pollen run` before 832c5e8 ran its simulation in the shell's directory,
    which Ray puts first on the actors' module path. `federation` values go
    to `--federation-config`; `options` are `pollen run`'s own (e.g.
    `--warm-simulation DIR`). `python`: the same run through `pollen.run`,
    in a Python process of its own (`PYTHON_RUN`), instead of the command."""
    values = [*config, f"output-dir='{out}' run-name='{name}'"]
    if python:
        assert not federation and not options, "pollen.run here takes settings only"
        return [sys.executable, "-c", PYTHON_RUN, str(tree), *values], {"cwd": tree}
    args = [POLLEN, "run", str(tree), *options]
    for value in values:
        args += ["-c", value]
    for value in federation:
        args += ["--federation-config", value]
    popen: dict = {"cwd": tree}
    if tree != PROJECT:
        popen["env"] = {**os.environ, "PYTHONPATH": str(tree)}
    return args, popen


def run_pollen(
    config: list[str],
    out: Path,
    name: str,
    tree: Path = PROJECT,
    federation: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
    python: bool = False,
) -> dict[str, float]:
    """One complete `pollen run` (see `pollen_command`), timed from the
    command's start to its exit: wall, start-up (wall less the rounds' own
    seconds, as the ServerApp times them), every round's seconds, accuracy
    and peak RSS."""
    args, popen = pollen_command(config, out, name, tree, federation, options, python)
    wall, peak, _ = measure(args, **popen)
    history = json.loads((out / name / "history.json").read_text())
    rounds = [r["seconds"] for r in history]
    return {
        "wall": wall,
        "start-up": wall - sum(rounds),
        "rounds": rounds,
        "accuracy": history[-1]["accuracy"],
        "peak-rss": peak,
    }


WARM = "warm"  # the label of runs on a warm federation (`side_by_side`'s --warm)
# the label of runs through `pollen.run` (`side_by_side`'s --python), and the
# program they run: the app, then the settings, as `-c` values
PYTHON = "python"
PYTHON_RUN = "import sys, pollen; pollen.run(sys.argv[2:], app=sys.argv[1])"


def side_by_side(description: str) -> tuple[argparse.Namespace, dict[str, Path]]:
    """The command line of a script that measures `pollen run`s of this
    checkout, or of this one and another alternately: `-c` (repeatable),
    `--repeat N`, `--against DIR`. Returns the arguments and the checkouts
    by label ("this", "against")."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--against", type=Path, help="another checkout, alternated")
    parser.add_argument(
        "--warm", action="store_true",
        help="this checkout on a federation of its own per run, alternated with "
        "runs on one warm simulation federation (`pollen run --warm-simulation`)",
    )  # fmt: skip
    parser.add_argument(
        "--python", action="store_true",
        help="this checkout's `pollen run` command alternated with the same run "
        "through `pollen.run` in a Python process (`PYTHON_RUN`)",
    )  # fmt: skip
    args = parser.parse_args()
    if (args.warm or args.python) and args.against:
        parser.error(
            "--warm and --python compare this checkout with itself: no --against"
        )
    if args.warm and args.python:
        parser.error("give --warm or --python, not both")
    trees = {"own": PROJECT, WARM: PROJECT} if args.warm else {"this": PROJECT}
    if args.python:
        trees = {"command": PROJECT, PYTHON: PROJECT}
    if args.against:
        if not (args.against / "pollen" / "server_app.py").is_file():
            parser.error(f"--against {args.against}: not a checkout of this project")
        trees["against"] = args.against.resolve()
    return args, trees


def alternated(trees: dict[str, Path], repeat: int) -> Iterator[tuple[str, int, Path]]:
    """(label, run index, checkout) for `repeat` rounds of one run per checkout."""
    for i in range(repeat):
        for label, tree in trees.items():
            yield label, i, tree

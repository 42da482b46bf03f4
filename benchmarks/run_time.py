"""Wall time of complete `pollen run` simulations, split into start-up and rounds.

    .venv/bin/python benchmarks/run_time.py [-c "key=value ..."]... [--repeat N]
        [--against DIR | --warm]

Prints one row per run: total wall time of the command (SuperLink start to
exit), start-up = total - sum of per-round seconds, round 1, the mean of
the later rounds, fixed = total - rounds x that mean (what the run costs
beyond its rounds at their steady pace: since a simulation no longer asks
its nodes anything before round 1, the ClientApp actors start inside round
1, so start-up alone no longer holds all of it), and the final accuracy.

`--against DIR` measures a change side by side: runs alternate between this
checkout and DIR, another checkout of the project (`git worktree add DIR
<commit>`) using this one's environment, N runs each, and the table ends
with each tree's means. Every run starts in its own checkout, so relative
paths in `-c` (`data-root='../shared/data'`) resolve against it.

`--warm` alternates runs on a federation of their own ("own", as `pollen
run` does) with runs on one warm simulation federation ("warm", as `pollen
compare`'s cells do; started once before the first run, its start time
printed apart).

`--python` alternates the `pollen run` command ("command") with the same
run through the Python API ("python": `pollen.run(...)` in a fresh Python
process, timed from its start to its exit as the command is).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from measure import PYTHON, WARM, alternated, run_pollen, side_by_side

from pollen.deployment.warm_simulation import warm_simulation


def main() -> None:
    args, trees = side_by_side(__doc__.split("\n")[0])
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        options: dict[str, tuple[str, ...]] = {}
        if WARM in trees:
            started = time.monotonic()
            federation = stack.enter_context(warm_simulation(Path(tmp) / "warm"))
            print(f"warm federation up in {time.monotonic() - started:.1f} s")
            options[WARM] = ("--warm-simulation", str(federation.root))
        rows = []
        for label, i, tree in alternated(trees, args.repeat):
            run = run_pollen(args.run_config, Path(tmp), f"{label}-{i}", tree,
                             options=options.get(label, ()), python=label == PYTHON)  # fmt: skip
            rows.append((label, i, run))
    print("| tree | run | wall s | start-up s | round 1 s | later rounds s | fixed s "
          "| rounds | accuracy |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for label, i, r in rows:
        print(
            f"| {label} | {i} | {r['wall']:.1f} | {r['start-up']:.1f} | "
            f"{r['rounds'][0]:.2f} | {_later(r):.3f} | {_fixed(r):.1f} | "
            f"{len(r['rounds'])} | {100 * r['accuracy']:.2f}% |"
        )
    for label in trees:
        runs = [r for tree, _, r in rows if tree == label]
        n = len(runs)
        print(
            f"| {label} | mean of {n} | {sum(r['wall'] for r in runs) / n:.1f} | "
            f"{sum(r['start-up'] for r in runs) / n:.1f} | "
            f"{sum(r['rounds'][0] for r in runs) / n:.2f} | "
            f"{sum(_later(r) for r in runs) / n:.3f} | "
            f"{sum(_fixed(r) for r in runs) / n:.1f} | | |"
        )


def _later(run: dict) -> float:
    """Mean seconds of the rounds after the first (0 for a 1-round run)."""
    later = run["rounds"][1:]
    return sum(later) / len(later) if later else 0.0


def _fixed(run: dict) -> float:
    """Wall seconds beyond the rounds at the later rounds' pace."""
    return run["wall"] - len(run["rounds"]) * _later(run)


if __name__ == "__main__":
    main()

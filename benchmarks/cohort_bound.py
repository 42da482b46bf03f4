"""How much faster than one client after another any cohort trainer can be
on FedProx's Synthetic(1, 1), from the clients' sizes alone (no training).

    .venv/bin/python benchmarks/cohort_bound.py [--seeds 20]

A client's local SGD steps run in order: step t needs step t-1's model. So
a node's cohort takes at least as many steps as its longest client, while
one client after another takes the sum of its clients' steps. At the same
cost a step, a round's speed-up is at most

    bound = (sequential round's steps) / (cohort round's steps)

whatever the vectorised step costs; the cost of a cohort step (more than a
plain step's on this CPU: docs/performance.md, "Cohorts") only lowers it.
Synthetic's sizes follow a power law (`pollen/task/synthetic.py`:
lognormal(4, 2) + 50 examples), so one client often holds a third of a
round's steps.

Rows, each issue 49 workload as pollen runs it (`batch-size` 10, one local
epoch; steps = ceil(train examples / 10), as `train_local` takes them):

- `benchmarks/cohort.py`'s `synthetic-logreg`: the 100 clients of
  `num-clients=100` (seed 845) on one node, every one sampled: Sigma/max.
- The same population drawn with seeds 1..`--seeds`: how the bound moves
  with the draw of sizes (median, range, the share of draws where 5x is
  possible at all).
- The 100,000-client example (`num-clients=100000 client-frac=0.001`, seed
  845, 20 rounds) and pfl-research's workload (`benchmarks/pfl_side_by_side.py`:
  1,000 clients, 100 a round, rounds 2-20), both with the clients a round
  samples (`sample_clients`) on the two nodes a cohort run starts on two
  cores (client c on node c mod 2): the sequential round has two actors
  taking messages as they free up (at least Sigma/2 and at least the longest
  client), the cohort round lasts its slowest node's longest client. The
  whole run's bound is the ratio of the rounds' sums (what a mean round
  time compares), and each round's bound is listed by its median and range.

Measured, with the date: docs/lab-notes/performance.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

import numpy as np

from pollen.strategies.sampling import sample_clients
from pollen.task.synthetic import client_sizes, train_size

BATCH = 10
SEED = 845
NODES = 2  # a cohort run on two cores: one node (one ClientApp actor) per core


def steps(num_clients: int, seed: int) -> np.ndarray:
    """Every client's local steps in one epoch at batch `BATCH`."""
    sizes = client_sizes(num_clients, seed)
    return np.array([math.ceil(train_size(int(n)) / BATCH) for n in sizes])


def one_node_bound(client_steps: np.ndarray) -> float:
    """One node serving every client: sum over max."""
    return float(client_steps.sum() / client_steps.max())


def round_steps(client_steps: np.ndarray, clients: Sequence[int]) -> tuple[float, ...]:
    """(sequential on `NODES` actors, sequential in one process, cohort)
    steps of one round on `NODES` nodes."""
    taken = client_steps[list(clients)]
    cohort = max(client_steps[[c for c in clients if c % NODES == n]].max(initial=0)
                 for n in range(NODES))  # fmt: skip
    return (
        float(max(taken.sum() / NODES, taken.max())),
        float(taken.sum()),
        float(cohort),
    )


def run_bounds(
    num_clients: int, fraction: float, rounds: Sequence[int]
) -> tuple[list[float], list[float]]:
    """The whole run's bounds (ratios of sums) over `NODES` actors and over
    one process, and each round's over `NODES` actors."""
    client_steps = steps(num_clients, SEED)
    rows = np.array([
        round_steps(client_steps, sample_clients(num_clients, fraction, SEED, r))
        for r in rounds
    ])  # fmt: skip
    totals = rows.sum(axis=0)
    return [totals[0] / totals[2], totals[1] / totals[2]], list(rows[:, 0] / rows[:, 2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    print("| workload | bound over one client after another on the same nodes: "
          "run (ratio of sums) | per round or draw: median (range) | rounds or "
          "draws allowing 5x | bound over one process (pfl's) |")  # fmt: skip
    print("|---|---|---|---|---|")
    single = one_node_bound(steps(100, SEED))
    print(f"| cohort.py synthetic-logreg (100 clients, seed {SEED}, one node) | "
          f"{single:.2f}x | - | {'yes' if single >= 5 else 'no'} | {single:.2f}x |")  # fmt: skip
    draws = [one_node_bound(steps(100, seed)) for seed in range(1, args.seeds + 1)]
    print(f"| the same population drawn with seeds 1-{args.seeds} | - | "
          f"{statistics.median(draws):.2f}x ({min(draws):.2f}-{max(draws):.2f}) | "
          f"{sum(d >= 5 for d in draws)}/{len(draws)} | - |")  # fmt: skip
    for name, clients, fraction, rounds in (
        ("100,000-client example, rounds 1-20", 100_000, 0.001, range(1, 21)),
        ("pfl-research's workload, rounds 2-20", 1_000, 0.1, range(2, 21)),
    ):
        (actors, one_process), per_round = run_bounds(clients, fraction, rounds)
        print(f"| {name}, {NODES} nodes | {actors:.2f}x | "
              f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-"
              f"{max(per_round):.2f}) | {sum(b >= 5 for b in per_round)}/"
              f"{len(per_round)} | {one_process:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()

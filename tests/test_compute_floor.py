"""`pollen run` computes FedAvg of `train_local`, no more and no less.

The compute floor (`pollen.experiments.floor`, which benchmarks/throughput.py
times) replays a run in one process: pollen's own shards, client seeds and
`train_local`, the clients' models averaged by shard size. A real simulation (Flower, Ray actors, messages,
the FAB, every start-up shortcut) must end at the same model: whatever is
done to make the federated path faster is checked against this reference.

Not bit for bit: the ClientApp actor and this process may use different
numbers of torch threads, which reorders float sums (about 1e-7 per step);
over three rounds that moves the test loss in its fifth digit, so the loss
must agree to 1e-3 relative and the accuracy to one test image in 100. A
wrong seed, shard, learning rate or weighting moves them by far more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pollen.deployment.run_config import resolve_settings
from pollen.experiments.floor import fedavg_floor
from tests.conftest import PROJECT

pytestmark = pytest.mark.integration
CONFIG = "num-clients=10 client-frac=1.0 rounds=3 local-epochs=1 batch-size=16 lr=0.05"


def test_simulation_ends_at_the_in_process_reference(
    tmp_path: Path, warm_federation: Path
) -> None:
    run = subprocess.run(
        [str(Path(sys.executable).parent / "pollen"), "run", str(PROJECT),
         "--warm-simulation", str(warm_federation), "-c", CONFIG, "-c", f"output-dir='{tmp_path}' run-name='run'"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = json.loads((tmp_path / "run" / "history.json").read_text())[-1]
    reference = fedavg_floor(resolve_settings(PROJECT, [CONFIG]))
    assert last["round"] == 3 and len(last["clients"]) == 10
    assert last["loss"] == pytest.approx(reference["loss"], rel=1e-3)
    assert last["accuracy"] == pytest.approx(reference["accuracy"], abs=0.01)

"""A simulation's GPU share is checked before Flower starts (on CPU too).

Seen on an H100 (docs/performance.md, "On an NVIDIA H100"): `device='cuda'`
without `client-resources-num-gpus` passed the local device check (the
driver sees the GPU), then Ray hid the GPU from every ClientApp actor, every
client failed and the run "completed" at chance accuracy with exit 0. And a
GPU share on a machine without one made Flower stop with "ActorPool is
empty" after start-up, which pollen reported as an interruption.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pollen.cli import EXIT_BAD_INPUT, main
from pollen.deployment import launch
from pollen.deployment.launch import (
    LaunchError,
    check_local_gpus,
    simulation_federation,
)
from tests.conftest import PROJECT


def test_cuda_in_a_simulation_needs_a_gpu_share() -> None:
    with pytest.raises(LaunchError, match="'cuda' in a simulation without a GPU share"):
        simulation_federation([], 10, "cuda")
    with pytest.raises(LaunchError, match=r"client-resources-num-gpus=0\.25"):
        simulation_federation(["client-resources-num-gpus=0"], 10, "cuda")
    given = ["client-resources-num-gpus=0.25"]
    assert simulation_federation(given, 10, "cuda")[0] == given[0]
    for device in ("auto", "cpu"):  # auto falls back to the CPU in an actor
        assert simulation_federation([], 10, device)


def test_a_gpu_share_needs_a_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_local_gpus([])
    check_local_gpus(["client-resources-num-gpus=0 num-supernodes=3"])
    with pytest.raises(
        LaunchError, match=r"num-gpus=0\.25; this machine has 0 CUDA GPU"
    ):
        check_local_gpus(["client-resources-num-gpus=0.25"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_local_gpus(["client-resources-num-gpus=0.25"])
    check_local_gpus(["client-resources-num-gpus=1"])
    with pytest.raises(LaunchError, match=r"allowed here: a number in \[0, 1\]"):
        check_local_gpus(["client-resources-num-gpus=2"])


def test_a_gpu_share_without_a_gpu_stops_pollen_run_early(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a GPU share is valid here")

    def staged_app(app: Path) -> None:
        raise AssertionError("the run reached Flower before its check")

    monkeypatch.setattr(launch, "staged_app", staged_app)
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}'",
            "--federation-config", "client-resources-num-gpus=0.25"]  # fmt: skip
    assert main(argv) == EXIT_BAD_INPUT
    assert "this machine has 0 CUDA GPU(s)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())

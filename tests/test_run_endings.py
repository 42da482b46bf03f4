"""How a deployed run that lost its SuperLink ends: which of the deployment's
processes are gone (a `pollen deploy down`, a killed SuperLink, or none: a
network fault), what to run next, and the resume command after the last
checkpoint. The deployment here is a record of real processes (`sleep`),
as `pollen deploy up` writes one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.deployment import cluster
from pollen.deployment.launch import (
    LOST_CONNECTION,
    LaunchError,
    lost_deployment,
    resume_command,
    running_deployment,
)
from pollen.runs.checkpoints import Checkpoint, save_checkpoint
from pollen.settings import Settings
from tests.conftest import resumable_extra

RESUME = "pollen run . -c \"resume='runs/r'\""
LOST = f"{LOST_CONNECTION}. Please check your network connection"


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[cluster.Deployment, list]]:
    """A record of a SuperLink and two SuperNodes (file state), all running."""
    started = [subprocess.Popen(["sleep", "120"]) for _ in range(3)]
    record = cluster.Deployment(
        str(tmp_path / "site"), "127.0.0.1:9093", insecure=True,
        superlink_pid=started[0].pid, superlink_state="file",
        nodes=[cluster.Node(k, p.pid, f"partition-id={k}", "node.log")
               for k, p in enumerate(started[1:])],
    )  # fmt: skip
    record.root.mkdir()
    record.save()
    try:
        yield record, started
    finally:
        for process in started:
            process.kill()
            process.wait()


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def _checkpointed_run(run_dir: Path, settings: Settings, round: int) -> None:
    config = settings.to_run_config()
    model = {"w": np.ones((2, 2), np.float32)}
    save_checkpoint(
        run_dir, Checkpoint(round, model, extra=resumable_extra(config)), keep=2
    )


def test_a_killed_superlink_is_named_with_the_restart_and_resume_commands(
    deployment, tmp_path: Path
) -> None:
    record, started = deployment
    _stop(started[0])
    settings = Settings.from_run_config({"rounds": 4, "checkpoint-every": 1})
    run_dir = tmp_path / "runs" / "r"
    _checkpointed_run(run_dir, settings, 2)
    lost, resume = lost_deployment(record, run_dir, settings, RESUME, LOST)
    assert lost.startswith(f"the deployment's SuperLink (pid {started[0].pid}) stopped")
    assert "while its SuperNodes run on" in lost
    assert f"`pollen deploy restart superlink --dir {record.root}`" in lost
    assert resume == f"then resume after round 2 (checkpointed) with:\n  {RESUME}"
    # and a run sent to it is told the same, before anything starts
    with pytest.raises(LaunchError, match="restart it with `pollen deploy restart"):
        running_deployment(record.root, None)


def test_a_stopped_deployment_is_told_from_a_network_fault(
    deployment, tmp_path: Path
) -> None:
    record, started = deployment
    settings = Settings.from_run_config({"rounds": 4, "checkpoint-every": 0})
    run_dir = tmp_path / "runs" / "r"
    (still_up,) = lost_deployment(record, run_dir, settings, RESUME, LOST)
    assert still_up.startswith(f"the deployment's SuperLink (pid {started[0].pid}) "
                               "still runs")  # fmt: skip
    assert "a network fault?" in still_up
    # a run that failed on its own (its SuperLink answers): nothing to add
    assert lost_deployment(record, run_dir, settings, RESUME, "ValueError") == []
    for process in started:
        _stop(process)
    down, resume = lost_deployment(record, run_dir, settings, RESUME, LOST)
    assert down.startswith(f"the deployment in {record.root} was stopped")
    assert f"`pollen deploy up --dir {record.root}`" in down
    assert resume == "interrupted before the run started"
    with pytest.raises(LaunchError, match="is not running; start it with"):
        running_deployment(record.root, None)


def test_a_superlink_restarted_during_the_run_is_told_and_resumed_there(
    deployment, tmp_path: Path
) -> None:
    record, started = deployment
    submitted = cluster.Deployment.load(record.root)  # as the run found it
    _stop(started[0])
    replacement = subprocess.Popen(["sleep", "120"])
    try:
        record.superlink_pid = replacement.pid  # `pollen deploy restart superlink`
        record.save()
        settings = Settings.from_run_config({"rounds": 4, "checkpoint-every": 1})
        run_dir = tmp_path / "runs" / "r"
        _checkpointed_run(run_dir, settings, 3)
        resume = resume_command(Path("."), ["rounds=4"], [], run_dir, record.root)
        assert resume == (
            f"pollen run . --deployment {record.root} -c rounds=4 "
            f"-c \"resume='{run_dir}'\""
        )
        restarted, hint = lost_deployment(submitted, run_dir, settings, resume, LOST)
        assert restarted.startswith(
            f"the deployment's SuperLink was restarted during the run (pid "
            f"{started[0].pid}, now {replacement.pid})"
        )
        assert hint.endswith(resume)
    finally:
        _stop(replacement)
    (record.root / cluster.STATE_FILE).unlink()  # the record gone: nothing to say
    assert lost_deployment(submitted, run_dir, settings, resume, LOST) == []

"""`pollen report` on result folders that are damaged, hand-edited or
written by an older pollen: a clear error naming the file, or a report
that reads them as they are meant; never a traceback or a wrong group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollen.cli import main
from pollen.experiments import report
from pollen.runs.claim import claim
from tests.test_compare import write_run

SUMMARY = {
    "status": "completed", "rounds": 2, "final-accuracy": 0.8,
    "best-accuracy": 0.8, "best-round": 2, "total-seconds": 10.0,
    "total-bytes-up": 2_000_000, "total-bytes-down": 4_000_000,
}  # fmt: skip


def run_report(directory: Path, capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", str(directory), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("key", "value"),
    [("total-seconds", ...), ("best-accuracy", ...), ("total-seconds", None),
     ("total-bytes-up", "2000000"), ("best-accuracy", None)],
)  # fmt: skip
def test_a_summary_without_its_numbers_is_named(
    tmp_path: Path, capsys, key: str, value: object
) -> None:
    summary = {k: v for k, v in SUMMARY.items() if k != key}
    if value is not ...:
        summary[key] = value
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8], summary=summary)
    code, _, err = run_report(tmp_path, capsys)
    assert code == 2 and "summary.json" in err and f"'{key}'" in err


def test_a_history_without_byte_counts_has_no_mb_columns(
    tmp_path: Path, capsys
) -> None:
    history = [{"round": 1, "accuracy": 0.6}, {"round": 2, "accuracy": 0.8}]
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8], history=history)
    assert run_report(tmp_path, capsys, "--target", "0.7")[0] == 0
    (row,) = json.loads((tmp_path / "comparison.json").read_text())["groups"]
    assert row["round-to-target"] == [2] and "mb-total" not in row


@pytest.mark.parametrize(
    ("history", "problem"),
    [({"round": 1, "accuracy": 0.8}, "does not hold a list"),
     ([{"round": 1, "accuracy": None}], "'accuracy' is null"),
     ([{"accuracy": 0.8}], "'round' is null"),
     (["a row"], "a row is not an object")],
)  # fmt: skip
def test_a_damaged_history_is_named(
    tmp_path: Path, capsys, history: object, problem: str
) -> None:
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8], history=history)
    code, _, err = run_report(tmp_path, capsys, "--target", "0.7")
    assert code == 2 and "history.json" in err and problem in err


@pytest.mark.parametrize("network", [[], {"links": []}, {"nodes": [{"bytes-up": 5}]}])
def test_a_damaged_network_file_is_named(tmp_path: Path, capsys, network) -> None:
    run = write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8])
    (run / "network.json").write_text(json.dumps(network))
    code, _, err = run_report(tmp_path, capsys)
    assert code == 2 and "network.json" in err


@pytest.mark.parametrize(
    "damaged",
    [b'{"status": "completed", "rounds": 2, "final-acc',
     b'{"status": "completed", "note": "\xff\xfe"}', b"[]"],
)  # fmt: skip
def test_a_run_with_a_damaged_summary_is_listed_as_damaged(
    tmp_path: Path, capsys, damaged: bytes
) -> None:
    """Not as a run that failed before writing a summary (it was)."""
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8])
    bad = write_run(tmp_path, "sam", {"strategy": "fedsam"}, [0.7, 0.9])
    (bad / "summary.json").write_bytes(damaged)
    code, out, _ = run_report(tmp_path, capsys)
    assert code == 0
    (row,) = json.loads((tmp_path / "comparison.json").read_text())["unfinished"]
    assert row["run"] == "sam" and row["status"] == "damaged"
    assert "summary.json" in row["reason"] and "no summary.json" not in out


def test_a_setting_an_older_run_lacks_counts_as_its_default(tmp_path: Path) -> None:
    """`round-deadline` missing from one run's settings.json is its default
    (0.0): one group of two seeds, whichever run sorts first; a later run
    that sets it apart is a group of its own."""
    write_run(tmp_path / "a", "a-new", {"strategy": "fedavg", "seed": 1,
                                        "round-deadline": 0.0}, [0.6, 0.8])  # fmt: skip
    write_run(tmp_path / "a", "b-old", {"strategy": "fedavg", "seed": 2}, [0.5, 0.7])
    rows = report.summarize_groups(report.read_runs(tmp_path / "a"), None)
    assert [r["seeds"] for r in rows] == [[1, 2]]
    write_run(tmp_path / "b", "a-old", {"strategy": "fedavg", "seed": 1}, [0.6, 0.8])
    write_run(tmp_path / "b", "b-new", {"strategy": "fedavg", "seed": 2,
                                        "round-deadline": 50.0}, [0.1, 0.2])  # fmt: skip
    rows = report.summarize_groups(report.read_runs(tmp_path / "b"), None)
    assert sorted(r["seeds"] for r in rows) == [[1], [2]]


def test_a_figure_setting_one_run_lacks_is_drawn(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, "a", {"strategy": "fedavg", "alpha": 0.1}, [0.6, 0.8])
    write_run(tmp_path, "b", {"strategy": "fedsam"}, [0.5, 0.7])
    code, _, _ = run_report(tmp_path, capsys)
    assert code == 0 and list((tmp_path / "plots").glob("accuracy-rounds-*.png"))


def test_a_report_that_cannot_be_written_says_where(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8])
    (tmp_path / "comparison.json").mkdir()
    code, _, err = run_report(tmp_path, capsys)
    assert code == 2 and "comparison.json" in err


def test_a_completed_run_a_resume_holds_is_running(tmp_path: Path) -> None:
    """A resume with more rounds holds a completed run's directory while its
    summary.json is still the earlier run's: it is running, not averaged in."""
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8])
    resumed = write_run(tmp_path, "sam", {"strategy": "fedsam"}, [0.5, 0.7])
    with claim(resumed, new=False):
        unfinished = report.unfinished_runs(tmp_path)
        runs = [r.name for r in report.read_runs(tmp_path)]
    assert runs == ["avg"]
    assert [(r["run"], r["status"]) for r in unfinished] == [("sam", "running")]

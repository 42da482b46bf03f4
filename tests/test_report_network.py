"""`pollen report` against time and bytes: time-, simulated-time- and
bytes-to-target over seeds (hand-computed), the columns only where the
histories record them, and the accuracy plots against each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollen.cli import main
from pollen.experiments import report
from tests.test_compare import write_run as write_finished_run

MB = 1_000_000


def write_run(
    root: Path,
    name: str,
    settings: dict,
    accuracy: list[float],
    seconds: list[float],
    sim_seconds: list[float] | None = None,
) -> Path:
    """A finished run directory with history rows as `pollen run` writes
    them: 1 MB up, 2 MB down and 1 MB of evaluation a round (4 MB in all);
    `sim-seconds` null unless given (no network profile)."""
    history = [
        {"round": i + 1, "accuracy": a, "loss": 1.0, "lr": 0.1, "seconds": s,
         "bytes-up": MB, "bytes-down": 2 * MB, "eval-bytes": MB, "clients": [0, 1],
         "failures": [], "clipped": [], "skipped": False, "personal": {},
         "dp-epsilon": None, "late": [], "staleness": [],
         "sim-seconds": None if sim_seconds is None else sim_seconds[i]}
        for i, (a, s) in enumerate(zip(accuracy, seconds, strict=True))
    ]  # fmt: skip
    # start-up beside the rounds
    return write_finished_run(
        root, name, settings, accuracy, sum(seconds) + 1.0, history
    )


def three_fedavg_seeds(root: Path, sim: bool = False) -> None:
    """Seeds 1 and 2 reach 75% in rounds 2 and 3; seed 3 never does."""
    for seed, accuracy, seconds in (
        (1, [0.5, 0.8, 0.9], [2.0, 3.0, 4.0]),  # 75%: 5 s, 8 MB
        (2, [0.4, 0.6, 0.76], [1.0, 2.0, 3.0]),  # 75%: 6 s, 12 MB
        (3, [0.3, 0.5, 0.6], [1.0, 1.0, 1.0]),  # never
    ):
        sim_seconds = [10 * s for s in seconds] if sim else None
        write_run(root, f"fedavg-{seed}", {"strategy": "fedavg", "seed": seed},
                  accuracy, seconds, sim_seconds)  # fmt: skip


def test_time_and_bytes_to_target_are_sums_up_to_the_round_reaching_it(
    tmp_path: Path,
) -> None:
    three_fedavg_seeds(tmp_path)
    write_run(tmp_path, "fedsam-1", {"strategy": "fedsam"}, [0.75, 0.7], [4.0, 4.0])
    avg, sam = report.summarize_groups(report.read_runs(tmp_path), target=0.75)
    assert avg["round-to-target"] == [2, 3, None]
    assert avg["seconds-to-target"] == [5.0, 6.0, None]
    assert avg["mb-to-target"] == [8.0, 12.0, None]
    assert avg["mb-total"] == {"mean": 12.0, "std": 0.0}  # eval bytes included
    assert sam["seconds-to-target"] == [4.0] and sam["mb-to-target"] == [4.0]
    assert "sim-seconds-to-target" not in avg and "sim-seconds-total" not in avg
    table = report.markdown_table([avg, sam], target=0.75)
    assert table.splitlines()[0] == (
        "| strategy | seeds | final acc. (%) | best acc. (%) | round to 75% "
        "| time to 75% (s) | MB to 75% | time (s) | MB up | MB down | MB total |"
    )
    # over the two seeds that reached 75%, saying so: 5.5 ± 0.7 s, 10 ± 2.8 MB
    assert table.splitlines()[2] == (
        "| fedavg | 3 | 75.33 ± 15.01 | 75.33 ± 15.01 | 2.5 (2/3 seeds) "
        "| 5.5 ± 0.7 (2/3 seeds) | 10.0 ± 2.8 (2/3 seeds) | 7 ± 3 | 3.0 | 6.0 "
        "| 12.0 |"
    )
    assert table.splitlines()[3] == (
        "| fedsam | 1 | 70.00 | 75.00 | 1.0 | 4.0 | 4.0 | 9 | 2.0 | 4.0 | 8.0 |"
    )


def test_without_a_target_there_are_no_to_target_columns(tmp_path: Path) -> None:
    three_fedavg_seeds(tmp_path)
    rows = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert not [key for key in rows[0] if key.endswith("-to-target")]
    assert report.markdown_table(rows, target=None).splitlines()[0] == (
        "| seeds | final acc. (%) | best acc. (%) | time (s) | MB up "
        "| MB down | MB total |"
    )


def test_a_seed_that_never_reaches_the_target_is_not_averaged_in(
    tmp_path: Path,
) -> None:
    three_fedavg_seeds(tmp_path)
    (row,) = report.summarize_groups(report.read_runs(tmp_path), target=0.95)
    assert row["seconds-to-target"] == [None, None, None]
    table = report.markdown_table([row], target=0.95)
    assert "| never | never | never |" in table


def test_simulated_seconds_make_a_column_and_a_plot_only_where_recorded(
    tmp_path: Path, monkeypatch
) -> None:
    three_fedavg_seeds(tmp_path, sim=True)
    write_run(tmp_path, "fedsam-1", {"strategy": "fedsam"}, [0.8], [3.0])  # no profile
    drawn: dict[str, dict] = {}
    monkeypatch.setattr(report, "plot_accuracy_against",
                        lambda series, path, *_, **__: drawn.update({path.name: series}))  # fmt: skip
    runs = report.read_runs(tmp_path)
    avg, sam = report.summarize_groups(runs, target=0.75)
    assert avg["sim-seconds-to-target"] == [50.0, 60.0, None]
    assert avg["sim-seconds-total"]["mean"] == pytest.approx(60.0)  # 90, 60, 30
    assert "sim-seconds-to-target" not in sam
    table = report.markdown_table([avg, sam], target=0.75).splitlines()
    assert "| sim. time to 75% (s) |" in table[0] and "| sim. time (s) |" in table[0]
    assert "| 55.0 ± 7.1 (2/3 seeds) |" in table[2]
    assert table[3].count("| n/a |") == 2  # fedsam ran without a profile
    report.plot_groups(runs, tmp_path / "plots")
    sim = drawn["accuracy-sim-seconds-all.png"]
    assert list(sim) == ["fedavg (mean of 3 seeds)"]  # fedsam is not on it
    x, accuracy = sim["fedavg (mean of 3 seeds)"]
    assert x == pytest.approx([40 / 3, 100 / 3, 60.0])  # means of the sums
    assert accuracy == pytest.approx([0.4, 0.63333, 0.75333], rel=1e-4)


def test_plots_against_wall_seconds_and_bytes_are_written(
    tmp_path: Path, monkeypatch
) -> None:
    three_fedavg_seeds(tmp_path / "runs")
    write_run(tmp_path / "runs", "fedsam-1", {"strategy": "fedsam"}, [0.6, 0.8],
              [4.0, 4.0])  # fmt: skip
    assert main(["report", str(tmp_path), "--target", "0.75"]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "accuracy-bytes-all.png", "accuracy-rounds-all.png",
        "accuracy-seconds-all.png",
    ]  # fmt: skip
    assert (tmp_path / "plots" / "accuracy-seconds-all.png").stat().st_size
    table = (tmp_path / "comparison.md").read_text()
    assert "sim." not in table  # no run had a network profile
    drawn: dict[str, dict] = {}
    monkeypatch.setattr(report, "plot_accuracy_against",
                        lambda series, path, *_, **__: drawn.update({path.name: series}))  # fmt: skip
    report.plot_groups(report.read_runs(tmp_path), tmp_path / "again")
    seconds = drawn["accuracy-seconds-all.png"]
    assert seconds["fedsam (1 seed)"] == ([4.0, 8.0], [0.6, 0.8])
    assert seconds["fedavg (mean of 3 seeds)"][0] == pytest.approx([4 / 3, 10 / 3, 6.0])
    assert drawn["accuracy-bytes-all.png"]["fedsam (1 seed)"] == (
        [4.0, 8.0],
        [0.6, 0.8],
    )


def test_the_bytes_the_shaped_links_carried_are_a_column_when_measured(
    tmp_path: Path,
) -> None:
    three_fedavg_seeds(tmp_path)
    for seed, scale in ((1, 1), (2, 2), (3, 3)):
        nodes = [{"node": i, "bytes-up": scale * MB, "bytes-down": 2 * scale * MB}
                 for i in range(2)]  # fmt: skip
        (tmp_path / f"fedavg-{seed}" / "network.json").write_text(json.dumps(
            {"profile": {}, "nodes": nodes, "wall-seconds": 60.0}))  # fmt: skip
    rows = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert rows[0]["link-mb"] == {"mean": 12.0, "std": 6.0}  # 6, 12, 18
    assert (
        report.markdown_table(rows, target=None)
        .splitlines()[0]
        .endswith("| MB total | link MB |")
    )
    (tmp_path / "fedavg-3" / "network.json").unlink()  # not every seed: no mean
    rows = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert "link-mb" not in rows[0]

"""An aggregation step's and a server update's results, checked as they come
back: a wrong one ends the run with one line naming the part by its import
path; a float64 server update is cast to the model's dtypes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from pollen.deployment.launch import report_outcome
from pollen.files import write_json
from pollen.runs.loops import NothingTrained, check_trained
from pollen.runs.results import RoundRecord
from pollen.strategies.aggregation import Aggregate, Mean, Rule
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.part_results import (
    PartError,
    checked_aggregate,
    checked_update,
    part_path,
)
from pollen.strategies.replies import error_line
from pollen.strategies.server_update import ServerUpdate
from pollen.strategies.strategy import Strategy, TrainOutcome, TrainRequest
from tests.conftest import client_update, runs_that_trained_nothing

CURRENT = {
    "w": np.array([[1.0, 2.0]], np.float32),
    "bn.num_batches_tracked": np.array(4, np.int64),
}
UPDATES = (
    client_update(0, {"w": np.array([[3.0, 2.0]], np.float32),
                      "bn.num_batches_tracked": np.array(6, np.int64)}),
    client_update(1, {"w": np.array([[5.0, 4.0]], np.float32),
                      "bn.num_batches_tracked": np.array(8, np.int64)}),
)  # fmt: skip


class UsersRule(Rule):
    """Stands for a user's aggregator (its module is not pollen's)."""

    def __init__(self, arrays: object = None, result: object = None) -> None:
        self.arrays, self.result = arrays, result

    def __call__(self, updates, keys, trained=()):
        if self.result is not None:
            return self.result
        return Aggregate(self.arrays, tuple(updates))


def aggregate_of(arrays: object, updates=UPDATES) -> Aggregate:
    return checked_aggregate(
        Aggregate(arrays, tuple(updates)), CURRENT, UPDATES, UsersRule()
    )


def test_a_part_is_named_by_its_import_path() -> None:
    assert part_path(Mean()) == "pollen.strategies.aggregation:Mean"
    assert part_path(UsersRule()).endswith("test_part_results:UsersRule")


def test_a_valid_aggregate_comes_back_in_float64_and_counters_may_stay_integer() -> (
    None
):
    arrays = {"w": np.array([[4.0, 3.0]], np.float32),
              "bn.num_batches_tracked": np.array(7, np.int64)}  # fmt: skip
    checked = aggregate_of(arrays)
    assert checked.arrays["w"].dtype == np.float64
    np.testing.assert_array_equal(checked.arrays["w"], [[4.0, 3.0]])
    assert checked.arrays["bn.num_batches_tracked"].dtype == np.int64
    assert checked.updates == UPDATES


@pytest.mark.parametrize(
    ("arrays", "said"),
    [
        (
            {"w": np.array([[4, 3]], np.int8), "bn.num_batches_tracked": np.array(7)},
            "returned entry 'w' as int8; an aggregate of float entries is float64",
        ),
        (
            {"w": np.zeros((2, 1)), "bn.num_batches_tracked": np.array(7)},
            "returned entry 'w' of shape [2, 1]; the model's is [1, 2]",
        ),
        (
            {"w": np.zeros((1, 2))},
            "returned no entry 'bn.num_batches_tracked'; expected every one of the "
            "2 shared entries",
        ),
        (
            {
                **dict.fromkeys(CURRENT, np.zeros(())),
                "w": np.zeros((1, 2)),
                "extra": np.zeros(1),
            },
            "returned entries the round did not send, 'extra'",
        ),
        (
            {"w": [[4.0, 3.0]], "bn.num_batches_tracked": np.array(7)},
            "returned entry 'w' as a list; expected a numpy array of numbers",
        ),
        (
            {"w": np.array([[np.nan, 3.0]]), "bn.num_batches_tracked": np.array(7)},
            "returned NaN or infinity in entry 'w' from finite updates",
        ),
    ],
    ids=["int8", "shape", "missing", "extra", "list", "nan"],
)
def test_a_wrong_aggregate_is_refused_in_one_line_naming_the_aggregator(
    arrays: dict, said: str
) -> None:
    with pytest.raises(PartError) as refused:
        aggregate_of(arrays)
    line = str(refused.value)
    assert line.startswith(f"aggregator {part_path(UsersRule())!r} ")
    assert said in line and "\n" not in line


def test_an_aggregate_that_is_not_one_or_uses_foreign_updates_is_refused() -> None:
    with pytest.raises(
        PartError, match=r"returned a dict; expected pollen\.strategies"
    ):
        checked_aggregate({"w": 1}, CURRENT, UPDATES, UsersRule())
    stranger = client_update(9, dict(CURRENT))
    with pytest.raises(PartError, match="returned updates of clients the round did"):
        aggregate_of(dict(CURRENT), updates=(stranger,))


class Float64Update(ServerUpdate):
    """A user's server update that forgot `cast_like`."""

    def apply(self, current, aggregate, trained):
        return dict(aggregate.arrays)


def test_a_float64_server_update_is_cast_to_the_models_dtypes() -> None:
    """float32 weights and the int64 counter come back as the model keeps
    them (the counter rounded), where every next reply was rejected before."""
    result = {"w": np.array([[0.1, 2.5]]), "bn.num_batches_tracked": np.array(6.6)}
    checked = checked_update(result, CURRENT, Float64Update())
    assert checked["w"].dtype == np.float32
    np.testing.assert_array_equal(checked["w"], np.array([[0.1, 2.5]], np.float32))
    assert checked["bn.num_batches_tracked"].dtype == np.int64
    assert checked["bn.num_batches_tracked"] == 7


@pytest.mark.parametrize(
    ("result", "said"),
    [
        ({"w": np.zeros((1, 2))},
         "returned no entry 'bn.num_batches_tracked'; expected every one of the 2 "
         "shared entries"),
        ({"w": np.zeros(2), "bn.num_batches_tracked": np.array(7)},
         "returned entry 'w' of shape [2]; the model's is [1, 2]"),
        ({"w": np.full((1, 2), np.inf), "bn.num_batches_tracked": np.array(7)},
         "returned NaN or infinity in entry 'w' from a finite aggregate"),
        ([np.zeros((1, 2))], "returned a list; expected a dict of the next shared"),
    ],
    ids=["dropped", "shape", "inf", "list"],
)  # fmt: skip
def test_a_wrong_server_update_is_refused_naming_it(result: object, said: str) -> None:
    with pytest.raises(PartError) as refused:
        checked_update(result, CURRENT, Float64Update())
    who = f"server update {part_path(Float64Update())!r} "
    assert str(refused.value).startswith(who)
    assert said in str(refused.value)


def test_pollens_own_update_leaves_nan_to_the_divergence_check() -> None:
    """A correct part made to diverge (server-lr too high) is stopped by the
    global model's test, whose message names that setting."""
    result = {"w": np.full((1, 2), np.nan, np.float32),
              "bn.num_batches_tracked": np.array(7)}  # fmt: skip
    assert np.isnan(checked_update(result, CURRENT, FedAvgUpdate())["w"]).all()


def round_request(current: dict) -> TrainRequest:
    return TrainRequest(1, [], [0, 1], dict(current), tuple(current), None, 0)


def test_the_strategy_checks_its_aggregators_result() -> None:
    """An int8 aggregate zeroed the model without a word before."""
    int8 = {key: np.zeros(value.shape, np.int8) for key, value in CURRENT.items()}
    strategy = Strategy(num_clients=2, client_frac=1.0, seed=0,
                        server_update=FedAvgUpdate(), aggregator=UsersRule(int8))  # fmt: skip
    outcome = TrainOutcome(updates=list(UPDATES))
    with pytest.raises(PartError, match="returned entry 'w' as int8"):
        strategy.finish(round_request(CURRENT), outcome)
    strategy = Strategy(num_clients=2, client_frac=1.0, seed=0,
                        server_update=Float64Update())  # fmt: skip
    finished = strategy.finish(round_request(CURRENT), outcome)
    assert isinstance(finished.arrays, ArrayRecord)
    w = finished.arrays["w"]
    assert isinstance(w, Array) and w.numpy().dtype == np.float32
    np.testing.assert_array_equal(w.numpy(), [[4.0, 3.0]])


def record(number: int, skipped: bool, failures: list[str]) -> RoundRecord:
    return RoundRecord(round=number, accuracy=0.1, loss=2.3, lr=0.05, seconds=1.0,
                       bytes_up=0, bytes_down=0, skipped=skipped,
                       failures=failures)  # fmt: skip


TRACEBACK = (
    "node 17: <class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::"
    'ClientAppActor.run() (pid=1)\n  File "x.py", line 3, in f\n    g()\n'
    "ValueError: optimizer got an empty parameter list\n\nThe above exception was "
    "the direct cause of the following exception:\n\n"
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException "
    "occurred. Message: optimizer got an empty parameter list'>"
)


def test_a_run_of_none_but_skipped_rounds_fails_naming_the_first_error() -> None:
    history = [record(1, True, [TRACEBACK, "node 18: other"]), record(2, True, [])]
    with pytest.raises(NothingTrained) as failed:
        check_trained(history)
    assert str(failed.value) == (
        "no round used a reply: all 2 rounds were skipped and the model is as it "
        "started; the first failure: ValueError: optimizer got an empty parameter list"
    )
    check_trained([*history, record(3, False, [])])  # one round trained: a run
    check_trained([])  # a run of no rounds is refused earlier (settings)


@pytest.mark.parametrize(
    ("reason", "line"),
    [
        (TRACEBACK, "ValueError: optimizer got an empty parameter list"),
        ("node 3: entry 'w' is float32[2], expected float64[2]",
         "node 3: entry 'w' is float32[2], expected float64[2]"),
        ("Traceback\ntorch.OutOfMemoryError: CUDA out of memory",
         "OutOfMemoryError: CUDA out of memory"),
        ("x" * 400, "x" * 297 + "..."),
        ("Traceback\n  File x\nAssertionError", "AssertionError"),
    ],
    ids=["traceback", "one-line", "dotted", "long", "no-message"],
)  # fmt: skip
def test_an_error_reply_is_told_by_the_exception_it_names(
    reason: str, line: str
) -> None:
    assert error_line(reason) == line
    assert not re.search(r"\n", error_line(reason))


def test_the_suites_guard_finds_a_run_completed_with_every_round_skipped(
    tmp_path: Path,
) -> None:
    """What tests/conftest.py checks of every run the suite made."""
    for name, skipped in (("untrained", 2), ("partly", 1)):
        (tmp_path / "out" / name).mkdir(parents=True)
        write_json(tmp_path / "out" / name / "summary.json",
                   {"status": "completed", "rounds": 2, "skipped-rounds": skipped})  # fmt: skip
    assert runs_that_trained_nothing(tmp_path) == [tmp_path / "out" / "untrained"]
    shutil.rmtree(tmp_path / "out")  # else the guard, at the session's end, fails


def test_the_last_line_counts_the_skipped_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = {"status": "completed", "rounds": 10, "skipped-rounds": 3,
               "final-accuracy": 0.9, "best-accuracy": 0.91, "best-round": 9,
               "total-seconds": 12.0}  # fmt: skip
    write_json(tmp_path / "summary.json", summary)
    assert report_outcome(tmp_path, 15.0).completed
    assert capsys.readouterr().out.startswith(
        "pollen: completed 10 rounds (3 skipped, the model unchanged in them), "
        "final accuracy 90.00%"
    )

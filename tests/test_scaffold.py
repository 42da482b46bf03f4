"""SCAFFOLD: the client's corrected steps and control variate, the server's
c, by hand over two rounds with partial participation; what travels; what
is refused."""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from pollen.protocol import CLIENT, CONTROL, scaffold_state_key
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import Mean
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.sampling import Roster
from pollen.strategies.scaffold import ServerControl
from pollen.task.objectives import ControlTerm
from pollen.task.train import ClientOptimizer, OptimizerStep
from tests.conftest import PROJECT, client_update, reply_from
from tests.rounds import fedavg


def local_round(
    context: Context, client: int, x: float, c: float, target: float
) -> tuple[float, float]:
    """Two SGD steps (lr 0.5, no momentum) on f_k = (theta - target)^2 / 2
    with SCAFFOLD's correction; the trained theta and Delta c_k."""
    theta = nn.Parameter(torch.tensor([x], dtype=torch.float64))
    term = ControlTerm(momentum=0.0)
    content = RecordDict(
        {
            CONTROL: ArrayRecord({"w": Array(np.array([c]))}),
            "config": ConfigRecord({"lr": 0.5}),
        }
    )
    term.load(context, client, {"w": theta}, content)
    optimizer = torch.optim.SGD([theta], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        (0.5 * (theta - target) ** 2).sum().backward()
        term.add_gradients({"w": theta})
        optimizer.step()
    term.save(context, client, {"w": theta})
    delta = term.reply_records()[CONTROL]["w"].numpy()
    return float(theta.detach()[0]), float(delta[0])


def own_variate(context: Context, client: int) -> float:
    return float(context.state[scaffold_state_key(client)]["w"].numpy()[0])


def server_round(
    control: ServerControl, x: float, results: dict[int, tuple[float, float]]
) -> float:
    """The next model (FedAvg, equal weights) and, in `control`, the next c."""
    updates = [
        client_update(k, {"w": np.array([y])}, records={CONTROL: {"w": np.array([dc])}})
        for k, (y, dc) in sorted(results.items())
    ]
    current = {"w": np.array([x])}
    model = FedAvgUpdate().apply(current, Mean()(updates, current), lambda _: ("w",))
    control.update(updates)
    return float(model["w"][0])


def test_two_rounds_with_partial_participation_by_hand() -> None:
    """N = 3 clients with targets 1, -3 (and a third never sampled).

    Round 1 (clients 0, 1; x = 0, c = c_k = 0): client 0 steps 0 -> 0.5 ->
    0.75, so c_0 = (0 - 0.75) / (0.5 x 2) = -0.75; client 1 steps 0 -> -1.5
    -> -2.25, c_1 = 2.25. Server: x = (0.75 - 2.25) / 2 = -0.75, c = (-0.75
    + 2.25) / 3 = 0.5.
    Round 2 (client 0 only; x = -0.75): its gradient theta - 1 is corrected
    by c - c_0 = 1.25: -0.75 -> -0.5 -> -0.375; c_0 = -0.75 - 0.5 +
    (-0.75 + 0.375) / 1 = -1.625, Delta c_0 = -0.875. Server: c = 0.5 -
    0.875 / 3, the mean of the three clients' variates (-1.625, 2.25, 0).
    """
    context = Context(1, 1, {}, RecordDict(), {})
    control = ServerControl({"w": np.zeros(1)}, num_clients=3)

    first = {
        0: local_round(context, 0, 0.0, 0.0, 1.0),
        1: local_round(context, 1, 0.0, 0.0, -3.0),
    }
    assert first[0] == pytest.approx((0.75, -0.75))
    assert first[1] == pytest.approx((-2.25, 2.25))
    x = server_round(control, 0.0, first)
    assert x == pytest.approx(-0.75) and control.c["w"][0] == pytest.approx(0.5)

    second = {0: local_round(context, 0, x, float(control.c["w"][0]), 1.0)}
    assert second[0] == pytest.approx((-0.375, -0.875))
    assert own_variate(context, 0) == pytest.approx(-1.625)
    assert own_variate(context, 1) == pytest.approx(2.25)
    server_round(control, x, second)
    assert control.c["w"][0] == pytest.approx(0.5 - 0.875 / 3)
    assert control.c["w"][0] == pytest.approx((-1.625 + 2.25 + 0.0) / 3)


def test_momentum_divides_by_the_effective_steps() -> None:
    """With momentum 0.5 and no data gradient, a correction of c - c_k = 1
    moves theta by -lr (1 + 1.5) over two steps; with a = 2.5 the mean
    gradient (x - y) / (lr a) is 1 again, so c_k^+ = 0 - 1 + 1 = 0."""
    context = Context(1, 1, {}, RecordDict(), {})
    theta = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    term = ControlTerm(momentum=0.5)
    content = RecordDict(
        {
            CONTROL: ArrayRecord({"w": Array(np.array([1.0]))}),
            "config": ConfigRecord({"lr": 0.1}),
        }
    )
    term.load(context, 0, {"w": theta}, content)
    optimizer = torch.optim.SGD([theta], lr=0.1, momentum=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        (0.0 * theta).sum().backward()
        term.add_gradients({"w": theta})
        optimizer.step()
    assert float(theta.detach()[0]) == pytest.approx(-0.25)
    term.save(context, 0, {"w": theta})
    # c_0^+ = 0 - 1 + 1 = 0: the correction was exactly what c asked for
    assert own_variate(context, 0) == pytest.approx(0.0)
    assert term.reply_records()[CONTROL]["w"].numpy()[0] == pytest.approx(0.0)


def test_a_message_without_the_control_variate_is_refused() -> None:
    context = Context(1, 1, {}, RecordDict(), {})
    theta = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="lacks the server's control variate"):
        ControlTerm(0.0).load(
            context, 0, {"w": theta}, RecordDict({"config": ConfigRecord({"lr": 0.1})})
        )


def test_server_control_checkpoints_and_refuses_a_foreign_state() -> None:
    control = ServerControl({"w": np.zeros(2, np.float32)}, num_clients=2)
    control.c["w"][:] = [1.5, -2.0]
    again = ServerControl({"w": np.zeros(2, np.float32)}, num_clients=2)
    again.load_state_arrays({"m/w": np.zeros(2), **control.state_arrays()})
    np.testing.assert_array_equal(again.c["w"], [1.5, -2.0])
    with pytest.raises(ValueError, match="no SCAFFOLD control variate"):
        again.load_state_arrays({"h/w": np.zeros(2)})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"strategy": "scaffold", "aggregator": "median"},
            r"allowed with scaffold: mean",
        ),
        ({"strategy": "scaffold", "mode": "async"}, r"synchronous rounds"),
        (
            {"strategy": "scaffold", "client-optimizer": "adam"},
            r"allowed: client-optimizer='sgd'",
        ),
    ],
)
def test_refused_combinations_name_the_reason(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"num-clients": 10, "client-frac": 1.0, **overrides})


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_sends_c_counts_its_bytes_and_needs_delta_c_back() -> None:
    """c travels with every training message and Delta c_k with every reply,
    both counted; a reply without Delta c_k is rejected; c moves by the
    accepted ones over N = 2."""
    roster = Roster.from_nodes({101: (0, 2), 202: (1, 2)}, 2)
    control = ServerControl({"w": np.zeros(3, np.float32)}, num_clients=2)
    strategy = fedavg(
        roster=roster, num_clients=2, client_frac=1.0, seed=0, server_state=control
    )
    model = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    messages = strategy.configure_train(1, model, ConfigRecord({"lr": 0.1}))
    assert all(set(m.content[CONTROL]) == {"w"} for m in messages)
    size = model.count_bytes()  # c is shaped like the model here
    assert control.record().count_bytes() == size
    assert strategy.sent[1].bytes_down == 2 * 2 * size  # model and c, two clients

    def reply(client: int, node: int, delta_c: float | None) -> object:
        records = {
            "arrays": ArrayRecord({"w": Array(np.ones(3, np.float32))}),
            "metrics": MetricRecord({"num-examples": 1}),
            "client": ConfigRecord({CLIENT: client}),
        }
        if delta_c is not None:
            records[CONTROL] = ArrayRecord(
                {"w": Array(np.full(3, delta_c, np.float32))}
            )
        return reply_from(node, RecordDict(records))

    strategy.aggregate_train(1, [reply(0, 101, 4.0), reply(1, 202, None)])
    outcome = strategy.traffic[1]
    assert [u.client for u in outcome.updates] == [0]
    assert "lacks its 'control' record" in outcome.failures[0]
    # client 0: model and Delta c; client 1: its model only
    assert outcome.bytes_up == 3 * size
    np.testing.assert_allclose(control.c["w"], [2.0, 2.0, 2.0])  # 4 / N


class Scalar(nn.Module):
    """theta, one number, for the loss (theta - 0)^2 / 2 (its gradient is theta)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))


@functools.cache
def momentum_study() -> ModuleType:
    """benchmarks/scaffold_momentum.py (a script, not a package: loaded by path)."""
    path = PROJECT / "benchmarks" / "scaffold_momentum.py"
    spec = importlib.util.spec_from_file_location("scaffold_momentum", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def two_steps(term: ControlTerm, momentum: float, outside: bool) -> tuple[float, float]:
    """Two steps of rate 0.1 from theta = 0 with c - c_k = 1 (c = 1, c_k = 0):
    the trained theta and c_k^+."""
    model, context = Scalar(), Context(1, 1, {}, RecordDict(), {})
    content = RecordDict(
        {
            CONTROL: ArrayRecord({"w": Array(np.array([1.0]))}),
            "config": ConfigRecord({"lr": 0.1}),
        }
    )
    term.load(context, 0, {"w": model.w}, content)
    optimizer = ClientOptimizer("sgd", 0.1, momentum, 0.0)
    rule = (momentum_study().StepThenCorrect if outside else OptimizerStep)(model, optimizer, 0.0, *(
        (term,) if outside else ()))  # fmt: skip
    for _ in range(2):
        rule.zero_grad()
        (0.5 * model.w**2).sum().backward()
        term.add_gradients({"w": model.w})
        rule.step()
    term.save(context, 0, {"w": model.w})
    return float(model.w.detach()[0]), own_variate(context, 0)


def test_three_ways_of_scaffold_with_momentum_by_hand() -> None:
    """docs/algorithms.md, "SCAFFOLD and momentum", on one number (gradient
    theta, lr 0.1, c - c_k = 1, two steps):

    (a) pollen's, the correction inside momentum 0.5's buffer: d1 = 0 + 1,
    m1 = 1, theta1 = -0.1; d2 = -0.1 + 1, m2 = 0.5 + 0.9 = 1.4, theta2 =
    -0.24; a = 1.5 + 1 = 2.5, c_k^+ = 0 - 1 + 0.24 / (0.1 x 2.5) = -0.04,
    the a-weighted mean of the data gradients (1.5 x 0 + 1 x -0.1) / 2.5.
    (b) NIID-Bench's, the correction after each momentum step: m1 = 0,
    theta1 = 0 - 0.1 x 1 = -0.1; m2 = -0.1, theta2 = -0.1 + 0.01 - 0.1 =
    -0.19; c_k^+ = -1 + 0.19 / (0.1 x 2) = -0.05: (a / K) times (a)'s
    estimate, the momentum's amplification of the data gradient.
    (c) plain SGD: theta1 = -0.1, theta2 = -0.1 - 0.1 (-0.1 + 1) = -0.19,
    c_k^+ = -0.05; without momentum (a) and (b) are one update.
    """
    study = momentum_study()
    OutsideControl = study.OutsideControl
    assert two_steps(ControlTerm(0.5), 0.5, outside=False) == pytest.approx(
        (-0.24, -0.04)
    )
    assert two_steps(OutsideControl(0.5), 0.5, outside=True) == pytest.approx(
        (-0.19, -0.05)
    )
    plain = two_steps(ControlTerm(0.0), 0.0, outside=False)
    assert plain == pytest.approx((-0.19, -0.05))
    assert two_steps(OutsideControl(0.0), 0.0, outside=True) == pytest.approx(plain)

"""FedOpt (sgd/FedAvgM, adagrad, adam, yogi) and FedDyn's server against hand
computations on two clients and tiny arrays; BatchNorm entries never stepped."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from pollen.protocol import CLIENT as CLIENT_KEY
from pollen.strategies.sampling import Roster
from pollen.task.models import build_model
from pollen.task.sharing import Sharing
from tests.conftest import reply_from
from tests.rounds import Harness, fedavg, feddyn, fedopt

pytestmark = pytest.mark.usefixtures("task_identity")


def arrays(**entries) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in entries.items()})


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def reply(client: int, record: ArrayRecord, examples: int) -> Message:
    content = RecordDict(
        {
            "arrays": record,
            "metrics": MetricRecord({"num-examples": examples, "train-loss": 0.5}),
            "client": ConfigRecord({CLIENT_KEY: client}),
        }
    )
    return reply_from(client + 1, content)


def base(num_clients: int = 2, **extra) -> dict:
    roster = Roster.from_nodes(
        {c + 1: (c, num_clients) for c in range(num_clients)}, num_clients
    )
    return {
        "roster": roster,
        "num_clients": num_clients,
        "client_frac": 1.0,
        "seed": 0,
        **extra,
    }


def play(strategy: Harness, server_round: int, current: ArrayRecord, replies) -> dict:
    """One round: configure (remember the global model), then aggregate."""
    strategy.configure_train(server_round, current, ConfigRecord())
    out = strategy.aggregate_train(server_round, replies)
    return {k: out[k].numpy() for k in out}


# Round 1 and 2 below: x = [1, 2]; client 0 (1 example) moves by [1, 0],
# client 1 (3 examples) by [0, 2], so Delta = [1/4, 3/2] in both rounds.
DELTA = np.array([0.25, 1.5])


def two_rounds(strategy: Harness) -> tuple[np.ndarray, np.ndarray]:
    x0 = f32(1.0, 2.0)
    x1 = play(strategy, 1, arrays(w=x0), [
        reply(0, arrays(w=x0 + f32(1, 0)), 1), reply(1, arrays(w=x0 + f32(0, 2)), 3),
    ])["w"]  # fmt: skip
    x2 = play(strategy, 2, arrays(w=x1), [
        reply(0, arrays(w=x1 + f32(1, 0)), 1), reply(1, arrays(w=x1 + f32(0, 2)), 3),
    ])["w"]  # fmt: skip
    return x1, x2


def test_sgd_with_lr_one_and_no_momentum_equals_fedavg() -> None:
    rng = np.random.default_rng(0)
    current = arrays(w=rng.random(50, np.float32), b=rng.random(3, np.float32))
    replies = [
        reply(c, arrays(w=rng.random(50, np.float32), b=rng.random(3, np.float32)), n)
        for c, n in ((0, 7), (1, 13))
    ]
    avg = play(fedavg(**base()), 1, current, replies)
    sgd = play(fedopt(optimizer="sgd", server_lr=1.0, **base()), 1, current, replies)
    for key in avg:
        assert sgd[key].dtype == np.float32
        np.testing.assert_allclose(sgd[key], avg[key], rtol=1e-7, atol=0)


def test_fedavgm_by_hand() -> None:
    x1, x2 = two_rounds(fedopt(optimizer="sgd", server_lr=0.5, momentum=0.9, **base()))
    np.testing.assert_allclose(x1, [1.125, 2.75], rtol=1e-6)  # v = Delta
    np.testing.assert_allclose(x2, [1.3625, 4.175], rtol=1e-6)  # v = 1.9 Delta


@pytest.mark.parametrize(
    ("optimizer", "bias", "m", "v"),
    [
        # m_t and v_t as multiples of Delta and Delta^2 after rounds 1 and 2
        ("adagrad", False, (0.1, 0.19), (1.0, 2.0)),
        ("adam", False, (0.1, 0.19), (0.01, 0.0199)),
        ("yogi", False, (0.1, 0.19), (0.01, 0.02)),  # v - 0.01 D^2 sign(v - D^2)
        # bias correction: m / (1 - b1^t), v / (1 - b2^t) (adagrad: m only)
        ("adam", True, (1.0, 0.19 / 0.19), (1.0, 0.0199 / 0.0199)),
        ("yogi", True, (1.0, 1.0), (1.0, 0.02 / 0.0199)),
        ("adagrad", True, (1.0, 1.0), (1.0, 2.0)),
    ],
)
def test_adaptive_server_optimizers_by_hand(optimizer, bias, m, v) -> None:
    lr, tau = 0.1, 1e-3
    strategy = fedopt(
        optimizer=optimizer, server_lr=lr, beta1=0.9, beta2=0.99, tau=tau,
        bias_correction=bias, **base(),
    )  # fmt: skip
    x1, x2 = two_rounds(strategy)
    step = [
        lr * mt * DELTA / (np.sqrt(vt) * np.abs(DELTA) + tau)
        for mt, vt in zip(m, v, strict=True)
    ]
    np.testing.assert_allclose(x1, f32(1.0, 2.0) + step[0], rtol=1e-6)
    np.testing.assert_allclose(x2, x1 + step[1], rtol=1e-6)


def bn_models() -> list[torch.nn.Module]:
    models = [build_model("mlp-bn", (1, 4, 4), 3, seed) for seed in (1, 2, 3)]
    for i, model in enumerate(models):
        model[2].running_mean.fill_(float(i))
        model[2].running_var.fill_(1.0 + i)
        model[2].num_batches_tracked.fill_(10 * i)
        with torch.no_grad():
            model[2].weight.uniform_(0.5, 1.5)
    return models


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "yogi"])
@pytest.mark.parametrize("policy", ["shared", "silobn"])
def test_fedopt_averages_batchnorm_statistics_and_never_steps_them(
    optimizer, policy
) -> None:
    server, c0, c1 = bn_models()
    sharing = Sharing.of(policy, server)
    strategy = fedopt(
        optimizer=optimizer, server_lr=0.3, momentum=0.5, **base(sharing=sharing)
    )
    shared = sharing.shared
    send = lambda m: ArrayRecord({k: m.state_dict()[k] for k in shared})  # noqa: E731
    out = play(
        strategy,
        1,
        ArrayRecord(server.state_dict()),
        [reply(0, send(c0), 1), reply(1, send(c1), 3)],
    )
    stepped = set(strategy.m) | set(strategy.v)
    assert stepped and not any("running" in k or "num_batches" in k for k in stepped)
    if policy == "shared":
        np.testing.assert_allclose(out["2.running_mean"], 0.25 * 1 + 0.75 * 2)
        assert out["2.num_batches_tracked"].dtype == np.int64
        assert int(out["2.num_batches_tracked"]) == 18  # 0.25 * 10 + 0.75 * 20
    else:  # SiloBN: the server keeps its own (unused) statistics, clients theirs
        np.testing.assert_array_equal(
            out["2.running_mean"], server[2].running_mean.numpy()
        )
    assert all(v.dtype in (np.float32, np.int64) for v in out.values())


def test_feddyn_server_state_over_two_rounds_with_partial_participation() -> None:
    # 3 clients, alpha 0.5; round 1: clients 0, 1; round 2: clients 1, 2.
    strategy = feddyn(alpha=0.5, **base(num_clients=3))
    x1 = play(strategy, 1, arrays(w=f32(0.0)), [
        reply(0, arrays(w=f32(1.0)), 10), reply(1, arrays(w=f32(3.0)), 99),
    ])["w"]  # fmt: skip
    # h = -0.5 * (1/3) * (1 + 3) = -2/3; theta = 2 - h / 0.5 = 10/3 (unweighted mean)
    np.testing.assert_allclose(strategy.h["w"], [-2 / 3])
    np.testing.assert_allclose(x1, [10 / 3], rtol=1e-6)
    x2 = play(strategy, 2, arrays(w=x1), [
        reply(1, arrays(w=f32(4.0)), 5), reply(2, arrays(w=f32(2.0)), 5),
    ])["w"]  # fmt: skip
    prev = float(x1[0])
    h2 = -2 / 3 - 0.5 / 3 * ((4.0 - prev) + (2.0 - prev))
    np.testing.assert_allclose(strategy.h["w"], [h2], rtol=1e-6)
    np.testing.assert_allclose(x2, [3.0 - h2 / 0.5], rtol=1e-6)  # about 37/9


def test_feddyn_participants_scale() -> None:
    strategy = feddyn(alpha=0.5, h_scale="participants", **base(num_clients=3))
    x1 = play(strategy, 1, arrays(w=f32(0.0)), [
        reply(0, arrays(w=f32(1.0)), 1), reply(1, arrays(w=f32(3.0)), 1),
    ])["w"]  # fmt: skip
    np.testing.assert_allclose(strategy.h["w"], [-1.0])  # -0.5 * (1/2) * 4
    np.testing.assert_allclose(x1, [4.0])


@pytest.mark.parametrize("exclude_bn", [True, False])
def test_feddyn_never_corrects_bn_statistics(exclude_bn) -> None:
    server, c0, c1 = bn_models()
    sharing = Sharing.of("shared", server)
    strategy = feddyn(alpha=0.1, exclude_bn=exclude_bn, **base(sharing=sharing))
    out = play(strategy, 1, ArrayRecord(server.state_dict()), [
        reply(0, ArrayRecord(c0.state_dict()), 1), reply(1, ArrayRecord(c1.state_dict()), 9),
    ])  # fmt: skip
    np.testing.assert_allclose(out["2.running_mean"], 1.5)  # uniform, uncorrected
    assert int(out["2.num_batches_tracked"]) == 15
    plain_bn_weight = 0.5 * (c0[2].weight + c1[2].weight).detach().numpy()
    corrected = not np.allclose(out["2.weight"], plain_bn_weight)
    assert corrected is not exclude_bn
    assert "1.weight" in strategy.h and ("2.weight" in strategy.h) is not exclude_bn
    assert not any("running" in k for k in strategy.h)


def test_malformed_and_non_finite_replies_are_rejected_round_goes_on() -> None:
    strategy = fedavg(
        **base(
            num_clients=3,
        )
    )
    current = arrays(w=f32(1.0, 1.0))
    out = play(strategy, 1, current, [
        reply(0, arrays(w=f32(3.0, 3.0)), 1),
        reply(1, arrays(w=f32(math.nan, 0.0)), 1),
        reply(2, arrays(w=np.zeros(3, np.float32)), 1),
    ])  # fmt: skip
    np.testing.assert_array_equal(out["w"], f32(3.0, 3.0))
    failures = " ".join(strategy.traffic[1].failures)
    assert "not finite" in failures and "expected float32[2]" in failures
    assert strategy.trained_clients == {0}


@pytest.mark.parametrize(
    "make",
    [
        lambda: fedopt(optimizer="adam", server_lr=0.1, **base()),
        lambda: fedopt(optimizer="sgd", server_lr=0.5, momentum=0.9, **base()),
        lambda: feddyn(alpha=0.1, **base()),
    ],
    ids=["adam", "fedavgm", "feddyn"],
)
def test_server_state_survives_a_checkpoint_round_trip(make) -> None:
    """Round 2 from a fresh strategy loaded with round 1's state equals round 2
    of the strategy that never stopped."""
    x0 = f32(1.0, 2.0)
    first = make()
    x1 = play(first, 1, arrays(w=x0), [
        reply(0, arrays(w=x0 + f32(1, 0)), 1), reply(1, arrays(w=x0 + f32(0, 2)), 3),
    ])["w"]  # fmt: skip
    state = first.state_arrays()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    round_two = [
        reply(0, arrays(w=x1 + f32(1, 0)), 1), reply(1, arrays(w=x1 + f32(0, 2)), 3),
    ]  # fmt: skip
    resumed = make()
    resumed.load_state_arrays(state)
    expected = play(first, 2, arrays(w=x1), round_two)["w"]
    np.testing.assert_array_equal(
        play(resumed, 2, arrays(w=x1), round_two)["w"], expected
    )
    fresh = play(make(), 2, arrays(w=x1), round_two)["w"]
    assert not np.array_equal(fresh, expected)  # the state mattered

"""FedProto (Tan et al. 2022): the client's pull to the global prototypes and
its prototypes by hand, the server's mean of them, what travels, and what
FedProto refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import (
    CLIENT,
    PROTOTYPE_CENTERS,
    PROTOTYPE_COUNTS,
    PROTOTYPE_KNOWN,
    PROTOTYPE_SUMS,
    PROTOTYPES,
)
from pollen.settings import Settings, SettingsError
from pollen.strategies.personal import PersonalEvaluation
from pollen.strategies.prototypes import ServerPrototypes
from pollen.strategies.sampling import Participants, Roster
from pollen.task.fedproto import NearestPrototype, PrototypeDistance, nearest_prototype
from pollen.task.models import build_model
from pollen.task.node_data import NodeData
from pollen.task.objective_parts import FedProto, Plain
from pollen.task.objectives import LocalObjective
from pollen.task.sharing import Sharing
from pollen.task.train import ClientOptimizer, no_preprocess, train_local
from tests.conftest import client_update, reply_from
from tests.rounds import fedavg
from tests.test_schedule import tiny_model
from tests.test_sharing import message, run_config

X = torch.linspace(-1, 1, 24).reshape(8, 3)
Y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])


def representation(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """tiny_model's body, written out: the input of its classifier."""
    return model[1](model[0](x))


class ReadsTheServer(Plain):
    """A user's objective whose term would read the received model."""

    reads_the_server = True


class UsersFedProto(FedProto):
    """A user's variant of FedProto: its server still keeps prototypes."""


def loaded(
    model: nn.Module, centers: torch.Tensor, known: list[float]
) -> PrototypeDistance:
    term = PrototypeDistance(2.0)
    sent = ArrayRecord(
        {PROTOTYPE_CENTERS: centers, PROTOTYPE_KNOWN: torch.tensor(known)}
    )
    context = Context(1, 1, {}, RecordDict(), {})
    term.load(context, 0, model, tiny_model, RecordDict({PROTOTYPES: sent}))
    return term


def test_one_step_follows_the_data_loss_plus_lambda_times_the_pull() -> None:
    """One full-batch SGD step (lr 0.1, lambda 2): the parameters move by
    -lr times the gradient of CE + 2 mean((z - C_bar[y])^2), with class 1's
    examples pulled nowhere (no global prototype for it yet); the client's
    prototypes are the sums and counts of z per class, before the step."""
    model = tiny_model()
    centers = torch.tensor([[0.5, -0.5, 1.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    z = representation(model, X)
    goal = torch.where((Y == 0).unsqueeze(1), centers[Y], z.detach())
    loss = nn.functional.cross_entropy(model(X), Y) + 2.0 * ((z - goal) ** 2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = [
        p.detach() - 0.1 * g for p, g in zip(model.parameters(), grads, strict=True)
    ]
    sums = torch.stack([z[Y.eq(c)].sum(0) for c in (0, 1)]).detach()

    term = loaded(model, centers, [1.0, 0.0])
    train_local(
        model, X, Y, epochs=1, batch_size=8, preprocess=no_preprocess, seed=0,
        optimizer=ClientOptimizer("sgd", 0.1, 0.0),
        objective=LocalObjective(batch_term=term),
    )  # fmt: skip
    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want)
    reply = term.reply_records()[PROTOTYPES].to_torch_state_dict()
    torch.testing.assert_close(reply[PROTOTYPE_SUMS], sums)
    assert reply[PROTOTYPE_COUNTS].tolist() == [4.0, 4.0]


def test_no_global_prototype_adds_nothing() -> None:
    """Before the first round's prototypes the term is 0 with no gradient:
    the clients train on the data loss alone."""
    model = tiny_model()
    term = loaded(model, torch.zeros(2, 4), [0.0, 0.0])
    model(X)
    loss = term.loss(X, Y)
    assert float(loss.detach()) == 0.0
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)
    term.close()


def test_a_message_without_prototypes_is_refused() -> None:
    term = PrototypeDistance(1.0)
    context = Context(1, 1, {}, RecordDict(), {})
    with pytest.raises(ValueError, match="carries no 'prototypes' record"):
        term.load(context, 0, tiny_model(), tiny_model, RecordDict())


@pytest.mark.usefixtures("task_identity")
def test_the_client_app_replies_its_prototypes_and_no_model() -> None:
    """Through the ClientApp under the preset: no model entry travels, and
    the reply's prototypes count every training example once per epoch,
    by class, as the shard's labels do."""
    config = run_config(strategy="fedproto", **{"local-epochs": 2})
    width = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])[-1].in_features
    msg = message("train", ArrayRecord(), 1, 1)
    msg.content[PROTOTYPES] = ServerPrototypes(10, width, 2).record()
    reply = client_app.train(msg, Context(1, 1, {}, RecordDict(), config))
    assert len(reply.content["arrays"]) == 0
    prototypes = reply.content[PROTOTYPES]
    _, labels = NodeData(Settings.from_run_config(config)).train_shard(
        1, torch.device("cpu")
    )
    np.testing.assert_array_equal(
        prototypes[PROTOTYPE_COUNTS].numpy(),
        2 * np.bincount(labels.numpy(), minlength=10),
    )
    assert prototypes[PROTOTYPE_SUMS].numpy().shape == (10, width)


def test_a_reply_claiming_more_examples_than_it_trained_is_not_counted() -> None:
    server = ServerPrototypes(classes=2, width=1, local_epochs=2)
    honest = client_update(0, {}, 3.0, records=prototype_reply([[6], [0]], [6, 0]))
    inflated = client_update(1, {}, 3.0, records=prototype_reply([[0], [70]], [0, 7]))
    server.update([honest, inflated])
    np.testing.assert_allclose(server.centers, [[1], [0]])
    assert server.known.tolist() == [1.0, 0.0]


def prototype_reply(sums: list[list[float]], counts: list[float]) -> dict:
    return {
        PROTOTYPES: {
            PROTOTYPE_SUMS: np.array(sums, np.float32),
            PROTOTYPE_COUNTS: np.array(counts, np.float32),
        }
    }


def test_the_server_weighs_each_client_by_its_examples_of_the_class() -> None:
    """Class 0: sums (2, 2) over 2 and (4, 0) over 1 give (6, 2) / 3; class
    1: (3, 3) over 3 gives (1, 1); a later round without class 1 keeps it,
    and a count below 1 (a bad reply's -5) adds nothing."""
    server = ServerPrototypes(classes=3, width=2, local_epochs=1)
    updates = [
        client_update(
            0, {}, 2.0, records=prototype_reply([[2, 2], [0] * 2, [0] * 2], [2, 0, 0])
        ),
        client_update(
            1, {}, 4.0, records=prototype_reply([[4, 0], [3, 3], [0] * 2], [1, 3, 0])
        ),
    ]
    server.update(updates)
    np.testing.assert_allclose(server.centers, [[2, 2 / 3], [1, 1], [0, 0]], rtol=1e-6)
    assert server.known.tolist() == [1.0, 1.0, 0.0]
    bad = prototype_reply([[1, 1], [100, 100], [0, 0]], [1, -5, 0])
    server.update([client_update(0, {}, 1.0, records=bad)])
    np.testing.assert_allclose(server.centers, [[1, 1], [1, 1], [0, 0]], rtol=1e-6)


def test_the_prototypes_checkpoint_and_refuse_a_foreign_state() -> None:
    server = ServerPrototypes(classes=2, width=3, local_epochs=1)
    server.centers[1] = [1.0, 2.0, 3.0]
    server.known[1] = 1.0
    again = ServerPrototypes(classes=2, width=3, local_epochs=1)
    again.load_state_arrays({"m/w": np.zeros(2), **server.state_arrays()})
    np.testing.assert_array_equal(again.centers, server.centers)
    np.testing.assert_array_equal(again.known, [0.0, 1.0])
    with pytest.raises(ValueError, match="no FedProto prototypes"):
        again.load_state_arrays({"scaffold-c/w": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        ServerPrototypes(classes=2, width=4, local_epochs=1).load_state_arrays(
            server.state_arrays()
        )


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_sends_prototypes_and_needs_them_back() -> None:
    """The global prototypes travel with every training message and each
    reply's with it, both counted; a reply without them is rejected; they
    move by the accepted one."""
    roster = Roster.from_nodes({101: (0, 2), 202: (1, 2)}, 2)
    server = ServerPrototypes(classes=2, width=3, local_epochs=1)
    strategy = fedavg(
        roster=roster, num_clients=2, client_frac=1.0, seed=0, server_state=server
    )
    model = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    messages = strategy.configure_train(1, model, ConfigRecord({"lr": 0.1}))
    assert all(
        set(m.content[PROTOTYPES]) == {PROTOTYPE_CENTERS, PROTOTYPE_KNOWN}
        for m in messages
    )
    size = model.count_bytes() + server.record().count_bytes()
    assert strategy.sent[1].bytes_down == 2 * size

    def reply(client: int, node: int, with_prototypes: bool) -> object:
        records = {
            "arrays": ArrayRecord({"w": Array(np.ones(3, np.float32))}),
            "metrics": MetricRecord({"num-examples": 2}),
            "client": ConfigRecord({CLIENT: client}),
        }
        if with_prototypes:
            records[PROTOTYPES] = ArrayRecord(
                {
                    PROTOTYPE_SUMS: Array(np.full((2, 3), 4.0, np.float32)),
                    PROTOTYPE_COUNTS: Array(np.array([2.0, 0.0], np.float32)),
                }
            )
        return reply_from(node, RecordDict(records))

    strategy.aggregate_train(1, [reply(0, 101, True), reply(1, 202, False)])
    outcome = strategy.traffic[1]
    assert [u.client for u in outcome.updates] == [0]
    assert "lacks its 'prototypes' record" in outcome.failures[0]
    np.testing.assert_allclose(server.centers, [[2, 2, 2], [0, 0, 0]])
    assert server.known.tolist() == [1.0, 0.0]


@pytest.mark.usefixtures("task_identity")
def test_a_personal_evaluation_carries_the_prototypes_where_they_predict() -> None:
    """The evaluation messages carry the global prototypes (counted) beside
    the shared entries when clients predict by them, and nothing else when
    not."""
    roster = Roster.from_nodes({101: (0, 2), 202: (1, 2)}, 2)
    server = ServerPrototypes(classes=2, width=3, local_epochs=1)
    model = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    for predicts_by in (server, None):
        personal = PersonalEvaluation(Sharing.of("local", tiny_model()), 1, predicts_by)
        personal.record_trained([0, 1])
        asked = personal.configure(1, model, ConfigRecord(), Participants(roster))
        carried = [set(m.content) - {"arrays", "config"} for m in asked.messages]
        sent = server.record().count_bytes() if predicts_by else 0
        assert carried == [{PROTOTYPES} if predicts_by else set()] * 2
        assert asked.bytes_down == 2 * sent


def test_the_preset_shares_prototypes_only() -> None:
    s = Settings.from_run_config({"strategy": "fedproto"})
    assert (s.local_objective, s.sharing, s.proto_lambda) == ("fedproto", "local", 1.0)
    assert (s.personal_eval_every, s.proto_inference) == (1, "prototypes")


def test_fedproto_infers_by_prototypes_unless_told_and_nothing_else_does() -> None:
    shared = Settings.from_run_config({"local-objective": "fedproto"})
    # the global model is what the server tests; the prototypes' reading of
    # it is the clients' to report
    assert (shared.proto_inference, shared.personal_eval_every) == ("prototypes", 1)
    told = Settings.from_run_config(
        {"strategy": "fedproto", "proto-inference": "classifier"}
    )
    assert told.proto_inference == "classifier"
    assert Settings.from_run_config({}).proto_inference == "classifier"
    # the part says so, not its name: a user's FedProto infers as the paper's
    users = Settings.from_run_config(
        {"local-objective": "tests.test_fedproto:UsersFedProto", "sharing": "local"}
    )
    assert users.proto_inference == "prototypes"
    with pytest.raises(SettingsError, match=r"with local-objective='plain'.*allowed"):
        Settings.from_run_config({"proto-inference": "prototypes"})
    # where a personal evaluation could not read them, auto reads the classifier
    for beside in ({"ditto-lambda": 0.1}, {"personal-eval-every": 0},
                   {"sharing": "fedper", "fine-tune-epochs": 1}):  # fmt: skip
        settings = Settings.from_run_config({"local-objective": "fedproto", **beside})
        assert settings.proto_inference == "classifier", beside
    with pytest.raises(SettingsError, match=r"prototypes.* with a personal model"):
        Settings.from_run_config(
            {
                "local-objective": "fedproto",
                "ditto-lambda": 0.1,
                "proto-inference": "prototypes",
            }
        )


def test_the_nearest_global_prototype_is_the_prediction() -> None:
    """logit_j = -||z - C_bar^(j)||^2 by hand for two examples; a class with
    no global prototype is never predicted, however near its row."""
    model = tiny_model()
    x = X[:2]
    z = representation(model, x).detach()
    centers = torch.stack([z[1], z[0], z[0] + 0.01])
    known = torch.tensor([True, True, False])
    logits = NearestPrototype(model, centers, known)(x).detach()
    by_hand = -torch.tensor(
        [[((z[i] - centers[j]) ** 2).sum() for j in range(2)] for i in range(2)]
    )
    torch.testing.assert_close(logits[:, :2], by_hand)
    assert logits[:, 2].eq(float("-inf")).all()
    assert logits.argmax(1).tolist() == [1, 0]


def test_an_evaluation_without_prototypes_is_refused() -> None:
    with pytest.raises(ValueError, match="evaluation message carries no 'prototypes'"):
        nearest_prototype(tiny_model(), RecordDict())
    none_yet = ServerPrototypes(classes=2, width=4, local_epochs=1).record()
    with pytest.raises(ValueError, match="no class has a global prototype yet"):
        nearest_prototype(tiny_model(), RecordDict({PROTOTYPES: none_yet}))


@pytest.mark.usefixtures("task_identity")
def test_the_client_app_tests_its_model_by_the_prototypes_it_is_sent() -> None:
    """A personal evaluation under the preset: the client's own-shard
    accuracy is that of the nearest sent prototype to its model's
    representations (here every class's prototype is far away but that of
    the shard's most common class, so that class is every prediction)."""
    config = run_config(strategy="fedproto")
    _, labels = NodeData(Settings.from_run_config(config)).test_shard(
        1, torch.device("cpu")
    )
    common = int(labels.mode().values)
    width = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])[-1].in_features
    server = ServerPrototypes(10, width, 1)
    server.centers[:] = 1e3
    server.centers[common] = 0.0
    server.known[:] = 1.0
    msg = message("evaluate", ArrayRecord(), 1, 1)
    msg.content[PROTOTYPES] = server.record()
    reply = client_app.evaluate_personal(msg, Context(1, 1, {}, RecordDict(), config))
    share = float(labels.eq(common).float().mean())
    assert 0 < share < 1
    assert reply.content["metrics"]["local-accuracy"] == pytest.approx(share)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"aggregator": "median", "sharing": "all"}, r"allowed with fedproto: mean"),
        ({"mode": "async", "sharing": "all"}, r"the mean of one round's replies"),
        (
            {"dp": True, "model": "cnn-gn", "sharing": "all"},
            r"local-objective='fedproto' with dp=true",
        ),
        ({"client-execution": "cohort"}, r"client-execution='cohort'"),
        (
            {"model": "vgg16-lora", "data-set": "cifar10", "cache-features": False},
            r"not a LoRA head",
        ),
        (
            {"sharing": "all", "secure-aggregation": "secagg+"},
            r"'fedproto' with secure-aggregation",
        ),
        ({"secure-aggregation": "secagg+"}, r"sharing='local' with secure-aggregation"),
        ({"model": "logreg"}, r"trained layers below it"),
    ],
)
def test_refused_combinations_name_the_reason(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config(
            {"num-clients": 10, "client-frac": 1.0, "strategy": "fedproto", **overrides}
        )


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"server-update": "adam"}, "server-update='adam'"),
        ({"aggregator": "median"}, "aggregator='median'"),
        ({"update-norm-bound": 2.0}, "update-norm-bound"),
        ({"local-objective": "scaffold"}, "local-objective='scaffold'"),
        ({"local-objective": "moon"}, "local-objective='moon'"),
        ({"attack": "sign-flip", "attackers": 0.2}, "attack='sign-flip'"),
        ({"central-dp": "fixed"}, "central-dp"),
        ({"dp": True, "model": "cnn-gn"}, "dp=true"),
        ({"strategy": "ditto"}, "a personal model beside the global one"),
        ({"personal-eval-every": 0}, "personal-eval-every=0"),
        ({"strategy": "fedbuff"}, "mode='async'"),
        # a user's objective says so itself
        ({"local-objective": "tests.test_fedproto:ReadsTheServer"},
         "local-objective='tests.test_fedproto:ReadsTheServer'"),
    ],
)  # fmt: skip
def test_nothing_that_acts_on_the_shared_model_runs_with_sharing_local(
    overrides: dict, refused: str
) -> None:
    with pytest.raises(SettingsError, match=f"sharing='local' with {refused}"):
        Settings.from_run_config({"sharing": "local", **overrides})
    Settings.from_run_config({"sharing": "local"})  # local training alone runs

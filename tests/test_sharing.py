"""Sharing policies end to end on the ClientApp: local entries never travel,
in either direction, and survive between rounds in `context.state`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import CLIENT as CLIENT_KEY
from pollen.settings import Settings, SettingsError
from pollen.task.data import load_dataset
from pollen.task.models import build_model
from pollen.task.partition import client_test_indices, label_counts, partition_indices
from pollen.task.sharing import Sharing, entry_kinds
from pollen.task.train import training_only

pytestmark = pytest.mark.usefixtures("task_identity")

BN_STATS = {"2.running_mean", "2.running_var", "2.num_batches_tracked"}
BN_AFFINE = {"2.weight", "2.bias"}


class Oddly(nn.Module):
    """Names that lie: a Linear called `bn`, a BatchNorm called `fc`."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.Linear(3, 3)
        self.fc = nn.BatchNorm1d(3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)


def test_kinds_come_from_module_types_not_names() -> None:
    kinds = entry_kinds(Oddly())
    assert kinds["bn.weight"] == "weight" and kinds["fc.weight"] == "bn-affine"
    assert kinds["fc.running_var"] == kinds["fc.num_batches_tracked"] == "bn-stat"
    assert kinds["frozen.weight"] == "frozen"
    sharing = Sharing.of("fedbn", Oddly())
    assert set(sharing.shared) == {"bn.weight", "bn.bias"}
    assert "frozen.weight" not in sharing.shared + sharing.local


def test_policies_on_mlp_bn() -> None:
    model = build_model("mlp-bn", (1, 8, 8), 10, 0)
    everything = set(model.state_dict())
    shared = Sharing.of("shared", model)
    assert set(shared.shared) == everything and not shared.local
    fedbn = Sharing.of("fedbn", model)
    assert set(fedbn.local) == BN_STATS | BN_AFFINE
    assert set(fedbn.shared) == everything - BN_STATS - BN_AFFINE
    silobn = Sharing.of("silobn", model)
    assert set(silobn.local) == BN_STATS and set(silobn.shared) >= BN_AFFINE
    assert (
        set(silobn.trained_shared())
        == {"1.weight", "1.bias", "4.weight", "4.bias"} | BN_AFFINE
    )
    assert set(silobn.trained_shared(exclude_bn=True)) == {
        "1.weight",
        "1.bias",
        "4.weight",
        "4.bias",
    }


def run_config(**overrides) -> dict:
    config = {
        "data-set": "digits", "model": "mlp-bn", "num-clients": 2, "batch-size": 32,
        "lr": 0.05, "partition": "silos", "device": "cpu", **overrides,
    }  # fmt: skip
    return Settings.from_run_config(config).to_run_config()


def message(kind: str, arrays: ArrayRecord, client: int, server_round: int) -> Message:
    config = ConfigRecord(
        {"lr": 0.05, "server-round": server_round, CLIENT_KEY: client}
    )
    return Message(
        RecordDict({"arrays": arrays, "config": config}),
        dst_node_id=1,
        message_type=kind,
    )


def global_model(settings: dict) -> tuple[nn.Module, Sharing]:
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    return model, Sharing.of(settings["bn-policy"], model)


@pytest.mark.parametrize("policy", ["fedbn", "silobn"])
def test_local_entries_never_travel_and_survive_rounds(policy) -> None:
    settings = run_config(**{"bn-policy": policy})
    model, sharing = global_model(settings)
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    counts = []
    for rnd in (1, 2):
        reply = client_app.train(message("train", sent, 1, rnd), context)
        up = reply.content["arrays"]
        assert set(up) == set(sharing.shared)
        assert not set(up) & BN_STATS
        assert bool(set(up) & BN_AFFINE) is (policy == "silobn")
        local = context.state["local-1"]
        assert set(local) == set(sharing.local)
        counts.append(int(local["2.num_batches_tracked"].numpy()))
        sent = up
    # the counter kept counting: round 2 started from round 1's statistics
    assert counts[1] == 2 * counts[0] > 0
    assert "local-0" not in context.state  # client 0 did not train
    evaluation = client_app.evaluate_personal(message("evaluate", sent, 1, 2), context)
    metrics = evaluation.content["metrics"]
    assert 0 <= metrics["global-accuracy"] <= 1 and metrics["local-accuracy"] > 0.5
    # silo 1 holds classes 5-9 only: its own test shard is those classes
    assert metrics["num-examples"] < 0.6 * 360


def test_a_client_that_keeps_nothing_tests_the_global_model_on_its_own_shard():
    """Under FedAvg a client's own model is the global one: its own-shard
    accuracy is measured, its global-test accuracy left to the server."""
    settings = run_config(model="mlp")
    model = build_model("mlp", (1, 8, 8), 10, settings["seed"])
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord(model.state_dict())
    sent = client_app.train(message("train", sent, 1, 1), context).content["arrays"]
    metrics = client_app.evaluate_personal(
        message("evaluate", sent, 1, 2), context
    ).content["metrics"]
    assert np.isnan(metrics["global-accuracy"]) and np.isnan(metrics["global-loss"])
    assert 0.5 < metrics["local-accuracy"] <= 1 and metrics["num-examples"] > 0


def test_a_personal_evaluation_tests_on_the_global_set_unless_told_not_to():
    """Under FedPer a client's own model is not the global one: it is tested
    on the global test set too, unless `personal-global-test` is false; its
    own-shard numbers are the same either way."""
    metrics = []
    for whole in (True, False):
        settings = run_config(strategy="fedper", **{"personal-global-test": whole})
        model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
        sharing = Sharing.of("fedper", model)
        context = Context(1, 1, {}, RecordDict(), settings)
        sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
        sent = client_app.train(message("train", sent, 1, 1), context).content["arrays"]
        reply = client_app.evaluate_personal(message("evaluate", sent, 1, 2), context)
        metrics.append(dict(reply.content["metrics"]))
    assert 0 <= metrics[0]["global-accuracy"] <= 1
    assert np.isnan(metrics[1]["global-accuracy"]) and np.isnan(
        metrics[1]["global-loss"]
    )
    assert metrics[0]["local-accuracy"] == metrics[1]["local-accuracy"]
    assert metrics[0]["local-loss"] == metrics[1]["local-loss"]


def test_client_refuses_entries_its_policy_keeps_local() -> None:
    settings = run_config(**{"bn-policy": "fedbn"})
    model, _ = global_model(settings)
    context = Context(1, 1, {}, RecordDict(), settings)
    with pytest.raises(ValueError, match="sharing policy fedbn"):
        client_app.train(
            message("train", ArrayRecord(model.state_dict()), 0, 1), context
        )


def test_feddyn_state_is_per_client_and_only_for_trained_clients() -> None:
    settings = run_config(strategy="feddyn", **{"bn-policy": "shared"})
    model, sharing = global_model(settings)
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord(model.state_dict())
    reply = client_app.train(message("train", sent, 0, 1), context)
    h = context.state["feddyn-h-0"]
    assert "feddyn-h-1" not in context.state
    assert set(h) == set(sharing.trained_shared(exclude_bn=True))  # no BatchNorm
    theta_k = reply.content["arrays"]
    for name in h:  # h_0 = 0 - alpha (theta_k - theta_t)
        expected = -0.1 * (theta_k[name].numpy() - sent[name].numpy())
        np.testing.assert_allclose(h[name].numpy(), expected, rtol=1e-5, atol=1e-7)
    client_app.train(message("train", theta_k, 0, 2), context)
    assert not np.allclose(
        context.state["feddyn-h-0"]["1.weight"].numpy(), h["1.weight"].numpy()
    )


def test_test_shards_follow_training_label_mix_and_do_not_overlap() -> None:
    ds = load_dataset("digits", "unused", download=False)
    train = partition_indices(
        ds.y_train.numpy(), 10, 4, "pathological", classes_per_client=2, seed=3
    )
    counts = label_counts(ds.y_train.numpy(), train, 10)
    shards = client_test_indices(ds.y_test.numpy(), counts, seed=3)
    joined = np.concatenate(shards)
    assert len(joined) == len(set(joined.tolist()))
    for shard, row in zip(shards, counts, strict=True):
        classes = set(np.unique(ds.y_test.numpy()[shard]).tolist())
        assert classes <= set(np.flatnonzero(row).tolist())


def test_client_model_starts_local_entries_from_the_common_initialisation() -> None:
    settings = run_config(**{"bn-policy": "fedbn"})
    model, sharing = global_model(settings)
    fresh = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    for name in sharing.local:
        assert torch.equal(model.state_dict()[name], fresh.state_dict()[name])


@pytest.mark.parametrize(
    ("model_name", "shape"),
    [("mlp", (1, 8, 8)), ("mlp-bn", (1, 8, 8)), ("cnn", (1, 28, 28)),
     ("simple-cnn", (1, 28, 28)), ("mobilenet", (3, 32, 32))],
)  # fmt: skip
def test_fedper_keeps_the_classifier_local(model_name: str, shape: tuple) -> None:
    """The head is the last nn.Linear: the layer that outputs the classes."""
    model = build_model(model_name, shape, 10, 0)
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert last.out_features == 10
    fedper = Sharing.of("fedper", model)
    head = {k for k, kind in fedper.kinds.items() if kind == "head"}
    assert len(head) == 2 and set(fedper.local) == head
    assert set(fedper.shared) == set(model.state_dict()) - head
    assert not head & set(fedper.trained_shared())
    assert set(Sharing.of("shared", model).shared) == set(model.state_dict())
    lg = Sharing.of("lg", model)  # LG-FedAvg: FedPer's mirror
    assert set(lg.shared) == set(lg.trained_shared()) == head
    assert set(lg.local) == set(fedper.shared) - set(
        k for k, kind in fedper.kinds.items() if kind == "frozen"
    )


def test_fedper_head_stays_on_the_client_across_rounds() -> None:
    settings = run_config(sharing="fedper")
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of("fedper", model)
    assert set(sharing.local) == {"4.weight", "4.bias"}
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    heads = []
    for rnd in (1, 2):
        reply = client_app.train(message("train", sent, 1, rnd), context)
        assert set(reply.content["arrays"]) == set(sharing.shared)
        heads.append(context.state["local-1"]["4.weight"].numpy().copy())
        sent = reply.content["arrays"]
    assert not np.array_equal(heads[0], heads[1])  # round 2 trained round 1's head


def test_lg_fedavg_sends_the_classifier_and_keeps_the_representation() -> None:
    """LG-FedAvg's two rounds on one client: the reply carries the classifier
    alone; the body (BatchNorm's statistics too) stays in `context.state`,
    and round 2 trains from round 1's body, not the server's initial one."""
    settings = run_config(strategy="lg-fedavg")
    assert settings["sharing"] == "lg" and settings["personal-eval-every"] == 1
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of("lg", model)
    assert set(sharing.shared) == {"4.weight", "4.bias"}
    assert {"1.weight", "2.running_mean"} <= set(sharing.local)
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    bodies = []
    for rnd in (1, 2):
        reply = client_app.train(message("train", sent, 1, rnd), context)
        assert set(reply.content["arrays"]) == set(sharing.shared)
        bodies.append(context.state["local-1"]["1.weight"].numpy().copy())
        sent = reply.content["arrays"]
    initial = model.state_dict()["1.weight"].numpy()
    assert not np.allclose(bodies[0], initial)
    assert not np.allclose(bodies[1], bodies[0])


@pytest.mark.parametrize("strategy", ["fedper", "lg-fedavg"])
def test_head_sharings_are_refused_on_lora_heads(strategy: str) -> None:
    with pytest.raises(SettingsError, match="its classifier is a LoRA head"):
        Settings.from_run_config({"strategy": strategy, "model": "cnn-lora"})


def test_training_only_freezes_the_others_and_restores_them() -> None:
    model = build_model("mlp", (1, 8, 8), 10, 0)
    names = [n for n, _ in model.named_parameters()]
    with training_only(model, names[:2]):
        assert [p.requires_grad for p in model.parameters()] == [True, True] + [
            False
        ] * (len(names) - 2)
    assert all(p.requires_grad for p in model.parameters())


def test_fedrep_trains_the_head_first_then_the_body() -> None:
    """Round 1 of FedRep on one client: the body it sends and the classifier
    it keeps both moved, and the classifier differs from FedPer's (trained
    together with the body from the same start): the head phase ran."""
    settings = run_config(strategy="fedrep")
    assert settings["head-epochs"] == 2 and settings["sharing"] == "fedper"
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of("fedper", model)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    heads, bodies = {}, {}
    for name, config in (
        ("fedrep", settings),
        ("fedper", run_config(sharing="fedper")),
    ):
        context = Context(1, 1, {}, RecordDict(), config)
        reply = client_app.train(message("train", sent, 1, 1), context)
        heads[name] = context.state["local-1"]["4.weight"].numpy()
        bodies[name] = reply.content["arrays"]["1.weight"].numpy()
    initial = model.state_dict()
    assert not np.allclose(heads["fedrep"], initial["4.weight"].numpy())
    assert not np.allclose(bodies["fedrep"], initial["1.weight"].numpy())
    assert not np.allclose(heads["fedrep"], heads["fedper"])


def test_head_epochs_need_a_local_classifier() -> None:
    with pytest.raises(SettingsError, match="set sharing='fedper'"):
        Settings.from_run_config({"head-epochs": 1})
    with pytest.raises(SettingsError, match="head-epochs with dp=true"):
        Settings.from_run_config({"strategy": "fedrep", "dp": True, "model": "cnn-gn"})


def test_ditto_keeps_a_personal_model_and_evaluates_it() -> None:
    """The reply is exactly FedAvg's (Ditto's personal step touches nothing
    that travels); the personal model v_k stays in the client's state, moved
    from the received model, and is what the personal evaluation tests."""
    model = build_model("mlp-bn", (1, 8, 8), 10, 845)
    sent = ArrayRecord(dict(model.state_dict()))
    replies, contexts = {}, {}
    for name, overrides in (("fedavg", {}), ("ditto", {"strategy": "ditto"})):
        contexts[name] = Context(1, 1, {}, RecordDict(), run_config(**overrides))
        replies[name] = client_app.train(message("train", sent, 1, 1), contexts[name])
    for key in sent:
        np.testing.assert_array_equal(
            replies["fedavg"].content["arrays"][key].numpy(),
            replies["ditto"].content["arrays"][key].numpy(),
        )
    personal = contexts["ditto"].state["ditto-1"]
    assert set(personal) == set(model.state_dict())
    assert not np.allclose(personal["1.weight"].numpy(), sent["1.weight"].numpy())
    assert "ditto-1" not in contexts["fedavg"].state
    global_model = replies["ditto"].content["arrays"]
    scores = {}
    for name in ("fedavg", "ditto"):
        reply = client_app.evaluate_personal(
            message("evaluate", global_model, 1, 1), contexts[name]
        )
        scores[name] = reply.content["metrics"]["global-loss"]
    assert scores["ditto"] != scores["fedavg"]  # v_k, not the global model


def test_ditto_refuses_dp_and_lora_sharing() -> None:
    with pytest.raises(SettingsError, match="ditto-lambda with dp=true"):
        Settings.from_run_config({"strategy": "ditto", "dp": True, "model": "cnn-gn"})
    with pytest.raises(SettingsError, match="ditto-lambda with a LoRA sharing"):
        Settings.from_run_config(
            {"strategy": "ditto", "sharing": "lora-a", "model": "cnn-lora"}
        )

"""A cohort's messages and the ClientApp's cohort handler: one message per
node out, one reply per client back, and the replies a node's cohort gives
equal those its clients give one after another."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from pollen import client_app
from pollen.common.cohorts import (
    CLIENTS,
    COHORT_TRAIN,
    member_views,
    pack,
    packed_reply,
    unpack,
)
from pollen.protocol import (
    ARRAYS,
    CLIENT,
    CONFIG,
    CONTROL,
    LR,
    METRICS,
    SERVER_ROUND,
    feddyn_state_key,
    local_entries_key,
    scaffold_state_key,
)
from pollen.settings import Settings, SettingsError
from pollen.strategies.cohort_grid import CohortGrid
from pollen.strategies.strategy import addressed
from pollen.task.client_state import ClientStateError
from pollen.task.models import build_model
from pollen.task.sharing import Sharing
from tests.conftest import reply_from

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.arange(4, dtype=np.float32))})


def training_messages(owner: dict[int, int], records: dict | None = None):
    return addressed(
        MessageType.TRAIN, sorted(owner), MODEL, {LR: 0.1}, 3, owner, records
    )


def test_pack_sends_each_node_one_message_naming_its_clients() -> None:
    control = ArrayRecord({"w": Array(np.ones(4, np.float32))})
    sent = training_messages({0: 11, 1: 12, 2: 11, 5: 11}, {CONTROL: control})
    packed = pack(sent)
    assert [m.metadata.dst_node_id for m in packed] == [11, 12]
    assert {m.metadata.message_type for m in packed} == {COHORT_TRAIN}
    first = packed[0].content
    assert list(first[CONFIG][CLIENTS]) == [0, 2, 5]
    assert CLIENT not in first[CONFIG] and first[CONFIG][SERVER_ROUND] == 3
    assert first[ARRAYS] is MODEL and first[CONTROL] is control  # once per node
    views = member_views(packed[0])
    assert [int(v.content[CONFIG][CLIENT]) for v in views] == [0, 2, 5]
    assert all(v.metadata.message_type == MessageType.TRAIN for v in views)
    assert dict(views[1].content[CONFIG]) == dict(sent[2].content[CONFIG])


def test_pack_refuses_members_sent_different_models() -> None:
    sent = training_messages({0: 11, 1: 11})
    sent[1].content[ARRAYS] = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    with pytest.raises(ValueError, match="differ beyond the client"):
        pack(sent)


def member_reply(view: Message, value: float) -> Message:
    client = int(view.content[CONFIG][CLIENT])
    arrays = ArrayRecord({"w": Array(np.full(4, value, np.float32))})
    metrics = MetricRecord({"num-examples": 10 + client})
    return Message(RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=view)


def test_a_packed_reply_unpacks_into_each_members_own_reply() -> None:
    sent = training_messages({0: 11, 1: 12, 2: 11})
    cohort = pack(sent)[0]
    views = member_views(cohort)
    answered = [(v, member_reply(v, float(i))) for i, v in enumerate(views)]
    node_reply = reply_from(11, packed_reply(cohort, answered).content, COHORT_TRAIN)
    replies = unpack(sent, [node_reply])
    assert [r.metadata.src_node_id for r in replies] == [11, 11]
    assert [r.content[METRICS]["num-examples"] for r in replies] == [10, 12]
    assert replies[1].content[ARRAYS]["w"].numpy().tolist() == [1.0] * 4
    assert {r.metadata.message_type for r in replies} == {MessageType.TRAIN}


def test_a_nodes_error_is_each_members_error_and_silence_stays_silent() -> None:
    sent = training_messages({0: 11, 1: 12, 2: 11})
    failed = Message(Error(code=0, reason="out of memory"), reply_to=pack(sent)[0])
    replies = unpack(sent, [failed])
    assert len(replies) == 2 and all(r.has_error() for r in replies)
    assert {r.error.reason for r in replies} == {"out of memory"}
    only_one = packed_reply(pack(sent)[0], [])  # a reply naming no member
    assert unpack(sent, [reply_from(11, only_one.content, COHORT_TRAIN)]) == []


def test_a_member_that_failed_alone_is_that_clients_error_only() -> None:
    """A member's own failure (its state, its shard) travels as its
    `<client>/error` record and comes out as its error reply, with the
    reason in Flower's form; its node's other members keep their replies."""
    sent = training_messages({0: 11, 1: 11, 2: 11})
    cohort = pack(sent)[0]
    views = member_views(cohort)
    answered = [(v, member_reply(v, 0.0)) for v in (views[0], views[2])]
    packed = packed_reply(cohort, answered, {1: ValueError("no step")})
    replies = unpack(sent, [reply_from(11, packed.content, COHORT_TRAIN)])
    assert [r.has_error() for r in replies] == [False, True, False]
    assert replies[1].error.reason == "<class 'ValueError'>:<'no step'>"
    assert replies[1].metadata.reply_to_message_id == sent[1].metadata.message_id
    assert [replies[k].content[METRICS]["num-examples"] for k in (0, 2)] == [10, 12]


class EchoGrid:
    """A grid whose nodes answer each cohort with its members' client ids."""

    def __init__(self) -> None:
        self.received: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        self.received = list(messages)
        out = []
        for msg in self.received:
            answered = [(v, member_reply(v, 0.0)) for v in member_views(msg)]
            node = msg.metadata.dst_node_id
            out.append(
                reply_from(node, packed_reply(msg, answered).content, COHORT_TRAIN)
            )
        return out


def test_the_cohort_grid_sends_per_node_and_answers_per_client() -> None:
    inner = EchoGrid()
    sent = training_messages({c: 20 + c % 3 for c in range(7)})
    replies = CohortGrid(inner).send_and_receive(sent, timeout=5)
    assert len(inner.received) == 3
    assert sorted(r.content[METRICS]["num-examples"] for r in replies) == [
        10 + c for c in range(7)
    ]


def run_config(**overrides) -> dict:
    config = {
        "data-set": "digits", "model": "mlp", "num-clients": 4, "batch-size": 16,
        "lr": 0.05, "partition": "niid", "alpha": 0.5, "min-size": 5,
        "device": "cpu", "local-epochs": 2, **overrides,
    }  # fmt: skip
    return Settings.from_run_config(config).to_run_config()


def server_messages(settings: dict, owner: dict[int, int], server_round: int):
    model = build_model(settings["model"], (1, 8, 8), 10, settings["seed"])
    policy = Settings.from_run_config(settings).sharing_policy
    state = model.state_dict()
    arrays = ArrayRecord({k: state[k] for k in Sharing.of(policy, model).shared})
    records = {}
    if settings["local-objective"] == "scaffold":
        control = {
            k: np.full(v.shape, 0.01, np.float32) for k, v in model.named_parameters()
        }
        records = {CONTROL: ArrayRecord({k: Array(v) for k, v in control.items()})}
    return addressed(
        MessageType.TRAIN, sorted(owner), arrays, {LR: 0.05}, server_round, owner,
        records,
    )  # fmt: skip


def assert_replies_equal(cohort: Message, sequential: list[Message]) -> None:
    for one in sequential:
        client = int(one.content["client"][CLIENT])
        for name, record in one.content.items():
            theirs = cohort.content[f"{client}/{name}"]
            if isinstance(record, ArrayRecord):
                for key in record:
                    np.testing.assert_allclose(
                        theirs[key].numpy(), record[key].numpy(), rtol=1e-5, atol=1e-6
                    )
            elif name == METRICS:
                for key, value in record.items():
                    if key != "train-seconds":
                        assert theirs[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert dict(theirs) == dict(record)


@pytest.mark.parametrize(
    ("strategy", "overrides"),
    [
        ("fedavg", {}),
        ("fedprox", {}),
        ("feddyn", {}),
        ("scaffold", {}),
        # FedProx under FedBN on these shards meets, at one step in float32,
        # a ReLU input that rounds to either side of 0: both trainings are
        # right and part by ~1e-3 (in float64 they agree to 1e-15)
        ("fedavg", {"model": "mlp-bn", "bn-policy": "fedbn"}),
        ("fedprox", {"model": "mlp-bn", "bn-policy": "silobn"}),
    ],
    ids=["fedavg", "fedprox", "feddyn", "scaffold", "mlp-bn-fedbn", "mlp-bn-silobn"],
)
def test_a_cohort_reply_equals_its_members_trained_one_by_one(
    strategy: str, overrides: dict
) -> None:
    """Two rounds on one node serving clients 0, 2 and 3 (the second reads
    FedDyn's h_k, SCAFFOLD's c_k or FedBN's BatchNorm entries that the first
    kept): the cohort handler's reply carries, per client, what `train`
    replies for it."""
    settings = run_config(strategy=strategy, **overrides)
    cohort_node = Context(1, 11, {}, RecordDict(), settings)
    one_by_one = Context(1, 11, {}, RecordDict(), settings)
    for server_round in (1, 2):
        sent = server_messages(settings, {0: 11, 2: 11, 3: 11}, server_round)
        (cohort,) = pack(sent)
        together = client_app.train_cohort(cohort, cohort_node)
        alone = [client_app.train(m, one_by_one) for m in sent]
        assert_replies_equal(together, alone)
    kept = {feddyn_state_key(0), scaffold_state_key(0), local_entries_key(0)}
    for key in kept & set(one_by_one.state):  # FedBN's: running statistics too
        for entry, array in one_by_one.state[key].items():
            np.testing.assert_allclose(
                cohort_node.state[key][entry].numpy(), array.numpy(), rtol=1e-5,
                atol=1e-6,
            )  # fmt: skip


def test_cohort_settings_refuse_what_a_cohort_cannot_reproduce() -> None:
    with pytest.raises(SettingsError, match="model='mobilenet': its dropout"):
        run_config(
            **{"client-execution": "cohort", "model": "mobilenet",
               "data-set": "cifar10", "augment": False}
        )  # fmt: skip
    with pytest.raises(SettingsError, match="dp=true: that training works on one "):
        run_config(**{"client-execution": "cohort", "model": "cnn-gn", "dp": True})
    with pytest.raises(SettingsError, match="mode='async'"):
        run_config(**{"client-execution": "cohort", "strategy": "fedbuff"})
    with pytest.raises(SettingsError, match="lora-dropout"):
        run_config(
            **{
                "client-execution": "cohort",
                "model": "vgg16-lora",
                "augment": False,
                "data-set": "cifar10",
            }
        )
    assert run_config(**{"client-execution": "cohort"})["client-execution"] == "cohort"
    assert run_config(**{"client-execution": "cohort", "model": "mlp-bn"})


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [
        ({"dp": True, "model": "cnn-gn"}, "dp=false"),
        ({"strategy": "fedrep", "head-epochs": 2}, "head-epochs=0"),
        ({"strategy": "ditto", "ditto-lambda": 0.1}, "ditto-lambda=0"),
        ({"strategy": "fedbuff"}, "mode='sync'"),
    ],
    ids=["dp", "fedrep", "ditto", "fedbuff"],
)
def test_each_cohort_refusal_says_what_is_allowed(
    overrides: dict, allowed: str
) -> None:
    """The refusals of one-model trainings and of FedBuff said "use ..."
    where their siblings (dropout) say "allowed: ...": each names the value
    that lifts it, beside sequential execution."""
    with pytest.raises(SettingsError) as refused:
        run_config(**{"client-execution": "cohort", **overrides})
    assert str(refused.value).endswith(
        f"; allowed: {allowed}, or client-execution='sequential'"
    ), str(refused.value)


def members_alone_and_together(settings: dict, sent: list[Message]):
    """Each message through `train` (a client whose training raises: its
    exception, as Flower would answer it) and all through `train_cohort`,
    on fresh node contexts; the cohort's reply unpacked per client."""
    alone: dict[int, Message | Exception] = {}
    one_by_one = Context(1, 11, {}, RecordDict(), settings)
    for message in sent:
        client = int(message.content[CONFIG][CLIENT])
        try:
            alone[client] = client_app.train(message, one_by_one)
        except Exception as err:
            alone[client] = err
    (cohort,) = pack(sent)
    together = client_app.train_cohort(
        cohort, Context(1, 11, {}, RecordDict(), settings)
    )
    unpacked = unpack(sent, [reply_from(11, together.content, COHORT_TRAIN)])
    return alone, together, unpacked


def test_a_shard_without_a_step_fails_only_its_client() -> None:
    """mlp-bn on digits, Dirichlet 0.1 over 50 clients with min-size 1:
    client 21 holds one example, and BatchNorm skips 1-sample batches, so
    it has no step. One by one only client 21 fails; in a cohort with 20
    and 22 too, and they train as they do alone."""
    settings = run_config(
        model="mlp-bn", **{"num-clients": 50, "alpha": 0.1, "min-size": 1}
    )
    sent = server_messages(settings, {20: 11, 21: 11, 22: 11}, 1)
    alone, together, unpacked = members_alone_and_together(settings, sent)
    assert isinstance(alone[21], ValueError)
    assert "a shard of 1 samples gives no training step" in str(alone[21])
    assert_replies_equal(together, [alone[20], alone[22]])
    assert [r.has_error() for r in unpacked] == [False, True, False]
    assert "a shard of 1 samples gives no training step" in unpacked[1].error.reason


def test_a_members_unreadable_state_fails_only_its_client(tmp_path) -> None:
    """FedDyn keeps h_k per client; client 3's kept file is not an npz. One
    by one only client 3 fails; in a cohort its node's clients 0 and 2
    still train and reply as they do alone."""
    settings = run_config(strategy="feddyn")
    (tmp_path / "client-3").mkdir()
    (tmp_path / "client-3" / "round-00001.run-1.npz").write_bytes(b"not an npz")
    owner = {0: 11, 2: 11, 3: 11}
    sent = server_messages(settings, owner, 2)
    for message in sent:
        message.content[CONFIG]["state-dir"] = str(tmp_path)
    alone, together, unpacked = members_alone_and_together(settings, sent)
    assert isinstance(alone[3], ClientStateError)
    assert "round-00001.run-1.npz" in str(alone[3])
    assert_replies_equal(together, [alone[0], alone[2]])
    assert [r.has_error() for r in unpacked] == [False, False, True]
    assert type(alone[3]).__name__ in unpacked[2].error.reason

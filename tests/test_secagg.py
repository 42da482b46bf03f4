"""SecAgg+: the arithmetic by hand and against Flower's, and whole rounds of
the protocol between the server's half and the ClientApp's stage handlers
(in this process), with dropouts, a wrong share and too few survivors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.secure_aggregation import quantization as flower_quantization

from pollen import client_app
from pollen.common import secagg
from pollen.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    CONFIG,
    CONTROL,
    LR,
    MASKED,
    METRICS,
    NUM_EXAMPLES,
    SECAGG,
    SECAGG_KEYS,
    SECAGG_NEXT,
    SECAGG_SHARES,
    SECAGG_UNMASK,
    SERVER_ROUND,
)
from pollen.settings import Settings, SettingsError
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.scaffold import ServerControl
from pollen.strategies.secure_round import SecureAggregation
from pollen.strategies.strategy import Strategy
from pollen.task import secagg_client

pytestmark = pytest.mark.usefixtures("task_identity")

PARAMS = secagg.SecAggParams(threshold=0.6, neighbours=1.0, clip=1.0, bits=16)
GLOBAL = {"w": np.array([0.5, -0.25, 0.0, 1.0], np.float32)}


# ---- the arithmetic --------------------------------------------------------


def test_quantize_is_within_one_step_and_dequantize_sums_exactly() -> None:
    rng = np.random.default_rng(0)
    values = [np.array([0.3, -0.7, 0.0]), np.array([0.1, 0.2, -0.9])]
    quanta = [secagg.quantize(v, 1.0, 8, rng)[0] for v in values]
    step = 2 / 2**8  # 2c / 2^bits
    for v, q in zip(values, quanta, strict=True):
        assert np.all(np.abs(secagg.dequantize(q, 1, 1.0, 8) - v) <= step)
    total = secagg.dequantize(quanta[0] + quanta[1], 2, 1.0, 8)
    assert np.all(np.abs(total - (values[0] + values[1])) <= 2 * step)


def test_quantize_counts_and_clips_values_outside_the_range() -> None:
    q, clipped = secagg.quantize(
        np.array([2.0, -3.0, 0.5]), 1.0, 8, np.random.default_rng(0)
    )
    assert clipped == 2
    assert q[0] == 2**8 and q[1] == 0  # +c and -c exactly


def test_quantize_on_the_grid_equals_flowers() -> None:
    """On values on the quantisation grid rounding is exact, so pollen's
    quanta and Flower's (`flwr.common.secure_aggregation.quantization`, its
    target range 2^bits) agree, and so do both dequantisations."""
    bits, clip = 10, 0.5
    grid_values = (np.arange(0, 2**bits + 1, 37) * (2 * clip / 2**bits)) - clip
    ours, _ = secagg.quantize(grid_values, clip, bits, np.random.default_rng(0))
    theirs = flower_quantization.quantize([grid_values], clip, 2**bits)[0]
    assert np.array_equal(ours.astype(np.int64), theirs.astype(np.int64))
    back = flower_quantization.dequantize([theirs], clip, 2**bits)[0]
    assert np.allclose(secagg.dequantize(ours, 1, clip, bits), back)


def test_the_ring_graph_is_symmetric_and_sized_by_the_share() -> None:
    full = secagg.ring_neighbours(5, 1.0)
    assert full[3] == (1, 2, 4, 5)
    sparse = secagg.ring_neighbours(10, 0.3)  # 2 ceil(0.3 * 9 / 2) = 4 each
    assert sparse[1] == (2, 3, 9, 10)
    for u, around in sparse.items():
        assert all(u in sparse[v] for v in around)
    assert secagg.threshold_for(5, 0.6) == 3 and secagg.threshold_for(2, 0.6) == 2


def test_pairwise_masks_cancel_and_wrap_modulo_2_32() -> None:
    a, b = secagg.new_private_key(), secagg.new_private_key()
    s_ab = secagg.pairwise_seed(a, secagg.public_bytes(b))
    assert s_ab == secagg.pairwise_seed(b, secagg.public_bytes(a))
    x = np.array([0, 2**32 - 1, 7], np.uint32)
    y = np.array([5, 1, 2**31], np.uint32)
    masked_x = secagg.add_mask(x, s_ab, secagg.pairwise_sign(1, 2))
    masked_y = secagg.add_mask(y, s_ab, secagg.pairwise_sign(2, 1))
    assert not np.array_equal(masked_x, x)
    assert np.array_equal(masked_x + masked_y, x + y)


# ---- rounds of the protocol -------------------------------------------------


def update_reply(msg: Message, arrays: dict, examples: int, records=None) -> Message:
    client = int(msg.content[CONFIG][CLIENT])
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            METRICS: MetricRecord({NUM_EXAMPLES: examples, "train-loss": 0.5}),
            CLIENT_RECORD: ConfigRecord({CLIENT: client}),
            **(records or {}),
        }
    )
    return Message(content, reply_to=msg)


class Federation:
    """Nodes answering in this process through the ClientApp's SecAgg+
    handlers; `train` replies with each client's given update. `silent`
    names the clients that stop answering from a stage on (a killed node);
    `tamper` may rewrite a reply. Keeps the masked vectors the server got."""

    def __init__(self, updates, examples, controls=None, silent=None, tamper=None):
        self.updates, self.examples, self.controls = updates, examples, controls
        self.silent = silent or {}
        self.tamper = tamper or (lambda stage, client, reply: reply)
        self.contexts: dict[int, Context] = {}
        self.vectors: dict[int, np.ndarray] = {}
        self.asked: list[tuple[int, str]] = []  # (round, stage) of each message

    def context(self, node: int) -> Context:
        return self.contexts.setdefault(
            node, Context(1, node, {}, RecordDict(), {})
        )  # fmt: skip

    def train(self, msg: Message, context: Context) -> Message:
        client = int(msg.content[CONFIG][CLIENT])
        records = {}
        if self.controls is not None:
            delta = {k: Array(v) for k, v in self.controls[client].items()}
            records[CONTROL] = ArrayRecord(delta)
        return update_reply(msg, self.updates[client], self.examples[client], records)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        handlers = {
            f"{MessageType.QUERY}.{SECAGG_KEYS}": secagg_client.advertise_keys,
            f"{MessageType.QUERY}.{SECAGG_SHARES}": secagg_client.share_keys,
            f"{MessageType.QUERY}.{SECAGG_UNMASK}": secagg_client.reveal_shares,
            MessageType.TRAIN: lambda m, c: secagg_client.secagg_mod(m, c, self.train),
        }
        replies = []
        for msg in messages:
            stage = msg.metadata.message_type
            client = int(msg.content[CONFIG][CLIENT])
            self.asked.append((int(msg.content[CONFIG][SERVER_ROUND]), stage))
            if client in self.silent.get(stage, ()):
                continue
            try:
                reply = handlers[stage](msg, self.context(msg.metadata.dst_node_id))
            except ValueError as err:  # as Flower answers a handler's exception
                replies.append(Message(Error(0, str(err)), reply_to=msg))
                continue
            reply = self.tamper(stage, client, reply)
            if stage == MessageType.TRAIN:
                self.vectors[client] = reply.content[MASKED][MASKED].numpy()
            replies.append(reply)
        return replies


def silent_from(stage: str, clients: set[int]) -> dict[str, set[int]]:
    """The clients that stop answering at `stage` and every stage after it."""
    order = [f"{MessageType.QUERY}.{SECAGG_KEYS}", f"{MessageType.QUERY}.{SECAGG_SHARES}",
             MessageType.TRAIN, f"{MessageType.QUERY}.{SECAGG_UNMASK}"]  # fmt: skip
    return {s: clients for s in order[order.index(stage) :]}


def secure_round(
    federation: Federation, count: int, control=None, uniform=False, params=PARAMS
):
    owner = {c: 100 + c % 2 for c in range(count)}  # two nodes serve them
    strategy = Strategy(
        num_clients=count, client_frac=1.0, seed=7, server_update=FedAvgUpdate(),
        server_state=control, secure=SecureAggregation(params, 7, uniform),
    )  # fmt: skip
    participants = Participants(Roster(owner), {c: 40 for c in range(count)})
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    request = strategy.configure_train(1, arrays, ConfigRecord({LR: 0.1}), participants)
    return strategy, strategy.secure.train(federation, strategy, request, 5.0)


def client_updates(count: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return {
        c: {"w": (GLOBAL["w"] + rng.uniform(-0.2, 0.2, 4)).astype(np.float32)}
        for c in range(count)
    }


def weighted_mean(updates, examples, clients) -> np.ndarray:
    total = sum(examples[c] for c in clients)
    return (
        sum(examples[c] * updates[c]["w"].astype(np.float64) for c in clients) / total
    )


def test_three_clients_unmask_to_the_weighted_mean_within_the_bound() -> None:
    updates, examples = client_updates(3), {0: 10, 1: 20, 2: 30}
    _, outcome = secure_round(Federation(updates, examples), 3)
    # by hand: 3 quanta of 2 / 2^16 each, times S / sum n_k = 40 / 60
    bound = 3 * (2 / 2**16) * 40 / 60
    assert outcome.report["secagg-error-bound"] == pytest.approx(bound)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.all(np.abs(got - weighted_mean(updates, examples, [0, 1, 2])) <= bound)
    assert outcome.report["secagg-survivors"] == 3
    assert outcome.report["secagg-clipped"] == 0
    assert [u.client for u in outcome.updates] == [0, 1, 2]
    assert outcome.failures == []


def test_a_client_dropped_after_sharing_leaves_the_survivors_mean() -> None:
    updates, examples = client_updates(3), {0: 10, 1: 20, 2: 30}
    federation = Federation(updates, examples, silent=silent_from("train", {2}))
    _, outcome = secure_round(federation, 3)
    bound = 2 * (2 / 2**16) * 40 / 30
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.all(np.abs(got - weighted_mean(updates, examples, [0, 1])) <= bound)
    assert outcome.report["secagg-dropped-after-sharing"] == 1
    assert any("no reply" in line for line in outcome.failures)


def test_a_client_lost_before_sharing_takes_no_part() -> None:
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    silent = silent_from(f"{MessageType.QUERY}.{SECAGG_SHARES}", {1})
    _, outcome = secure_round(Federation(updates, examples, silent=silent), 4)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, [0, 2, 3]), atol=1e-4)


def test_the_server_never_receives_an_update_unmasked(monkeypatch) -> None:
    """Every vector the server receives differs, in almost every entry, from
    the quantised update its client would send; the same check catches a
    client that skips the masks."""
    updates, examples = client_updates(3), {0: 10, 1: 20, 2: 30}

    def check(federation: Federation) -> None:
        for client, vector in federation.vectors.items():
            values = (updates[client]["w"].astype(np.float64) - GLOBAL["w"]) * (
                examples[client] / 40
            )
            rng = np.random.default_rng(np.random.SeedSequence([7, 1, client]))
            plain, _ = secagg.quantize(values, PARAMS.clip, PARAMS.bits, rng)
            plain = np.concatenate([plain, [examples[client], 0]]).astype(np.uint32)
            assert np.count_nonzero(vector == plain) <= 1, f"client {client} unmasked"

    honest = Federation(updates, examples)
    secure_round(honest, 3)
    assert len(honest.vectors) == 3
    check(honest)
    monkeypatch.setattr(secagg_client.secagg, "add_mask", lambda v, seed, sign: v)
    careless = Federation(updates, examples)
    secure_round(careless, 3)
    with pytest.raises(AssertionError, match="unmasked"):
        check(careless)


def test_a_wrong_share_is_found_and_left_out() -> None:
    updates, examples = client_updates(4), {c: 40 for c in range(4)}

    def corrupt(stage: str, client: int, reply: Message) -> Message:
        if stage.endswith(SECAGG_UNMASK) and client == 1:
            record = reply.content[SECAGG]
            seeds = list(record["seeds"])
            seeds[0] = seeds[0][:4] + bytes(len(seeds[0]) - 4)
            record["seeds"] = seeds
        return reply

    _, outcome = secure_round(Federation(updates, examples, tamper=corrupt), 4)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, range(4)), atol=1e-4)
    assert any("client 1: a revealed share is inconsistent" in f
               for f in outcome.failures)  # fmt: skip


def test_below_the_threshold_the_round_is_skipped_never_wrong() -> None:
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    federation = Federation(updates, examples, silent=silent_from("train", {1, 2}))
    _, outcome = secure_round(federation, 4)
    assert outcome.skipped
    assert any("secure round skipped" in line and "cannot be unmasked" in line
               for line in outcome.failures)  # fmt: skip


def test_a_malformed_vector_drops_its_client_and_the_round_goes_on() -> None:
    updates, examples = client_updates(4), {c: 40 for c in range(4)}

    def truncate(stage: str, client: int, reply: Message) -> Message:
        if stage == MessageType.TRAIN and client == 0:
            vector = reply.content[MASKED][MASKED].numpy()[:-1]
            reply.content[MASKED] = ArrayRecord({MASKED: Array(vector)})
        return reply

    _, outcome = secure_round(Federation(updates, examples, tamper=truncate), 4)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, [1, 2, 3]), atol=1e-4)
    assert any("expected uint32[6]" in line for line in outcome.failures)


def test_a_client_left_without_neighbours_is_dropped_before_it_shares() -> None:
    """Five clients on a ring of degree 2 (`secagg-neighbours` 0.5): clients
    0 and 2 (ids 1 and 3), the neighbours of client 1 (id 2), are lost at
    the keys stage. Client 1's own seed alone would mask its vector, and its
    own share would rebuild that seed: it is dropped before it shares, so
    the server never gets its vector; the other two are summed."""
    params = secagg.SecAggParams(threshold=0.6, neighbours=0.5, clip=1.0, bits=16)
    updates, examples = client_updates(5), {c: 40 for c in range(5)}
    silent = silent_from(f"{MessageType.QUERY}.{SECAGG_KEYS}", {0, 2})
    federation = Federation(updates, examples, silent=silent)
    _, outcome = secure_round(federation, 5, params=params)
    assert sorted(federation.vectors) == [3, 4]
    assert outcome.report["secagg-survivors"] == 2
    assert any("client 1: none of its neighbours sent keys" in f
               for f in outcome.failures)  # fmt: skip
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, [3, 4]), atol=1e-4)


def test_one_masked_vector_is_never_unmasked() -> None:
    """min-train-replies is 1 by default, but the sum of one vector is that
    client's update: with two of three clients silent from training on (or
    from the keys on, leaving the third no neighbour), the round is skipped."""
    updates, examples = client_updates(3), {c: 40 for c in range(3)}
    for stage in (MessageType.TRAIN, f"{MessageType.QUERY}.{SECAGG_KEYS}"):
        federation = Federation(updates, examples, silent=silent_from(stage, {1, 2}))
        _, outcome = secure_round(federation, 3)
        assert outcome.skipped and outcome.arrays is None, stage
        assert not any(stage.endswith(SECAGG_UNMASK) for _, stage in federation.asked)


def test_thresholds_by_hand_and_what_a_client_refuses() -> None:
    """ceil(share x holders), at least 2, at most all; 0.56 of 25 is 14 (the
    float product is 14.000000000000002). A client refuses a threshold its
    own share would meet, or one not above half its holders."""
    assert [secagg.threshold_for(h, 0.6) for h in (2, 3, 5, 10)] == [2, 2, 3, 6]
    assert secagg.threshold_for(25, 0.56) == 14
    assert secagg.threshold_for(4, 1.0) == 4
    with pytest.raises(ValueError, match="needs 2 holders"):
        secagg.threshold_for(1, 0.6)
    assert secagg.threshold_problem(2, 3) is None
    assert "at least 2" in secagg.threshold_problem(1, 1)
    for threshold, holders in ((1, 3), (2, 4), (5, 4)):
        assert "above half" in secagg.threshold_problem(threshold, holders)


def test_a_client_refuses_to_share_under_a_threshold_its_own_share_meets(
    monkeypatch,
) -> None:
    """A server that asks for threshold 1 (one share, its holder's own,
    would rebuild the client's seed) gets an error, not the shares."""
    updates, examples = client_updates(3), {c: 40 for c in range(3)}
    share_keys = secagg_client.share_keys

    def asked_for_one(msg: Message, context: Context) -> Message:
        msg.content[SECAGG]["threshold"] = 1
        return share_keys(msg, context)

    monkeypatch.setattr(secagg_client, "share_keys", asked_for_one)
    federation = Federation(updates, examples)
    _, outcome = secure_round(federation, 3)
    assert outcome.skipped and not federation.vectors
    assert sum("refusing to share my secrets" in f for f in outcome.failures) == 3


@pytest.mark.parametrize("stage", [SECAGG_SHARES, SECAGG_UNMASK])
def test_shares_that_are_not_bytes_drop_their_client_not_the_run(stage: str) -> None:
    """Strings where a stage 2 or 4 reply holds encrypted or revealed shares:
    that client is dropped (at stage 4 three honest holders of four still
    meet the threshold of 3), and the round goes on."""
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    field = "ciphertexts" if stage == SECAGG_SHARES else "seeds"

    def garble(at: str, client: int, reply: Message) -> Message:
        if at.endswith(stage) and client == 1:
            record = reply.content[SECAGG]
            record[field] = ["x"] * len(record[field])
        return reply

    _, outcome = secure_round(Federation(updates, examples, tamper=garble), 4)
    assert any("client 1: malformed" in f for f in outcome.failures)
    survivors = [0, 2, 3] if stage == SECAGG_SHARES else range(4)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, survivors), atol=1e-4)


def test_a_training_reply_for_a_client_that_did_not_share_is_rejected() -> None:
    """Node 100 serves clients 0, 2 and 4; client 2 is lost at the shares
    stage, so it is sent no training message. A reply naming it (to client
    0's message) is rejected as one for a client not asked, and the round
    sums the clients that answered for themselves."""
    updates, examples = client_updates(6), {c: 40 for c in range(6)}

    def rename(stage: str, client: int, reply: Message) -> Message:
        if stage == MessageType.TRAIN and client == 0:
            reply.content[CLIENT_RECORD] = ConfigRecord({CLIENT: 2})
        return reply

    silent = silent_from(f"{MessageType.QUERY}.{SECAGG_SHARES}", {2})
    federation = Federation(updates, examples, silent=silent, tamper=rename)
    _, outcome = secure_round(federation, 6)
    assert any("client 2 was not asked to train" in f for f in outcome.failures)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, [1, 3, 4, 5]), atol=1e-4)


def test_scaffolds_control_deltas_are_summed_securely() -> None:
    updates, examples = client_updates(3), {0: 10, 1: 20, 2: 30}
    deltas = {c: {"w": np.full(4, 0.1 * (c + 1), np.float32)} for c in range(3)}
    control = ServerControl({"w": GLOBAL["w"]}, num_clients=6)
    secure_round(Federation(updates, examples, controls=deltas), 3, control)
    # c = 0 + (0.1 + 0.2 + 0.3) / 6, within 3 quanta / 6
    assert np.allclose(control.c["w"], 0.1, atol=3 * PARAMS.quantum / 6 + 1e-7)


def test_a_uniform_mean_weighs_every_client_once() -> None:
    updates, examples = client_updates(3), {0: 10, 1: 20, 2: 30}
    _, outcome = secure_round(Federation(updates, examples), 3, uniform=True)
    plain = np.mean([updates[c]["w"].astype(np.float64) for c in range(3)], axis=0)
    got = outcome.arrays["w"].numpy().astype(np.float64)
    assert np.all(np.abs(got - plain) <= outcome.report["secagg-error-bound"])


def secure_rounds(federation: Federation, count: int, rounds: int, **options):
    """`rounds` secure FedAvg rounds of `count` clients (every client every
    round unless `client_frac` says otherwise), each from the last's model;
    `between(round)` runs before each round, `owner(round)` gives its roster."""
    between = options.pop("between", lambda server_round: None)
    client_frac = options.pop("client_frac", 1.0)
    owner = options.pop(
        "owner", lambda server_round: {c: 100 + c % 2 for c in range(count)}
    )
    strategy = Strategy(
        num_clients=count, client_frac=client_frac, seed=7, min_train_nodes=3,
        server_update=FedAvgUpdate(),
        secure=SecureAggregation(PARAMS, 7, False, rounds, **options),
    )  # fmt: skip
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    outcomes = []
    for server_round in range(1, rounds + 1):
        between(server_round)
        roster = Roster(owner(server_round))
        participants = Participants(roster, {c: 40 for c in range(count)})
        request = strategy.configure_train(
            server_round, arrays, ConfigRecord({LR: 0.1}), participants
        )
        outcomes.append(strategy.secure.train(federation, strategy, request, 5.0))
        arrays = outcomes[-1].arrays
    return outcomes


KEYS, SHARES = (
    f"{MessageType.QUERY}.{SECAGG_KEYS}",
    f"{MessageType.QUERY}.{SECAGG_SHARES}",
)
UNMASK = f"{MessageType.QUERY}.{SECAGG_UNMASK}"


def stages_of(federation: Federation, server_round: int) -> list[str]:
    """The stages a round's messages asked for, each once, in order."""
    asked = [stage for r, stage in federation.asked if r == server_round]
    return list(dict.fromkeys(asked))


def test_the_next_rounds_keys_and_shares_ride_on_this_rounds_exchanges(
    monkeypatch,
) -> None:
    """Round 1 runs all four stages; rounds 2 and 3 only training and
    unmask, with keys and shares of their own (fresh ones each round), and
    every round's mean is the plain weighted mean within its bound."""
    updates, examples = client_updates(4), {0: 10, 1: 20, 2: 30, 3: 40}
    federation = Federation(updates, examples)
    keys_seen = []
    original = secagg_client._new_keys

    def recording(context, client, server_round, record):
        keys = original(context, client, server_round, record)
        keys_seen.append((server_round, keys["mask-public"]))
        return keys

    monkeypatch.setattr(secagg_client, "_new_keys", recording)
    outcomes = secure_rounds(federation, 4, 3)
    assert stages_of(federation, 1) == [KEYS, SHARES, MessageType.TRAIN, UNMASK]
    assert stages_of(federation, 2) == stages_of(federation, 3) == [
        MessageType.TRAIN, UNMASK
    ]  # fmt: skip
    assert [o.report["secagg-set-up-ahead"] for o in outcomes] == [0.0, 1.0, 1.0]
    assert "secagg-keys-seconds" not in outcomes[1].report
    # 4 clients' keys for rounds 1, 2 and 3 (none for a round 4), all distinct
    assert sorted(r for r, _ in keys_seen) == [1] * 4 + [2] * 4 + [3] * 4
    assert len({key for _, key in keys_seen}) == 12
    expected = weighted_mean(updates, examples, range(4))
    for outcome in outcomes:
        got = outcome.arrays["w"].numpy().astype(np.float64)
        assert np.all(np.abs(got - expected) <= outcome.report["secagg-error-bound"])
        assert outcome.failures == []
    # round 3's secrets revealed and forgotten; nothing set up for a round 4
    assert all(len(c.state) == 0 for c in federation.contexts.values())


def test_setting_up_ahead_changes_when_not_what_the_rounds_sum() -> None:
    """Masks cancel and the rounding draw is seeded by (seed, round,
    client): three rounds with and without the overlap give equal models."""
    updates, examples = client_updates(4), {0: 10, 1: 20, 2: 30, 3: 40}
    overlapped = secure_rounds(Federation(updates, examples), 4, 3)
    stepwise = secure_rounds(Federation(updates, examples), 4, 3, ahead=False)
    assert [o.report["secagg-set-up-ahead"] for o in stepwise] == [0.0] * 3
    for a, b in zip(overlapped, stepwise, strict=True):
        assert np.array_equal(a.arrays["w"].numpy(), b.arrays["w"].numpy())


def test_a_client_lost_in_this_round_makes_the_next_round_set_itself_up() -> None:
    """Client 3 misses round 1's unmask (so shares nothing for round 2):
    round 2 runs its own keys and shares and client 3, back, takes part."""
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    federation = Federation(updates, examples)

    def between(server_round: int) -> None:
        federation.silent = {UNMASK: {3}} if server_round == 1 else {}

    first, second = secure_rounds(federation, 4, 2, between=between)
    assert any("no reply" in line for line in first.failures)
    assert stages_of(federation, 2) == [KEYS, SHARES, MessageType.TRAIN, UNMASK]
    assert second.report["secagg-survivors"] == 4
    # client 3's round-1 secrets, never revealed, went when it made round 2's
    assert all(len(c.state) == 0 for c in federation.contexts.values())
    got = second.arrays["w"].numpy().astype(np.float64)
    assert np.allclose(got, weighted_mean(updates, examples, range(4)), atol=1e-4)


def test_a_client_served_by_another_node_makes_the_next_round_set_itself_up() -> None:
    """Client 3's node restarted under a new ID between rounds (its keys
    made ahead are gone with the old process): round 2 sets itself up."""
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    federation = Federation(updates, examples)

    def owner(server_round: int) -> dict[int, int]:
        return {c: 100 + c % 2 + (50 if c == 3 and server_round == 2 else 0)
                for c in range(4)}  # fmt: skip

    _, second = secure_rounds(federation, 4, 2, owner=owner)
    assert stages_of(federation, 2) == [KEYS, SHARES, MessageType.TRAIN, UNMASK]
    assert second.report["secagg-survivors"] == 4 and second.failures == []


def test_a_repeated_next_round_key_drops_only_the_set_up_ahead() -> None:
    """Client 2 sends round 2's keys with one public key twice (its
    neighbours' stage 2 would fail on it): its round-1 vector still counts,
    its round-2 keys are dropped, and round 2 sets itself up with fresh ones."""
    updates, examples = client_updates(4), {c: 40 for c in range(4)}

    def repeat(stage: str, client: int, reply: Message) -> Message:
        if stage == MessageType.TRAIN and client == 2 and SECAGG_NEXT in reply.content:
            keys = reply.content[SECAGG_NEXT]
            keys["share-public"] = keys["mask-public"]
        return reply

    federation = Federation(updates, examples, tamper=repeat)
    first, second = secure_rounds(federation, 4, 2)
    assert first.report["secagg-survivors"] == 4
    assert any("client 2: a public key it sent is not its own alone" in line
               for line in first.failures)  # fmt: skip
    assert stages_of(federation, 2) == [KEYS, SHARES, MessageType.TRAIN, UNMASK]
    assert second.report["secagg-survivors"] == 4


def test_a_client_that_cannot_share_ahead_still_unmasks_this_round(
    monkeypatch,
) -> None:
    """A client whose next-round shares fail still reveals this round's
    (the round is not lost to the next one's set-up); the server names it
    and the next round sets itself up."""
    updates, examples = client_updates(4), {c: 40 for c in range(4)}
    original, failed = secagg_client._shares, []

    def failing(context, client, server_round, record):
        if client == 1 and server_round == 2 and not failed:  # ahead, in round 1
            failed.append(client)
            raise ValueError("secagg: the relayed public keys repeat (or name me)")
        return original(context, client, server_round, record)

    monkeypatch.setattr(secagg_client, "_shares", failing)
    federation = Federation(updates, examples)
    first, second = secure_rounds(federation, 4, 2)
    assert not first.skipped and first.report["secagg-survivors"] == 4
    assert any("client 1: it sent none" in line for line in first.failures)
    assert stages_of(federation, 2) == [KEYS, SHARES, MessageType.TRAIN, UNMASK]
    assert second.report["secagg-survivors"] == 4


def test_a_next_round_sampling_a_client_not_in_this_one_sets_itself_up() -> None:
    """4 of 6 clients a round (seed 7 samples [0, 2, 3, 4], [0, 1, 2, 4],
    [2, 3, 4, 5]): each next round samples a client outside the one before,
    so nothing is set up ahead and every round runs all four stages, with
    every sampled client taking part."""
    updates, examples = client_updates(6), {c: 40 for c in range(6)}
    federation = Federation(updates, examples)
    outcomes = secure_rounds(federation, 6, 3, client_frac=0.67)
    for server_round, outcome in enumerate(outcomes, start=1):
        assert outcome.report["secagg-set-up-ahead"] == 0.0
        assert stages_of(federation, server_round)[:2] == [KEYS, SHARES]
        assert outcome.report["secagg-survivors"] == 4
    asked = [stage for _, stage in federation.asked]
    assert asked.count(KEYS) == 12  # no keys made for a round they cannot serve


def test_the_clientapp_answers_every_stage() -> None:
    registered = {f"{MessageType.QUERY}.{a}" for a in
                  (SECAGG_KEYS, SECAGG_SHARES, SECAGG_UNMASK)}  # fmt: skip
    assert registered <= set(client_app.app._registered_funcs)
    assert secagg_client.secagg_mod in client_app.TRAIN_MODS


# ---- settings ----------------------------------------------------------------


def settings(**values) -> Settings:
    base = {"secure-aggregation": "secagg+", "num-clients": 10, "client-frac": 0.5}
    return Settings.from_run_config({**base, **values})


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"aggregator": "median"}, "needs each client's update"),
        ({"aggregator": "fednova"}, "needs each client's update"),
        ({"central-dp": "fixed"}, "needs each client's update"),
        ({"update-norm-bound": 2.0}, "needs each client's update"),
        ({"round-deadline": 30.0}, "cut the protocol between its stages"),
        ({"mode": "async"}, "no round whose clients mask together"),
        ({"client-execution": "cohort"}, "packs a node's clients"),
        ({"client-frac": 0.2}, "needs at least 3"),
        ({"secagg-bits": 30}, "overflows the 32-bit modulus"),
        ({"secagg-threshold": 0.5}, "secagg-threshold"),
    ],
)
def test_every_refused_combination_names_its_reason(values, reason) -> None:
    with pytest.raises(SettingsError, match=reason):
        settings(**values)


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam", "feddyn", "scaffold",
                                      "fedprox", "fedper"])  # fmt: skip
def test_secagg_composes_with_the_mean_strategies(strategy: str) -> None:
    assert settings(strategy=strategy).secure_aggregation == "secagg+"


def test_bits_and_clients_fit_the_modulus_by_hand() -> None:
    # 5 clients a round: ceil(log2(6)) = 3 bits of headroom, so 29 fit
    assert settings(**{"secagg-bits": 29}).secagg_bits == 29
    assert math.ceil(math.log2(6)) == 3


def test_pollen_list_shows_the_option_and_what_it_composes_with() -> None:
    from pollen import listing

    text = listing.parts()
    assert "secure-aggregation:" in text
    line = next(row for row in text.splitlines() if "secagg+" in row)
    assert "fedavg, fedopt, feddyn" in line and "refused: robust" in line


def test_a_rounds_secrets_never_reach_the_client_state_store() -> None:
    """The keys and shares a client holds between stages are not client
    state: a checkpoint or a spill never writes them to disk."""
    from pollen.protocol import secagg_state_key
    from pollen.task.client_state import export_state, held_bytes

    context = Context(1, 5, {}, RecordDict(), {})
    message = Message(
        RecordDict({CONFIG: ConfigRecord({CLIENT: 3, "server-round": 2}),
                    SECAGG: ConfigRecord({"id": 1})}),
        dst_node_id=5, message_type=f"{MessageType.QUERY}.{SECAGG_KEYS}",
    )  # fmt: skip
    secagg_client.advertise_keys(message, context)
    assert secagg_state_key(3, 2) in context.state
    assert export_state(dict(context.state.items()), 3) == {}
    assert held_bytes(context) == {}


def test_pollen_report_shows_the_protocols_seconds_and_error_bound(tmp_path) -> None:
    from pollen.experiments import report
    from tests.test_compare import write_run

    stepwise = {"secagg-keys-seconds": 1.0, "secagg-shares-seconds": 2.0,
                "secagg-train-seconds": 9.0, "secagg-unmask-seconds": 0.5,
                "secagg-unmask-compute-seconds": 0.1,
                "secagg-error-bound": 2e-6}  # fmt: skip
    # round 2 set up in round 1: no keys and shares exchanges of its own
    ahead = {k: v for k, v in stepwise.items() if "keys" not in k and "shares" not in k}
    rows = [
        {"round": r, "accuracy": 0.9, "bytes-up": 1, "bytes-down": 1,
         "aggregation": {**secure, "secagg-error-bound": 1e-6 * r}}
        for r, secure in ((1, stepwise), (2, ahead))
    ]  # fmt: skip
    write_run(tmp_path, "on", {"secure-aggregation": "secagg+"}, [0.9, 0.9],
              history=rows)  # fmt: skip
    write_run(tmp_path, "off", {"secure-aggregation": "off"}, [0.9, 0.9])
    runs = report.read_runs(tmp_path)
    table = report.markdown_table(report.summarize_groups(runs, None), None)
    head, _, off, on = table.splitlines()
    assert head.endswith("| secagg s/round | secagg error bound |")
    assert off.endswith("| n/a | n/a |")
    # keys + shares + unmask + its compute, not the training: 3.6 s in
    # round 1, 0.6 s in round 2 (the spread is over seeds: one here)
    assert on.endswith("| 2.10 | 2.0e-06 |")


def test_batchnorm_statistics_are_averaged_like_the_weights(monkeypatch) -> None:
    """Running means and variances are shared floating entries the clients'
    training changes without a gradient: the secure mean averages them as
    the plain mean does (a round that kept them would test with the
    initial statistics)."""
    from pollen.task.models import build_model
    from pollen.task.sharing import Sharing

    net = build_model("mlp-bn", (1, 8, 8), 10, 1)
    model = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    monkeypatch.setattr("tests.test_secagg.GLOBAL", {k: v for k, v in model.items()})
    rng = np.random.default_rng(0)
    updates = {
        c: {k: (v + rng.uniform(-0.1, 0.1, v.shape)).astype(v.dtype)
            if np.issubdtype(v.dtype, np.floating) else np.asarray(v + 7)
            for k, v in model.items()}
        for c in range(3)
    }  # fmt: skip
    examples = {0: 10, 1: 20, 2: 30}
    sharing = Sharing.of("shared", net)
    running = next(k for k in model if k.endswith("running_mean"))
    assert running not in sharing.trained_shared(exclude_bn=False)
    owner = {c: 100 for c in range(3)}
    strategy = Strategy(
        num_clients=3, client_frac=1.0, seed=7, server_update=FedAvgUpdate(),
        sharing=sharing, secure=SecureAggregation(PARAMS, 7, False),
    )  # fmt: skip
    request = strategy.configure_train(
        1, ArrayRecord({k: Array(v) for k, v in model.items()}),
        ConfigRecord({LR: 0.1}), Participants(Roster(owner), dict.fromkeys(owner, 40)),
    )  # fmt: skip
    outcome = strategy.secure.train(Federation(updates, examples), strategy, request, 5)
    bound = outcome.report["secagg-error-bound"]
    for key in (running, next(k for k in model if k.endswith("weight"))):
        expected = sum(examples[c] * updates[c][key].astype(np.float64)
                       for c in range(3)) / 60  # fmt: skip
        got = outcome.arrays[key].numpy().astype(np.float64)
        assert np.all(np.abs(got - expected) <= bound + 1e-7), key
    counter = next(k for k in model if k.endswith("num_batches_tracked"))
    assert outcome.arrays[counter].numpy() == model[counter]  # kept, not averaged

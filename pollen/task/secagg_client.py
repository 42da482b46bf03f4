"""The client's half of SecAgg+ (`pollen.common.secagg`), one handler per stage.

A secure round asks each sampled client four things, all keyed by the
client (a node may serve several) and kept in `context.state` between them
(`secagg_state_key`), for that round only:

1. `advertise_keys`: make two EC key pairs (one encrypts shares, one seeds
   pairwise masks) and a private seed b_u; reply with the public keys and a
   SHA-256 commitment to b_u (the server checks the b_u it rebuilds).
2. `share_keys`: split b_u and the mask key into Shamir shares, one per
   holder (the client and the neighbours whose keys the server relayed),
   `threshold` of which rebuild them; reply with each neighbour's share pair
   encrypted under the key agreed with it (Fernet), for the server to relay.
3. `secagg_mod`, around the training handler (and its other mods): decrypt
   the shares relayed to it, then replace the trained reply's entries by
   one masked vector: the change from the global model times n_k / the
   round's largest shard (or 1 under a uniform mean), SCAFFOLD's Delta c_k,
   and the example weight and clipped count as integers, quantised and
   masked. The reply keeps its metrics, less the example count.
4. `reveal_shares`: given who sent a vector (survived) and who shared but
   did not (dropped), reveal the b share of each survivor it holds and the
   mask-key share of each dropped one, never both for one client; then
   forget the round's secrets.

The next round's stages 1 and 2 may ride on this round's stages 3 and 4
(a `SECAGG_NEXT` record in the message, answered in the reply): its keys
are made and advertised with the training reply, its shares made with the
revealed ones. They are the same keys and shares, only sent earlier; each
round's secrets stay its own.

A stage whose input is inconsistent (a repeated key, a share for another
client, a threshold that its own share would meet or that is not above half
its holders, a client marked both survived and dropped, too few survivors)
raises: the node's reply is an error and the server drops the client.
"""

from __future__ import annotations

import hashlib
import os
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.logger import log
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from ..common import secagg
from ..protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    CONFIG,
    CONTROL,
    MASKED,
    METRICS,
    NUM_EXAMPLES,
    SECAGG,
    SECAGG_NEXT,
    SERVER_ROUND,
    secagg_state_key,
)


def advertise_keys(msg: Message, context: Context) -> Message:
    """Stage 1: this round's key pairs and seed, kept; the public halves sent."""
    client, server_round = _addressed(msg)
    _forget_unrevealed(context, client, before=server_round)
    keys = _new_keys(context, client, server_round, msg.content[SECAGG])
    return _reply(msg, client, keys)


def share_keys(msg: Message, context: Context) -> Message:
    """Stage 2: Shamir shares of the seed and mask key, one per holder,
    each neighbour's pair encrypted under the key agreed with it."""
    client, server_round = _addressed(msg)
    shares = _shares(context, client, server_round, msg.content[SECAGG])
    return _reply(msg, client, shares)


def _new_keys(
    context: Context, client: int, server_round: int, record: ConfigRecord
) -> dict[str, bytes]:
    """Two key pairs and a seed for `server_round`, kept; their public
    halves and the seed's commitment."""
    share_key, mask_key = secagg.new_private_key(), secagg.new_private_key()
    seed = os.urandom(secagg.SEED_BYTES)
    context.state[secagg_state_key(client, server_round)] = ConfigRecord(
        {
            "round": server_round,
            "id": int(record["id"]),
            "share-key": secagg.private_bytes(share_key),
            "mask-key": secagg.private_bytes(mask_key),
            "seed": seed,
        }
    )
    return {
        "share-public": secagg.public_bytes(share_key),
        "mask-public": secagg.public_bytes(mask_key),
        "seed-hash": hashlib.sha256(seed).digest(),
    }


def _forget_unrevealed(context: Context, client: int, before: int) -> None:
    """Forget the client's secrets of rounds before `before`: rounds it set
    up but was never asked to unmask (it dropped, or the round was skipped)."""
    stale = [
        key
        for key, state in context.state.items()
        if isinstance(state, ConfigRecord)
        and "round" in state
        and int(state["round"]) < before
        and key == secagg_state_key(client, int(state["round"]))
    ]
    for key in stale:
        del context.state[key]


def _shares(
    context: Context, client: int, server_round: int, record: ConfigRecord
) -> dict[str, list]:
    """The encrypted share pairs of `server_round`'s secrets, by neighbour;
    this client's own pair and the neighbours' keys kept."""
    state = _state(context, client, server_round)
    me = int(state["id"])
    neighbours = [int(v) for v in record.get("neighbours", [])]
    share_publics = [bytes(k) for k in record.get("share-publics", [])]
    mask_publics = [bytes(k) for k in record.get("mask-publics", [])]
    publics = share_publics + mask_publics
    if len(set(publics)) != len(publics) or me in neighbours:
        raise ValueError("secagg: the relayed public keys repeat (or name me)")
    if not len(share_publics) == len(mask_publics) == len(neighbours):
        raise ValueError("secagg: one share key and one mask key per neighbour")
    threshold = int(record["threshold"])
    holders = [me, *neighbours]
    if problem := secagg.threshold_problem(threshold, len(holders)):
        raise ValueError(f"secagg: refusing to share my secrets: {problem}")
    seed_shares = create_shares(bytes(state["seed"]), threshold, len(holders))
    key_shares = create_shares(bytes(state["mask-key"]), threshold, len(holders))
    share_key = secagg.load_private(bytes(state["share-key"]))
    ciphertexts = []
    for i, (v, public) in enumerate(
        zip(neighbours, share_publics, strict=True), start=1
    ):
        plaintext = share_keys_plaintext_concat(me, v, seed_shares[i], key_shares[i])
        ciphertexts.append(encrypt(secagg.agreed_key(share_key, public), plaintext))
    if neighbours:  # (Flower's records cannot size an empty list)
        state["neighbours"] = neighbours
        state["share-publics"], state["mask-publics"] = share_publics, mask_publics
    state["threshold"] = threshold
    state[f"seed-{me}"], state[f"mask-key-{me}"] = seed_shares[0], key_shares[0]
    return {"to": neighbours, "ciphertexts": ciphertexts}


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Stage 3, around training: the trained reply replaced by its masked
    vector (messages without a SECAGG record pass through untouched)."""
    if SECAGG not in msg.content:
        return call_next(msg, context)
    client, server_round = _addressed(msg)
    state = _state(context, client, server_round)
    masked_with = _keep_relayed_shares(state, msg.content[SECAGG])
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    record = msg.content[SECAGG]
    values, weight = _weighted_values(msg, reply, record)
    rng = np.random.default_rng(
        np.random.SeedSequence([int(record["seed"]), server_round, client])
    )
    quanta, clipped = secagg.quantize(
        values, float(record["clip"]), int(record["bits"]), rng
    )
    vector = np.concatenate([quanta, np.array([weight, clipped], dtype=np.uint32)])
    vector = secagg.add_mask(vector, bytes(state["seed"]), 1)
    mask_key = secagg.load_private(bytes(state["mask-key"]))
    me = int(state["id"])
    publics = _by_neighbour(state, "mask-publics")
    for v in masked_with:
        seed = secagg.pairwise_seed(mask_key, publics[v])
        vector = secagg.add_mask(vector, seed, secagg.pairwise_sign(me, v))
    if masked_with:
        state["masked-with"] = masked_with
    metrics = reply.content[METRICS]
    content = RecordDict(
        {
            MASKED: ArrayRecord({MASKED: Array(vector)}),
            METRICS: type(metrics)(
                {k: v for k, v in metrics.items() if k != NUM_EXAMPLES}
            ),
            CLIENT_RECORD: reply.content[CLIENT_RECORD],
        }
    )
    if SECAGG_NEXT in msg.content:  # the next round's stage 1, ahead
        _forget_unrevealed(context, client, before=server_round)
        keys = _new_keys(context, client, server_round + 1, msg.content[SECAGG_NEXT])
        content[SECAGG_NEXT] = ConfigRecord(keys)
    return Message(content, reply_to=msg)


def reveal_shares(msg: Message, context: Context) -> Message:
    """Stage 4: the seed share of every survivor and the mask-key share of
    every dropped client this client holds; the round's secrets forgotten."""
    client, server_round = _addressed(msg)
    state = _state(context, client, server_round)
    record = msg.content[SECAGG]
    survived = {int(v) for v in record.get("survived", [])}
    dropped = {int(v) for v in record.get("dropped", [])}
    me = int(state["id"])
    if survived & dropped or me not in survived:
        raise ValueError("secagg: a client marked both survived and dropped")
    if len(survived) < int(state["threshold"]):
        raise ValueError(
            f"secagg: {len(survived)} survivors, fewer than the threshold "
            f"{state['threshold']}: the sum would reveal too little cover"
        )
    held = {me, *state.get("masked-with", [])}
    revealed: dict[str, list] = {"seed-of": [], "seeds": [], "key-of": [], "keys": []}
    for v in sorted(held & survived):
        revealed["seed-of"].append(v)
        revealed["seeds"].append(bytes(state[f"seed-{v}"]))
    for v in sorted(held & dropped):
        revealed["key-of"].append(v)
        revealed["keys"].append(bytes(state[f"mask-key-{v}"]))
    del context.state[secagg_state_key(client, server_round)]
    reply = _reply(msg, client, revealed)
    if SECAGG_NEXT in msg.content:  # the next round's stage 2, ahead
        try:
            shares = _shares(
                context, client, server_round + 1, msg.content[SECAGG_NEXT]
            )
        except ValueError as err:  # this round's shares still go back
            log(WARNING, "pollen: no shares for round %d: %s", server_round + 1, err)
        else:
            reply.content[SECAGG_NEXT] = secagg.config_record(**shares)
    return reply


def _addressed(msg: Message) -> tuple[int, int]:
    config = msg.content[CONFIG]
    return int(config[CLIENT]), int(config[SERVER_ROUND])


def _state(context: Context, client: int, server_round: int) -> ConfigRecord:
    state = context.state.get(secagg_state_key(client, server_round))
    if not isinstance(state, ConfigRecord) or state["round"] != server_round:
        raise ValueError(
            f"secagg: client {client} holds no keys of round {server_round} "
            "(the node restarted since it advertised them?)"
        )
    return state


def _keep_relayed_shares(state: ConfigRecord, record: ConfigRecord) -> list[int]:
    """Decrypt the share pairs relayed from neighbours, keep them; the
    neighbours they came from (those whose masks this client adds)."""
    me = int(state["id"])
    share_key = secagg.load_private(bytes(state["share-key"]))
    publics = _by_neighbour(state, "share-publics")
    senders = []
    for v, ciphertext in zip(
        record.get("from", []), record.get("ciphertexts", []), strict=True
    ):
        v = int(v)
        if v not in publics:
            raise ValueError(f"secagg: a share relayed from {v}, not a neighbour")
        key = secagg.agreed_key(share_key, publics[v])
        source, destination, seed_share, key_share = share_keys_plaintext_separate(
            decrypt(key, bytes(ciphertext))
        )
        if (source, destination) != (v, me):
            raise ValueError(f"secagg: the share relayed from {v} names {source}")
        state[f"seed-{v}"], state[f"mask-key-{v}"] = seed_share, key_share
        senders.append(v)
    return sorted(senders)


def _by_neighbour(state: ConfigRecord, name: str) -> dict[int, bytes]:
    """A neighbour's public key of kind `name`, by neighbour id."""
    neighbours = state.get("neighbours", [])
    return dict(zip(neighbours, state.get(name, []), strict=True))


def _weighted_values(
    msg: Message, reply: Message, record: ConfigRecord
) -> tuple[np.ndarray, int]:
    """The float64 values to quantise, in the order the server names, and
    the example weight: (x_k - x) n_k / scale over the masked entries
    (uniform: scale 0, weight 1), then Delta c_k."""
    sent, trained = msg.content[ARRAYS], reply.content[ARRAYS]
    num_examples = int(reply.content[METRICS][NUM_EXAMPLES])
    scale = float(record["weight-scale"])
    if scale and num_examples > scale:
        raise ValueError(
            f"secagg: {num_examples} examples, more than the round's bound {scale:g}"
        )
    factor, weight = (num_examples / scale, num_examples) if scale else (1.0, 1)
    parts = [
        factor * (trained[key].numpy().astype(np.float64) - sent[key].numpy()).ravel()
        for key in record.get("entries", [])
    ]
    control = reply.content.get(CONTROL)
    for key in record.get("control-entries", []):
        parts.append(control[key].numpy().astype(np.float64).ravel())
    return np.concatenate(parts) if parts else np.zeros(0), weight


def _reply(msg: Message, client: int, values: dict) -> Message:
    content = RecordDict(
        {
            SECAGG: secagg.config_record(**values),
            CLIENT_RECORD: ConfigRecord({CLIENT: client}),
        }
    )
    return Message(content, reply_to=msg)

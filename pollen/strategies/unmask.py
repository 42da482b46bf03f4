"""The server's last step of SecAgg+: the sum of the survivors' vectors, unmasked.

Given the masked vectors y_u of the clients that sent one (survivors) and
the shares the survivors revealed, the server rebuilds each survivor's
seed b_u and each dropped client's mask key, then removes what they added
(`pollen.common.secagg`):

    sum_u q_u = sum_u y_u - sum_u PRG(b_u)
                - sum_{v dropped} sum_{u in N(v) survived} sign(u, v) PRG(s_uv).

Every rebuilt secret is checked against what its owner committed to before
the round (the SHA-256 of b_u; the public mask key), so a holder that
reveals a wrong share is found (the secret is rebuilt without it) and
named; a secret that cannot be rebuilt from consistent shares fails the
unmasking, and the round is skipped rather than aggregated wrong.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.common.secure_aggregation.crypto.shamir import combine_shares

from ..common import secagg


class UnmaskError(ValueError):
    """The sum cannot be unmasked (too few or inconsistent shares)."""


@dataclass(frozen=True)
class Revealed:
    """The shares the survivors revealed: owner id -> [(holder id, share)]."""

    seeds: Mapping[int, list[tuple[int, bytes]]]
    mask_keys: Mapping[int, list[tuple[int, bytes]]]


@dataclass(frozen=True)
class Committed:
    """What each client advertised before any share: by id."""

    seed_hashes: Mapping[int, bytes]
    mask_publics: Mapping[int, bytes]
    thresholds: Mapping[int, int]


def unmasked_sum(
    vectors: Mapping[int, np.ndarray],
    dropped: list[int],
    graph: Mapping[int, tuple[int, ...]],
    shared: set[int],
    revealed: Revealed,
    committed: Committed,
) -> tuple[np.ndarray, list[int]]:
    """sum_u q_u (mod 2^32) over the survivors' `vectors` (by id), and the
    holders whose revealed shares were wrong. `shared` are the ids that
    completed the share stage: those each client masked with."""
    total = np.zeros_like(next(iter(vectors.values())))
    for vector in vectors.values():
        total += vector
    wrong: set[int] = set()
    for u in vectors:
        seed = _rebuilt(
            u, revealed.seeds.get(u, []), committed.thresholds[u], wrong,
            lambda s, u=u: hashlib.sha256(s).digest() == committed.seed_hashes[u],
        )  # fmt: skip
        total = secagg.add_mask(total, seed, -1)
    for v in dropped:
        key_bytes = _rebuilt(
            v, revealed.mask_keys.get(v, []), committed.thresholds[v], wrong,
            lambda s, v=v: _is_key_of(s, committed.mask_publics[v]),
        )  # fmt: skip
        mask_key = secagg.load_private(key_bytes)
        for u in graph[v]:
            if u in vectors and u in shared:
                seed = secagg.pairwise_seed(mask_key, committed.mask_publics[u])
                total = secagg.add_mask(total, seed, -secagg.pairwise_sign(u, v))
    return total, sorted(wrong)


def _rebuilt(
    owner: int,
    shares: list[tuple[int, bytes]],
    threshold: int,
    wrong: set[int],
    verified: Callable[[bytes], bool],
) -> bytes:
    """The secret `shares` rebuild and `verified` accepts: from the first
    `threshold` of them (interpolation is quadratic in the shares used), or,
    where that fails, from all of them (more than `threshold` consistent
    points still give the secret) or all but one, the one left out being
    wrong (its holder added to `wrong`)."""
    if len(shares) < threshold:
        raise UnmaskError(
            f"client {owner}: {len(shares)} shares revealed, {threshold} needed"
        )
    attempts: list[tuple[int | None, list[tuple[int, bytes]]]] = [
        (None, shares[:threshold])
    ]
    if len(shares) > threshold:
        attempts += [(None, shares)] + [
            (holder, [s for s in shares if s[0] != holder]) for holder, _ in shares
        ]
    for left_out, chosen in attempts:
        try:
            secret = combine_shares([share for _, share in chosen])
        except ValueError:
            continue
        if verified(secret):
            if left_out is not None:
                wrong.add(left_out)
            return secret
    raise UnmaskError(f"client {owner}: its revealed shares are inconsistent")


def _is_key_of(private: bytes, public: bytes) -> bool:
    try:
        return secagg.public_bytes(secagg.load_private(private)) == public
    except ValueError:
        return False

"""SecAgg+'s arithmetic and keys, as both halves of the protocol use them.

Secure aggregation (Bonawitz et al., CCS 2017,
https://eprint.iacr.org/2017/281) lets the server learn the sum of the
clients' vectors and nothing else about any one of them; SecAgg+ (Bell et
al., CCS 2020, https://eprint.iacr.org/2020/704) makes each client share
secrets and masks with its neighbours on a sparse graph rather than with
every other client. Each client u of a round (ids 1..n) sends

    y_u = q_u + PRG(b_u) + sum_{v in N(u), u < v} PRG(s_uv)
                         - sum_{v in N(u), u > v} PRG(s_uv)   (mod 2^32),

with q_u its quantised vector, b_u a private seed, and s_uv = s_vu the
key agreement (ECDH) of u's and v's mask keys. Pairwise masks cancel in the
sum over clients that all sent; Shamir shares of b_u (of a survivor) and of
u's mask key (of a client that dropped after sharing) let the server remove
the rest once `threshold` holders answer. The server never holds both
secrets of one client: an honest holder reveals one kind per client, and a
threshold above half its holders keeps a server from collecting both from
two disjoint halves.

The cryptography is kept libraries': EC key pairs (SECP384R1), ECDH and
HKDF-SHA256, Fernet share encryption, Shamir sharing and the share plaintext
layout are Flower's (`flwr.common.secure_aggregation`) over `cryptography`
and PyCryptodome; the mask stream is AES-256 in counter mode
(`cryptography`), not Flower's `pseudo_rand_gen`, which seeds NumPy's
Mersenne Twister with 32 bits of the key. Arithmetic is on uint32, whose
wrap-around is the modulus 2^32.

Quantisation maps each value v (clipped to [-c, c]) to an integer in
[0, 2^bits] by stochastic rounding of (v + c) 2^bits / 2c, so a sum of m
values is exact while m 2^bits < 2^32 and within m quanta (2c / 2^bits
each) of the clipped values' sum.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import ConfigRecord
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    generate_shared_key,
)

SEED_BYTES = 32  # b_u, and a pairwise mask key
# a client and at least one neighbour hold its secrets; a client left with
# no neighbour would be masked by b_u alone, which its own share rebuilds
MIN_HOLDERS = 2
# a round's sum is unmasked from at least two vectors: the sum of one is
# that client's update
MIN_SURVIVORS = 2


@dataclass(frozen=True)
class SecAggParams:
    """What a round's protocol is run with (settings `secagg-*`)."""

    threshold: float  # share of a client's holders needed to unmask it
    neighbours: float  # share of the round's other clients each masks with
    clip: float  # each vector entry is clipped to [-clip, clip]
    bits: int  # quantisation: 2^bits steps over [-clip, clip]

    @property
    def quantum(self) -> float:
        """The width of one quantisation step."""
        return 2 * self.clip / 2**self.bits


def ring_neighbours(n: int, share: float) -> dict[int, tuple[int, ...]]:
    """SecAgg+'s graph over clients 1..n: each client's neighbours are the
    nearest `share` of the others on a ring (an even number, all with 1.0),
    so the relation is symmetric."""
    degree = min(n - 1, 2 * math.ceil(share * (n - 1) / 2))
    half = degree // 2
    graph = {}
    for u in range(1, n + 1):
        around = {(u - 1 + d) % n + 1 for d in range(-half, half + 1) if d}
        if degree == n - 1:  # every other client (n even: the opposite one too)
            around = set(range(1, n + 1)) - {u}
        graph[u] = tuple(sorted(around))
    return graph


def threshold_for(holders: int, share: float) -> int:
    """Shares of a secret needed to rebuild it: `share` of its holders (the
    client and its neighbours; `share` read as the decimal it was written
    as, so 0.56 of 25 is 14, not 15), at least two and at most all. A secret
    needs two holders: with one, its owner's own share rebuilds it."""
    if holders < MIN_HOLDERS:
        raise ValueError(f"a secret needs {MIN_HOLDERS} holders, it has {holders}")
    return min(holders, max(MIN_HOLDERS, math.ceil(Fraction(repr(share)) * holders)))


def threshold_problem(threshold: int, holders: int) -> str | None:
    """Why a client must not split its secrets among `holders` (itself and
    its neighbours) with this `threshold`, or None: fewer than two holders
    or shares (its own share alone would rebuild its secret), more than
    there are holders, or not above half of them (two disjoint halves could
    each rebuild it, so the server could learn both secrets of one client)."""
    if holders < MIN_HOLDERS:
        return f"{holders} holder(s) of its secrets, at least {MIN_HOLDERS} needed"
    if not MIN_HOLDERS <= threshold <= holders or 2 * threshold <= holders:
        return (
            f"threshold {threshold} for {holders} holders: it must be above half "
            f"of them, at least {MIN_HOLDERS} and at most all"
        )
    return None


# ---- keys ------------------------------------------------------------------


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private(data: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_der_private_key(data, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("not an elliptic-curve private key")
    return key


def public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER,
        serialization.PublicFormat.SubjectPublicKeyInfo,
    )


def load_public(data: bytes) -> ec.EllipticCurvePublicKey:
    key = serialization.load_der_public_key(data)
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError("not an elliptic-curve public key")
    return key


def agreed_key(private: ec.EllipticCurvePrivateKey, public: bytes) -> bytes:
    """The Fernet key two clients share (ECDH, then HKDF-SHA256)."""
    return generate_shared_key(private, load_public(public))


def pairwise_seed(private: ec.EllipticCurvePrivateKey, public: bytes) -> bytes:
    """s_uv: the 32 bytes of the key agreement that seed a pairwise mask."""
    return base64.urlsafe_b64decode(agreed_key(private, public))


# ---- masks -----------------------------------------------------------------


def mask_stream(seed: bytes, length: int) -> np.ndarray:
    """`length` uint32 values of AES-256-CTR keyed by `seed` (32 bytes)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def pairwise_sign(u: int, v: int) -> int:
    """+1 where u adds the mask it shares with v, -1 where it subtracts it."""
    return 1 if u < v else -1


def add_mask(vector: np.ndarray, seed: bytes, sign: int) -> np.ndarray:
    """`vector` + sign * PRG(seed) (mod 2^32)."""
    stream = mask_stream(seed, vector.size)
    return vector + stream if sign > 0 else vector - stream


# ---- quantisation ----------------------------------------------------------


def quantize(
    values: np.ndarray, clip: float, bits: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """`values` (1-D) as uint32 quanta in [0, 2^bits] by stochastic
    rounding (unbiased within the clipping range), and how many were clipped."""
    clipped = int(np.count_nonzero(np.abs(values) > clip))
    scaled = (np.clip(values, -clip, clip) + clip) * (2**bits / (2 * clip))
    floor = np.floor(scaled)
    up = rng.random(values.shape) < (scaled - floor)
    return (floor + up).astype(np.uint32), clipped


def dequantize(total: np.ndarray, count: int, clip: float, bits: int) -> np.ndarray:
    """The float64 sum of `count` values whose quanta summed to `total`."""
    return total.astype(np.float64) * (2 * clip / 2**bits) - count * clip


def config_record(**values: object) -> ConfigRecord:
    """A stage's values as a ConfigRecord, empty lists left out (Flower's
    records cannot size an empty list; a reader takes a missing one as [])."""
    return ConfigRecord({k: v for k, v in values.items() if v != []})

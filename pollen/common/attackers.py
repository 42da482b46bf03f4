"""Which clients attack: the ClientApp asks whether it is one, the server's
history marks them, and `Settings` refuses an attack without attackers.

`attacker-clients` names them ("3,7"), or `attackers` gives a share of
`num-clients`, drawn by a generator seeded by `seed` so both apps draw the
same clients (`pollen.task.attacks` says what they do).
"""

from __future__ import annotations

import random

from ..catalog import ATTACKS


def parse_clients(text: str) -> tuple[int, ...] | None:
    """'3,7' -> (3, 7); None where a part is not an integer >= 0."""
    if not text.strip():
        return ()
    try:
        clients = tuple(int(part) for part in text.split(","))
    except ValueError:
        return None
    return clients if all(c >= 0 for c in clients) else None


def attacking(
    attack: str, share: float, named: str, num_clients: int, seed: int
) -> frozenset[int]:
    """The clients that attack: the `named` ones, or round(share x
    num_clients) of them drawn by seed; none without an attack."""
    if attack == "none":
        return frozenset()
    if named:
        return frozenset(parse_clients(named) or ())
    count = round(share * num_clients)
    rng = random.Random(f"attackers-{seed}")
    return frozenset(rng.sample(range(num_clients), count))


def attack_problem(
    attack: str, share: float, named: str, num_clients: int
) -> str | None:
    """An attack needs attackers, attackers need an attack, and the named
    clients must exist; None when they agree."""
    clients = parse_clients(named) or ()
    if attack == "none":
        if share or clients:
            return (
                "attackers or attacker-clients without an attack: set attack to "
                "one of " + ", ".join(ATTACKS[1:])
            )
        return None
    if share and clients:
        return (
            "attackers and attacker-clients are both set; name the clients or "
            "give a share, not both"
        )
    if not share and not clients:
        return (
            f"attack={attack!r} without attackers: set attackers (a share of the "
            "clients) or attacker-clients ('i,j,...')"
        )
    if any(c >= num_clients for c in clients):
        return (
            f"attacker-clients={named!r}: clients are 0 to {num_clients - 1} "
            f"(num-clients={num_clients})"
        )
    if share and round(share * num_clients) == 0:
        return (
            f"attackers={share:g} of num-clients={num_clients} rounds to no client; "
            f"allowed: at least {1 / num_clients:g}"
        )
    return None

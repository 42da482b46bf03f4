"""The shape of one node's link to the server: delay, jitter, rates, loss.

Both the shaped test network (`deployment/network.py`, which applies a shape
to real frames) and the simulated clock (`strategies/clock.py`, which
predicts what a shape costs a round) read the same `LinkShape`, as do the
network profiles that name one per node (`network_profile.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

Direction = Literal["up", "down"]


@dataclass(frozen=True)
class LinkShape:
    """How the link between one node and the server behaves.

    `delay_ms` is the one-way delay added in each direction, so an idle round
    trip takes 2 x `delay_ms`; `jitter_ms` varies each frame's delay uniformly
    within +-`jitter_ms` (at most `delay_ms`) without reordering frames.
    `up_mbit` limits the node -> server rate and `down_mbit` the server -> node
    rate, in Mbit/s of Ethernet frames (0 = unlimited); frames that would
    queue for longer than 0.5 s behind a limited link are dropped.
    `loss_pct` drops that percentage of frames, independently in each direction.
    """

    delay_ms: float = 0
    jitter_ms: float = 0
    up_mbit: float = 0
    down_mbit: float = 0
    loss_pct: float = 0

    _KEYS: ClassVar[dict[str, tuple[str, str]]] = {  # key -> (field, unit)
        "delay": ("delay_ms", "ms"),
        "jitter": ("jitter_ms", "ms"),
        "up": ("up_mbit", "mbit"),
        "down": ("down_mbit", "mbit"),
        "loss": ("loss_pct", "%"),
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"LinkShape.{f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"LinkShape.{f.name} must be a finite number >= 0, got {value!r}"
                )
        if self.loss_pct >= 100:
            raise ValueError(
                f"LinkShape.loss_pct must be below 100 (a percentage), got {self.loss_pct!r}"
            )
        if self.jitter_ms > self.delay_ms:
            raise ValueError(
                f"LinkShape.jitter_ms must be at most delay_ms ({self.delay_ms!r}), "
                f"got {self.jitter_ms!r}"
            )

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """Read the compact form "delay=50ms,jitter=5ms,up=10mbit,down=50mbit,loss=0.1%".

        Keys may come in any order and be left out (0); units are optional;
        "" and "none" mean an unshaped link.
        """
        values: dict[str, float] = {}
        spec = text.strip()
        for item in [] if spec.lower() in ("", "none") else spec.split(","):
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or key.lower() not in cls._KEYS:
                raise ValueError(
                    f"bad link shape item {item.strip()!r} in {text!r}: expected "
                    f"key=value with key one of {', '.join(cls._KEYS)}"
                )
            name, unit = cls._KEYS[key.lower()]
            if name in values:
                raise ValueError(f"link shape {text!r} gives {key!r} twice")
            number = re.sub(f"{re.escape(unit)}$", "", raw, flags=re.IGNORECASE)
            try:
                values[name] = float(number)
            except ValueError:
                raise ValueError(
                    f"bad value {raw!r} for {key!r} in link shape {text!r}: "
                    f"expected a number, optionally followed by {unit!r}"
                ) from None
        return cls(**values)

    def __str__(self) -> str:
        """The compact form that `parse` reads, naming only the set keys."""
        items = [  # each number as short as `parse` reads it back exactly
            f"{key}={repr(float(getattr(self, name))).removesuffix('.0')}{unit}"
            for key, (name, unit) in self._KEYS.items()
            if getattr(self, name)
        ]
        return ",".join(items) or "none"

    def direction(self, direction: Direction) -> tuple[float, float, float, float]:
        """(delay s, jitter s, rate bit/s or 0, loss probability) of one direction."""
        mbit = {"up": self.up_mbit, "down": self.down_mbit}[direction]
        return (
            self.delay_ms / 1e3,
            self.jitter_ms / 1e3,
            mbit * 1e6,
            self.loss_pct / 100,
        )

"""Malicious clients, to test the robust aggregators against.

A client named by `attackers` / `attacker-clients` (see
`Settings.attacking_clients`) trains as usual and then lies, in one of the
ways the Byzantine-robustness literature evaluates (Blanchard et al. 2017;
Fang et al. 2020, "Local model poisoning attacks to Byzantine-robust
federated learning"). With Delta = x_trained - x_sent its update and s =
`attack-scale`:

- `sign-flip`: it sends x_sent - s Delta (the update reversed and amplified);
- `scale`: it sends x_sent + s Delta (a boosted update, as in model
  replacement);
- `noise`: it sends x_sent + N(0, s^2 I), Gaussian noise instead of its
  update;
- `label-flip`: it trains on labels y -> C - 1 - y (C classes) and sends
  the result honestly (data poisoning).

Only floating entries are changed (BatchNorm's integer counters keep their
trained value). The same code runs in simulation and deployment, inside the
ClientApp, so the server sees exactly what a real malicious node would send:
the labels are flipped where the round's examples are assembled
(`trained_labels`), the model is poisoned by a ClientApp mod around the
training handler (`poisoning_mod`), after any central-DP clipping
(`pollen.task.client_clip`), so the lie is what leaves the node.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from ..catalog import MODEL_POISONING
from ..extensions import data_set_info
from ..protocol import ARRAYS, CLIENT, CONFIG, SERVER_ROUND
from ..settings import Settings
from .node_data import node_settings
from .train import client_seed


def flipped_labels(y: torch.Tensor, classes: int) -> torch.Tensor:
    """Labels y -> C - 1 - y: every example teaches the wrong class."""
    return classes - 1 - y


def trained_labels(settings: Settings, client: int, y: torch.Tensor) -> torch.Tensor:
    """The labels `client` trains on: flipped where it attacks by `label-flip`."""
    if settings.attack == "label-flip" and client in settings.attacking_clients:
        return flipped_labels(y, data_set_info(settings.data_set).classes)
    return y


def poisoning_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """A ClientApp mod: an attacking client's training reply carries the
    `poisoned` entries (seeded by its round's training seed) instead of the
    ones it trained."""
    reply = call_next(msg, context)
    settings = node_settings(context)
    config = msg.content[CONFIG]
    client = int(config[CLIENT])
    if settings.attack in MODEL_POISONING and client in settings.attacking_clients:
        seed = client_seed(settings.seed, int(config[SERVER_ROUND]), client)
        reply.content[ARRAYS] = poisoned(
            settings.attack, msg.content[ARRAYS], reply.content[ARRAYS],
            settings.attack_scale, seed,
        )  # fmt: skip
    return reply


def poisoned(
    attack: str, sent: ArrayRecord, trained: ArrayRecord, scale: float, seed: int
) -> ArrayRecord:
    """The entries a model-poisoning client sends instead of `trained`."""
    if attack not in MODEL_POISONING:
        raise ValueError(f"attack {attack!r}: allowed: {', '.join(MODEL_POISONING)}")
    rng = np.random.default_rng(seed)
    out = {}
    for key in trained:
        x_trained = trained[key].numpy()
        if not np.issubdtype(x_trained.dtype, np.floating):
            out[key] = Array(x_trained)
            continue
        x_sent = sent[key].numpy().astype(np.float64)
        delta = x_trained.astype(np.float64) - x_sent
        if attack == "sign-flip":
            lie = x_sent - scale * delta
        elif attack == "scale":
            lie = x_sent + scale * delta
        else:
            lie = x_sent + rng.normal(0.0, scale, size=x_sent.shape)
        out[key] = Array(np.asarray(lie, dtype=x_trained.dtype))
    return ArrayRecord(out)

"""What an honest-but-curious server receives from a client in one round.

The audit plays the server's part for one round of a run configuration: it
builds the round's training messages with the run's own strategy
(`strategy.configure_train`: the model it sends, the clip norm a clipping
client is told, the round's sample), hands one to pollen's ClientApp as a
SuperNode would (loaded by its reference, as Flower loads it, and called
with the message and a node context), and takes from the reply exactly what
the server could read: the shared entries (FedSA's A matrices alone, say),
clipped where the client clips, noised where the client trains with DP-SGD.
The client trains on the first `examples` examples of its shard, given to
it as its node's own `data-file`; the attacks need a client with few.

Where the round is secure (SecAgg+), the server unmasks only the sum over
the round's surviving clients: the view is then the sum of the sampled
clients' updates (each trained on its first `examples`), which is what
SecAgg+ reveals up to its quantisation error, and the audit attacks that.
Central DP's noise is added by the server after it has read the updates:
with clipping on the server the view is the raw update; with clipping on
the client, the clipped one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from ..extensions import model_info
from ..protocol import ARRAYS, LOCAL_STEPS, LR, METRICS
from ..runs.checkpoints import Checkpoint, model_problem
from ..runs.lr_schedule import SCHEDULE_KEY, PlateauSchedule
from ..settings import Settings
from ..strategies.compose import build_strategy
from ..strategies.sampling import Participants, Roster
from ..strategies.strategy import Strategy
from ..task.data import load_dataset, read_node_file
from ..task.inputs import settings_model
from ..task.node_data import NodeData
from ..task.sharing import Sharing
from ..task.train import ShuffledBatches, client_seed, has_batch_norm
from . import AuditError, AuditFailed
from .inversion import LocalTraining

# pollen's ClientApp, by the reference Flower loads it by (pyproject's
# [tool.flwr.app.components] clientapp; `pollen audit` reads the app's own):
# the audit is its server, not an importer of its module.
CLIENT_APP = "pollen.client_app:app"


@dataclass(frozen=True)
class ServerView:
    """One round as the server sees it, and the truth to score against.

    `observed` is the update (new - old) of the trained entries the server
    reads, summed over `clients`; `model` holds the round's global model;
    `originals` (uint8, n x C x H x W) and `labels` are the audited
    client's examples, `mean` and `std` what normalised them (the data
    set's standard statistics, as for any node's own data-file; 0 and 1
    without `normalize`); `training` is how the clients trained, as far as
    the server knows it (learning rate, the steps they report, their
    batches from the run's seed, gradient clipping).
    """

    observed: dict[str, torch.Tensor]
    model: nn.Module
    mean: tuple[float, ...]
    std: tuple[float, ...]
    originals: torch.Tensor
    labels: torch.Tensor
    training: LocalTraining
    clients: tuple[int, ...]
    round: int
    sees: str


def audit_problem(settings: Settings) -> str | None:
    """Why the attacks cannot replay this configuration's local training,
    or None: they replay plain SGD on the images themselves."""
    s = settings
    info = model_info(s.model, s.data_set)
    reasons = {  # key: (refused, why, what to set)
        "client-optimizer": (s.client_optimizer != "sgd", "the attacks replay SGD",
                             "client-optimizer='sgd'"),
        "momentum": (s.momentum != 0, "the attacks replay SGD without momentum",
                     "momentum=0"),
        "weight-decay": (s.weight_decay != 0, "the attacks replay SGD without "
                         "weight decay", "weight-decay=0"),
        "local-objective": (s.local_objective != "plain", "the attacks replay "
                            "the plain cross-entropy", "local-objective='plain'"),
        "augment": (s.augment, "the server cannot replay a random crop and flip",
                    "augment=false"),
        "cache-features": (s.cache_features and s.model == "vgg16-lora",
                           "the model sees a frozen backbone's features, not "
                           "the images", "cache-features=false"),
        "head-epochs": (s.head_epochs > 0, "FedRep trains the head with the "
                        "body frozen first; the attacks replay one phase",
                        "head-epochs=0"),
        "freeze-head": (s.freeze_head, "FedBABU trains the body alone; the "
                        "attacks replay every parameter", "freeze-head=false"),
        "per-fedavg-beta": (s.per_fedavg_beta > 0, "Per-FedAvg's steps look one "
                            "step ahead on another batch; the attacks replay "
                            "plain steps", "per-fedavg-beta=0"),
        "sharing": (s.sharing == "local", "nothing of the model travels: there "
                    "is no update to attack", "another sharing"),
        "personal-head": (s.personal_head, "FedRoD trains the shared model on "
                          "the balanced softmax of the client's label counts; "
                          "the attacks replay the plain cross-entropy",
                          "personal-head=false"),
        "lora-dropout": (info.lora and s.lora_dropout > 0, "dropout draws masks "
                         "the server cannot replay", "lora-dropout=0"),
        "model": (info.dropout, "dropout draws masks the server cannot replay",
                  "a model without dropout"),
        "attack": (s.attack != "none" and bool(s.attacking_clients), "an attacking client's reply is "
                   "not its training's", "attack='none' (no attackers)"),
    }  # fmt: skip
    for key, (refused, why, allowed) in reasons.items():
        if refused:
            value = getattr(s, key.replace("-", "_"))
            return f"pollen audit with {key}={value!r}: {why}; set {allowed}"
    return None


def server_view(
    settings: Settings,
    *,
    client: int | None,
    examples: int,
    workdir: Path,
    checkpoint: Checkpoint | None = None,
    client_app: str = CLIENT_APP,
) -> ServerView:
    """Round 1 (or the round after `checkpoint`) of `settings`, as the server
    receives it from `client` (None: the round's first sampled client),
    which trains on its first `examples` examples (written to `workdir`),
    answered by the ClientApp that `client_app` names ("module:attribute")."""
    if problem := audit_problem(settings):
        raise AuditError(problem)
    if client is not None and not 0 <= client < settings.num_clients:
        raise AuditError(
            f"--client {client} is not one of the run's clients, 0 to "
            f"{settings.num_clients - 1}"
        )
    dataset = load_dataset(settings.data_set, settings.data_root, settings.download)
    model = settings_model(settings, dataset)
    if has_batch_norm(model) and min(examples, settings.batch_size) < 2:
        raise AuditError(
            f"model {settings.model!r} has BatchNorm, which skips a batch of one "
            "example: use --examples 2 or more (and batch-size 2 or more)"
        )
    strategy, _ = build_strategy(settings, model)
    lr, server_round = settings.lr, 1
    if checkpoint is not None:
        lr = _restore(settings, checkpoint, model, strategy)
        server_round = checkpoint.round + 1
    arrays = ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items()})
    roster = Roster({c: c for c in range(settings.num_clients)})
    with _task_identity():
        request = strategy.configure_train(
            server_round, arrays, ConfigRecord({LR: lr}), Participants(roster)
        )
    sampled = list(request.clients)
    client = sampled[0] if client is None else client
    if client not in sampled:
        raise AuditError(
            f"client {client} does not train in round {server_round}; its "
            f"sampled clients are {sampled}"
        )
    clients = tuple(sampled) if settings.secure_aggregation != "off" else (client,)
    messages = dict(zip(request.clients, request.messages, strict=True))
    app = _load(client_app)
    data = NodeData(settings)
    workdir.mkdir(parents=True, exist_ok=True)
    observed: dict[str, torch.Tensor] = {}
    steps, order = set(), []
    for c in clients:
        images, labels = _first_examples(data, c, examples)
        path = workdir / f"client-{c}.npz"
        np.savez(path, x_train=images.numpy(), y_train=labels.numpy())
        if c == client:  # normalised as a node's own data-file is
            originals, truth = images, labels
            seen = read_node_file(settings.data_set, path)
        with _task_identity():
            reply = _train(app, settings, messages[c], c, path)
        steps.add(int(reply.content[METRICS][LOCAL_STEPS]))
        order.append(_batches(settings, model, server_round, c, len(labels)))
        for name, value in _update(reply.content[ARRAYS], model).items():
            observed[name] = observed.get(name, 0) + value
    if len(steps) != 1:
        raise AuditError(f"the clients took different numbers of steps: {steps}")
    training = LocalTraining(
        lr=lr, steps=steps.pop(), batch_size=min(settings.batch_size, examples),
        clients=len(clients), max_grad_norm=0.0 if settings.dp else settings.max_grad_norm,
        order=() if settings.dp else tuple(order),
    )  # fmt: skip
    mean, std = (seen.mean, seen.std) if settings.normalize else ((0.0,), (1.0,))
    return ServerView(
        observed, model, mean, std, originals, truth, training, clients, server_round,
        _what_it_sees(settings, observed, model, clients, examples),
    )  # fmt: skip


def _restore(
    settings: Settings, checkpoint: Checkpoint, model: nn.Module, strategy: Strategy
) -> float:
    """The checkpoint's global model and server state into `model` and
    `strategy` (refused, as a resume refuses it, where its model is not the
    run's); the round's learning rate."""
    if problem := model_problem(
        checkpoint, {k: tuple(v.shape) for k, v in model.state_dict().items()},
        settings.model,
    ):  # fmt: skip
        raise AuditError(problem)
    if Sharing.of(settings.sharing_policy, model).local or settings.keeps_own_model:
        raise AuditError(
            f"--from with sharing policy {settings.sharing_policy!r}: the clients' "
            "own entries or models are on their nodes, not in the server's "
            "checkpoint; audit round 1 instead (leave out --from)"
        )
    model.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in checkpoint.model.items()}
    )
    strategy.load_state_arrays(checkpoint.strategy_state)
    schedule = PlateauSchedule.from_settings(settings)
    if SCHEDULE_KEY in checkpoint.extra:
        schedule.load_state_dict(checkpoint.extra[SCHEDULE_KEY])
    return schedule.lr


def _batches(
    settings: Settings, model: nn.Module, server_round: int, client: int, examples: int
) -> tuple[tuple[int, ...], ...]:
    """The client's batches this round, as indices of its examples: pollen's
    own shuffle (`ShuffledBatches`), seeded by the run's seed, which the
    server knows, replayed on the indices themselves."""
    indices = torch.arange(examples).unsqueeze(1)
    batches = ShuffledBatches(
        indices, torch.zeros(examples), lambda x, _: x,
        batch_size=settings.batch_size, num_epochs=settings.local_epochs,
        seed=client_seed(settings.seed, server_round, client),
        skip_single=has_batch_norm(model),
    )  # fmt: skip
    return tuple(
        tuple(int(i) for i in batch.squeeze(1))
        for epoch in batches.epochs()
        for batch, _ in epoch
    )


@contextmanager
def _task_identity() -> Iterator[None]:
    """The run and node identity Flower's `Message` reads, as a running app
    has it (run 0 on node 0 here; Flower's public setters), and the
    process's own back afterwards (read from its private fields: the
    getters raise while they are unset)."""
    keys = ("run_id", "node_id", "task_id")
    before = [getattr(TaskIdentity, f"_{key}") for key in keys]
    for key in keys:
        setattr(TaskIdentity, key, 0)
    try:
        yield
    finally:
        for key, value in zip(keys, before, strict=True):
            setattr(TaskIdentity, f"_{key}", value)


def _first_examples(
    data: NodeData, client: int, examples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = data.train_shard(client, torch.device("cpu"))
    return images[:examples].clone(), labels[:examples].clone()


def _load(reference: str) -> ClientApp:
    """The ClientApp that `reference` ("module:attribute") names."""
    module, _, name = reference.partition(":")
    try:
        app = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise AuditError(f"cannot load the ClientApp {reference!r}: {err}") from err
    if not isinstance(app, ClientApp):
        raise AuditError(f"{reference!r} is not a Flower ClientApp")
    return app


def _train(
    app: ClientApp, settings: Settings, message: Message, client: int, data_file: Path
) -> Message:
    """The ClientApp's reply to `message` on a node that serves `client`
    with its own `data_file` (SecAgg+'s masking off: the audit reads what
    the sum reveals, not the masked vector)."""
    run_config = {**settings.to_run_config(), "secure-aggregation": "off"}
    context = Context(
        run_id=0, node_id=client, state=RecordDict(), run_config=run_config,
        node_config={"partition-id": client, "num-partitions": settings.num_clients,
                     "data-file": str(data_file)},
    )  # fmt: skip
    try:
        reply = app(message, context)
    except Exception as err:  # Flower re-raises what the handler raised
        raise AuditFailed(f"client {client} failed to train: {err}") from err
    if reply.has_error():
        raise AuditFailed(f"client {client} failed to train: {reply.error.reason}")
    return reply


def _update(received: ArrayRecord, model: nn.Module) -> dict[str, torch.Tensor]:
    """new - old for the trained parameters among the entries received."""
    sent = dict(model.named_parameters())
    state = received.to_torch_state_dict()
    return {
        name: state[name].float() - sent[name].detach().float()
        for name in state
        if name in sent and sent[name].requires_grad
    }


def _what_it_sees(
    settings: Settings,
    observed: Mapping[str, torch.Tensor],
    model: nn.Module,
    clients: tuple[int, ...],
    examples: int,
) -> str:
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    seen = sum(v.numel() for v in observed.values())
    whose = (
        f"the sum of {len(clients)} clients' updates (SecAgg+)"
        if len(clients) > 1
        else f"client {clients[0]}'s update"
    )
    if settings.dp:  # the client calibrates for the shard it has: `examples`
        whose += (
            f", DP-SGD at epsilon {settings.dp_epsilon:g} for a client of "
            f"{examples} example{'s' if examples > 1 else ''}"
        )
    if settings.central_dp != "off":
        whose += (
            ", clipped by the client"
            if settings.central_clip_on == "client"
            else ", before the server clips and noises it"
        )
    return f"{whose}: {seen:,} of the model's {trained:,} trained entries"

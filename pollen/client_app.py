"""ClientApp: receive the global model, train it on this client's shard, reply.

A node serves one client (its `partition-id`) or, in a simulation with fewer
nodes than clients, several; the server names the client in each message.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from .settings import Settings
from .strategies.fedavg import CLIENT_KEY
from .task import client_shard, federated_data
from .task.models import build_model
from .task.train import Preprocess, pick_device, train_sgd

app = ClientApp()


@cache
def _settings(items: frozenset) -> Settings:
    return Settings.from_run_config(dict(items))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (its node config)."""
    record = ConfigRecord(
        {
            CLIENT_KEY: int(context.node_config["partition-id"]),
            "num-partitions": int(context.node_config["num-partitions"]),
        }
    )
    return Message(RecordDict({"node": record}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local SGD on the named client's shard, starting from the global model."""
    settings = _settings(frozenset(context.run_config.items()))
    config = msg.content["config"]
    client = int(config[CLIENT_KEY])
    server_round = int(config["server-round"])
    if not 0 <= client < settings.num_clients:
        raise ValueError(f"client {client} outside 0..{settings.num_clients - 1}")
    device = pick_device(settings.device)
    x, y = client_shard(settings, client, device)
    dataset, _ = federated_data(settings)
    model = build_model(settings.model, dataset.input_shape, dataset.num_classes, 0)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.to(device)
    result = train_sgd(
        model,
        x,
        y,
        epochs=settings.local_epochs,
        batch_size=settings.batch_size,
        lr=float(config["lr"]),
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        preprocess=Preprocess(
            dataset.mean,
            dataset.std,
            normalize=settings.normalize,
            augment=settings.augment and dataset.input_shape[0] == 3,
            device=device,
        ),
        seed=_client_seed(settings.seed, server_round, client),
    )
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    metrics = MetricRecord(
        {"num-examples": result.num_examples, "train-loss": result.loss}
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(state),
            "metrics": metrics,
            "client": ConfigRecord({CLIENT_KEY: client}),
        }
    )
    return Message(content, reply_to=msg)


def _client_seed(seed: int, server_round: int, client: int) -> int:
    return int(
        np.random.SeedSequence([seed, server_round, client]).generate_state(1)[0]
    )

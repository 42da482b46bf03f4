"""The compute floor of a FedAvg run: the same training in one process.

pollen's own partition, client seeds and `train_local`, every client in
turn on tensors loaded beforehand, their models averaged by shard size, and
nothing else: no federation, no messages, no evaluation between rounds.
`benchmarks/throughput.py` times it against `pollen run`, and
`tests/test_compute_floor.py` checks that a real simulation ends at the same
model, so whatever makes the federated path faster is held to this.
"""

from __future__ import annotations

import time
from typing import Any

from ..settings import Settings


def fedavg_floor(settings: Settings) -> dict[str, Any]:
    """Every round of FedAvg with all clients, in this process; each round's
    seconds, and the final model's test accuracy and loss."""
    import torch

    from ..task.inputs import placed_model, settings_model
    from ..task.shards import federated_data
    from ..task.train import (
        ClientOptimizer,
        Preprocess,
        client_seed,
        evaluate,
        pick_device,
        train_local,
    )

    s = settings
    dataset, shards = federated_data(s)
    device = pick_device(s.device)
    model = placed_model(s, settings_model(s, dataset), device)
    prep = Preprocess(dataset.mean, dataset.std, s.normalize,
                      augment=s.augment and dataset.augmentable, device=device)  # fmt: skip
    clients = [
        (dataset.x_train[shard].to(device), dataset.y_train[shard].to(device))
        for shard in shards
    ]
    optimizer = ClientOptimizer(
        s.client_optimizer, s.lr, s.momentum, s.weight_decay, s.client_betas
    )
    weights = [len(y) / sum(len(y) for _, y in clients) for _, y in clients]
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = []
    for server_round in range(1, s.rounds + 1):
        started = time.perf_counter()
        summed = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}  # fmt: skip
        for client, ((x, y), weight) in enumerate(zip(clients, weights, strict=True)):
            model.load_state_dict(global_state)
            train_local(
                model, x, y, epochs=s.local_epochs, batch_size=s.batch_size,
                optimizer=optimizer, preprocess=prep,
                seed=client_seed(s.seed, server_round, client),
                max_grad_norm=s.max_grad_norm,
            )  # fmt: skip
            for name, value in model.state_dict().items():
                summed[name] += weight * value.float()
        global_state = {
            k: v.to(global_state[k].dtype) for k, v in summed.items()
        }  # fmt: skip
        seconds.append(time.perf_counter() - started)
    model.load_state_dict(global_state)
    test_prep = Preprocess(dataset.mean, dataset.std, s.normalize, device=device)
    loss, accuracy = evaluate(model, dataset.x_test.to(device), dataset.y_test.to(device),
                              batch_size=s.test_batch_size, preprocess=test_prep)  # fmt: skip
    return {"rounds": seconds, "accuracy": accuracy, "loss": loss}

"""SCAFFOLD with client momentum, three ways, side by side in one process.

    .venv/bin/python benchmarks/scaffold_momentum.py -c configs/niid-bench-fmnist.toml \
        -c "data-root='../shared/data'" [--rounds 20] [--momentum 0.9] \
        [--variants inside,outside,plain,fedavg,fedavg-plain] [--out FILE.json]

The run config (pollen's pyproject defaults, then each -c as `pollen run`
takes it) fixes the data, partition, model, client sampling and client
optimiser; each variant then trains the same clients on the same batches
(pollen's shards, client seeds, sampler and `train_loop`), the server takes
the example-weighted mean of the models and c <- c + (1/N) sum Delta c_k,
and the global model is tested after every round. With x the received
model, y_k the client's after K steps of rate eta, g the data gradient:

- inside (a, what pollen runs): d = g + (c - c_k) goes through SGD's
  momentum buffer m <- rho m + d, y <- y - eta m; c_k^+ = c_k - c +
  (x - y_k) / (eta a), a = FedNova's effective steps of K steps under rho
  (pollen.task.objectives.ControlTerm itself).
- outside (b, NIID-Bench's experiments.py): momentum SGD on g alone, then
  y <- y - eta (c - c_k) after each step; c_k^+ = c_k - c + (x - y_k) /
  (eta K).
- plain (c, the paper's Algorithm 1): (a) with rho = 0, where (a) and (b)
  are the same update.
- fedavg, fedavg-plain: FedAvg with rho and with rho = 0, for reference.

No Flower, Ray or messages: the rounds are pollen's arithmetic alone, so a
variant costs its training and one test pass a round. The table gives the
final accuracy, the mean of the last 5 rounds, the best and the round-10
accuracy; --out keeps every round's accuracy (rewritten after each round).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pollen.deployment.run_config import resolve_settings
from pollen.protocol import CONFIG, CONTROL, LR
from pollen.settings import Settings
from pollen.strategies.sampling import sample_clients
from pollen.task.inputs import settings_model
from pollen.task.objectives import ControlTerm, LocalObjective
from pollen.task.shards import federated_data
from pollen.task.train import (
    ClientOptimizer,
    OptimizerStep,
    Preprocess,
    ShuffledBatches,
    client_seed,
    evaluate,
    pick_device,
    train_loop,
    trainable,
)

APP = Path(__file__).resolve().parent.parent
VARIANTS = ("inside", "outside", "plain", "fedavg", "fedavg-plain")


class OutsideControl(ControlTerm):
    """(b): no gradient term; the step rule applies -eta (c - c_k) after
    each optimiser step, and c_k^+ divides by eta K, not eta a."""

    @torch.no_grad()
    def add_gradients(self, named: dict[str, nn.Parameter]) -> None:
        self.steps += 1

    @torch.no_grad()
    def save(self, context: Context, client: int, named: dict) -> None:
        momentum, self.momentum = self.momentum, 0.0  # a(K, 0) = K
        try:
            super().save(context, client, named)
        finally:
            self.momentum = momentum


class StepThenCorrect(OptimizerStep):
    """Clip, step, then y <- y - eta (c - c_k) outside the momentum buffer."""

    def __init__(self, model: nn.Module, optimizer: ClientOptimizer,
                 max_grad_norm: float, term: ControlTerm) -> None:  # fmt: skip
        super().__init__(model, optimizer, max_grad_norm)
        self.term, self.named, self.lr = term, trainable(model), optimizer.lr

    @torch.no_grad()
    def step(self) -> None:
        super().step()
        for name, correction in self.term.correction.items():
            self.named[name].sub_(correction, alpha=self.lr)


@dataclass
class Federation:
    """The run's data, model and clients, loaded once for every variant."""

    settings: Settings
    device: torch.device

    def __post_init__(self) -> None:
        s = self.settings
        self.dataset, shards = federated_data(s)
        self.model = settings_model(s, self.dataset).to(self.device)
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.prep = Preprocess(self.dataset.mean, self.dataset.std, s.normalize,
                               augment=s.augment and self.dataset.augmentable,
                               device=self.device)  # fmt: skip
        self.test_prep = Preprocess(self.dataset.mean, self.dataset.std,
                                    s.normalize, device=self.device)  # fmt: skip
        self.clients = [
            (self.dataset.x_train[shard].to(self.device),
             self.dataset.y_train[shard].to(self.device))
            for shard in shards
        ]  # fmt: skip
        self.skip_single = any(isinstance(m, _BatchNorm) for m in self.model.modules())

    def test(self) -> float:
        _, accuracy = evaluate(
            self.model, self.dataset.x_test.to(self.device),
            self.dataset.y_test.to(self.device), batch_size=self.settings.test_batch_size,
            preprocess=self.test_prep,
        )  # fmt: skip
        return accuracy


def run_variant(fed: Federation, variant: str, momentum: float,
                rounds: int, record: callable) -> list[float]:  # fmt: skip
    """Train `rounds` rounds of `variant`; each round's test accuracy."""
    s, model = fed.settings, fed.model
    rho = 0.0 if variant in ("plain", "fedavg-plain") else momentum
    scaffold = variant in ("inside", "outside", "plain")
    optimizer = ClientOptimizer(
        s.client_optimizer, s.lr, rho, s.weight_decay, s.client_betas
    )
    model.load_state_dict(fed.initial)
    names = list(trainable(model))
    c = {n: torch.zeros_like(p) for n, p in trainable(model).items()}
    context = Context(0, 0, {}, RecordDict(), {})
    accuracies: list[float] = []
    for server_round in range(1, rounds + 1):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        chosen = sample_clients(s.num_clients, s.client_frac, s.seed, server_round,
                                minimum=s.min_train_nodes)  # fmt: skip
        total = sum(len(fed.clients[k][1]) for k in chosen)
        summed = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in start.items()}
        deltas = {n: torch.zeros_like(v) for n, v in c.items()}
        for client in chosen:
            x, y = fed.clients[client]
            model.load_state_dict(start)
            term = (OutsideControl if variant == "outside" else ControlTerm)(rho)
            if scaffold:
                content = RecordDict({
                    CONTROL: ArrayRecord({n: v.cpu() for n, v in c.items()}),
                    CONFIG: ConfigRecord({LR: s.lr}),
                })  # fmt: skip
                named = trainable(model)
                term.load(context, client, {n: named[n] for n in names}, content)
            rule = (StepThenCorrect(model, optimizer, s.max_grad_norm, term)
                    if variant == "outside"
                    else OptimizerStep(model, optimizer, s.max_grad_norm))  # fmt: skip
            seed = client_seed(s.seed, server_round, client)
            batches = ShuffledBatches(x, y, fed.prep, batch_size=s.batch_size,
                                      num_epochs=s.local_epochs, seed=seed,
                                      skip_single=fed.skip_single)  # fmt: skip
            torch.manual_seed(seed + 2)
            objective = LocalObjective(0.0, term if scaffold else None)
            train_loop(model, batches, rule, objective)
            if scaffold:
                term.save(context, client, trainable(model))
                for n, d in term.delta.items():
                    deltas[n] += d.to(fed.device)
            weight = len(y) / total
            for k, v in model.state_dict().items():
                summed[k] += weight * v.float()
        model.load_state_dict({k: v.to(start[k].dtype) for k, v in summed.items()})
        for n in c:
            c[n] += deltas[n] / s.num_clients
        accuracies.append(fed.test())
        record(variant, accuracies)
    return accuracies


def summary(accuracies: list[float]) -> str:
    last5 = accuracies[-5:]
    at10 = f"{100 * accuracies[9]:.2f}" if len(accuracies) >= 10 else "n/a"
    return (f"{100 * accuracies[-1]:.2f} | {100 * sum(last5) / len(last5):.2f} | "
            f"{100 * max(accuracies):.2f} | {at10}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--rounds", type=int, help="default: the run config's")
    parser.add_argument(
        "--momentum", type=float, default=0.9, help="rho of the momentum variants"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(
            f"unknown variants {sorted(unknown)}; allowed: {', '.join(VARIANTS)}"
        )
    settings = resolve_settings(APP, args.run_config)
    rounds = args.rounds or settings.rounds
    torch.manual_seed(settings.seed)
    fed = Federation(replace(settings, rounds=rounds), pick_device(settings.device))
    results: dict[str, list[float]] = {}
    if args.out and args.out.exists():
        results = json.loads(args.out.read_text())["accuracy"]

    def record(variant: str, accuracies: list[float]) -> None:
        results[variant] = accuracies
        if args.out:
            args.out.write_text(json.dumps({"settings": settings.to_run_config(),
                                            "rounds": rounds, "momentum": args.momentum,
                                            "accuracy": results}, indent=1))  # fmt: skip

    seconds = {}
    for variant in variants:
        if len(results.get(variant, [])) >= rounds:
            continue  # done in an earlier invocation with the same --out
        started = time.perf_counter()
        run_variant(fed, variant, args.momentum, rounds, record)
        seconds[variant] = time.perf_counter() - started
        print(
            f"{variant}: {summary(results[variant])} ({seconds[variant]:.0f} s)",
            flush=True,
        )
    print(f"\n{rounds} rounds, momentum {args.momentum:g} where a variant has it\n")
    print("| variant | final (%) | mean of last 5 (%) | best (%) | round 10 (%) |")
    print("|---|---|---|---|---|")
    for variant in variants:
        if variant in results:
            print(f"| {variant} | {summary(results[variant])} |")


if __name__ == "__main__":
    main()

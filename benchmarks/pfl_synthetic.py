"""pfl-research's side of `pfl_side_by_side.py`: FedAvg on pollen's Synthetic(1, 1).

    PFL_VENV/bin/python benchmarks/pfl_synthetic.py DATA.npz --rounds 20
        [--lr 0.01] [--batch-size 10] [--epochs 1] [--weight-decay 5e-4]
        [--max-grad-norm 10] [--test-batch-size 128] [--seed 845] [--threads 1]

Runs in pfl's own virtual environment (never pollen's): it imports pfl and
torch only, not pollen. `pfl_side_by_side.py` writes DATA.npz: every
client's training examples (`x`, `y`, client k's rows `offsets[k]` to
`offsets[k + 1]`), the global test set (`x_test`, `y_test`), pollen's
initial model (`weight`, `bias`), the clients of each round of the pollen
run it follows (`cohorts`, one row per round) and the order each of them
took its examples in (`orders`: their permutations, one after another), so
that both frameworks train the same model from the same start on the same
clients' same batches.

The training is pfl's: a `FederatedDataset` of the clients, whose user
sampler hands out the given cohorts, `FederatedAveraging` on a
`SimulatedBackend` weighted by data points (`WeightByDatapoints`), a
`PyTorchModel` whose local optimiser is plain SGD (weight decay as pollen's)
and whose central optimiser is SGD at learning rate 1 (the model plus the
weighted mean of the clients' updates: FedAvg), local gradients clipped as
pollen's (`local_max_grad_norm`), and a callback that evaluates the global
model on the test set after every central iteration (`EveryRound`).

Prints one JSON line on stdout: the wall-clock time (`time.time()`) when
the first central iteration began, each iteration's seconds (training and
central evaluation, as pollen's rounds count theirs), each one's test
accuracy, and the pfl and torch versions.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from itertools import pairwise

import numpy as np
import pfl
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, StringMetricName, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn

ACCURACY = StringMetricName("test accuracy")


class LogisticRegression(nn.Module):
    """pollen's `logreg`: one linear layer to the logits, with the `loss` and
    `metrics` methods pfl's `PyTorchModel` calls on a batch."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(weight))
            self.linear.bias.copy_(torch.from_numpy(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean cross-entropy (pollen's local loss)."""
        self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Weighted]:
        """Summed loss and correct predictions, weighted by the batch size."""
        self.eval()
        logits = self(x)
        return {
            "loss": Weighted(
                F.cross_entropy(logits, y, reduction="sum").item(), len(y)
            ),
            "accuracy": Weighted((logits.argmax(1) == y).sum().item(), len(y)),
        }


def replay(cohorts: np.ndarray) -> Callable[[], int]:
    """A pfl user sampler (`() -> user id`) that hands out the clients of
    `cohorts`, round after round: pfl asks it once per user of a cohort."""
    ids: Iterator[int] = iter(int(c) for c in cohorts.ravel())
    return lambda: next(ids)


def client_datasets(data: dict[str, np.ndarray]) -> Callable[[int], Dataset]:
    """pfl's `make_dataset_fn`: a client's training examples as a `Dataset`
    of tensors (labels stay int64; pfl would turn a numpy array into
    float32), in the order pollen's client took them that round: the next
    of `orders` (pfl makes a sampled client's dataset once per round, in
    cohort order)."""
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    offsets, orders = data["offsets"], torch.from_numpy(data["orders"]).long()
    taken = 0  # of `orders`

    def make(client: int) -> Dataset:
        nonlocal taken
        start, end = int(offsets[client]), int(offsets[client + 1])
        idx = start + orders[taken : taken + end - start]
        taken += end - start
        return Dataset((x[idx], y[idx]), user_id=str(client))

    return make


def test_metric(name: str) -> StringMetricName:
    """The name of a metric on the global test set."""
    return StringMetricName(f"test {name}")


class EveryRound(TrainingProcessCallback):
    """After each central iteration: the global model's accuracy on the test
    set, and the time. pfl's `CentralEvaluationCallback` evaluates before
    training and after every iteration but the first (it skips iteration
    0), where pollen evaluates after every round; this evaluates as pollen
    does, through the model's own `evaluate`."""

    def __init__(self, test: Dataset, eval_params: NNEvalHyperParams) -> None:
        self.test = test
        self.eval_params = eval_params
        self.started = 0.0  # time.time() at the start of the first iteration
        self.ends: list[float] = []  # time.monotonic() at each iteration's end
        self.accuracy: list[float] = []
        self._start = 0.0

    def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
        self.started, self._start = time.time(), time.monotonic()
        return Metrics()

    def after_central_iteration(
        self, aggregate_metrics: Metrics, model: PyTorchModel, *, central_iteration: int
    ) -> tuple[bool, Metrics]:
        metrics = model.evaluate(self.test, test_metric, self.eval_params)
        self.accuracy.append(metrics[ACCURACY].overall_value)
        self.ends.append(time.monotonic())
        return False, metrics

    @property
    def rounds(self) -> list[float]:
        """Seconds of each central iteration, its evaluation included."""
        marks = [self._start, *self.ends]
        return [b - a for a, b in pairwise(marks)]


def train(args: argparse.Namespace, data: dict[str, np.ndarray]) -> EveryRound:
    """Run FedAvg for `args.rounds` central iterations; return its clock."""
    cohorts = data["cohorts"][: args.rounds]
    clients = FederatedDataset(client_datasets(data), replay(cohorts))
    test = Dataset((torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])))
    module = LogisticRegression(data["weight"], data["bias"])
    model = PyTorchModel(
        module,
        local_optimizer_create=partial(
            torch.optim.SGD, momentum=0.0, weight_decay=args.weight_decay
        ),
        # the model moves by the weighted mean update: FedAvg
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(
        training_data=clients, val_data=clients, postprocessors=[WeightByDatapoints()]
    )
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=len(cohorts),
        # pfl also evaluates each client before and after its training in
        # the iterations this divides (always the first); pollen does not
        evaluation_frequency=len(cohorts) + 1,
        train_cohort_size=cohorts.shape[1],
        val_cohort_size=None,
    )
    train_params = NNTrainHyperParams(
        local_batch_size=args.batch_size,
        local_num_epochs=args.epochs,
        local_learning_rate=args.lr,
        local_max_grad_norm=args.max_grad_norm or None,
    )
    eval_params = NNEvalHyperParams(local_batch_size=args.test_batch_size)
    clock = EveryRound(test, eval_params)
    FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        model_eval_params=eval_params,
        callbacks=[clock],
    )
    return clock


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", help="the .npz that pfl_side_by_side.py wrote")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--max-grad-norm", type=float, default=10.0)
    parser.add_argument("--test-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=845)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)  # pfl's algorithm and backend draw from numpy's
    torch.manual_seed(args.seed)
    with np.load(args.data) as npz:
        data = {name: npz[name] for name in npz.files}
    clock = train(args, data)
    result = {
        "started": clock.started,
        "rounds": clock.rounds,
        "accuracy": clock.accuracy,
        "pfl": pfl.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

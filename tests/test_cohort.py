"""The cohort trainer against K sequential trainings on the same batches
(every objective and optimiser, unequal shards, chunks, BatchNorm models
and their policies) and against a gradient step computed by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from torch import nn

from pollen.protocol import CONFIG, CONTROL, LR, feddyn_state_key, scaffold_state_key
from pollen.task import cohort as cohort_module
from pollen.task.cohort import (
    HEAP_TENSOR_BYTES,
    SOLO_CLIENTS,
    Footprint,
    chunk_count,
    client_footprint,
    cohort_problem,
    split_evenly,
    train_cohort,
)
from pollen.task.models import build_model
from pollen.task.objectives import ControlTerm, DynTerm, LocalObjective, ProxTerm
from pollen.task.sharing import Sharing
from pollen.task.train import ClientOptimizer, Preprocess, train_local

PREP = Preprocess((0.5,), (0.25,))
SIZES = (37, 16, 9, 40)  # short last batches, and one client with fewer batches
# at batch 8: short last batches of 5, 6 and 5 at different steps (a stacked
# step with batches of 8, 6 and 5), two 1-sample batches BatchNorm skips, and
# one client that finishes its last steps alone
BN_SIZES = (21, 13, 30, 17, 25)


def shards(sizes=SIZES, shape=(1, 28, 28), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (n,), generator=g),
        )
        for n in sizes
    ]


def objective_for(
    kind: str, sam: float, client: int, model: nn.Module, policy: str = "shared"
) -> LocalObjective:
    """A loaded objective of `kind`, its client state non-zero."""
    terms = {"plain": None, "prox": ProxTerm(0.1), "feddyn": DynTerm(0.05),
             "scaffold": ControlTerm(0.0)}  # fmt: skip
    objective = LocalObjective(sam, terms[kind])
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(100 + client)
    state = {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in params.items()}
    context = Context(1, 1, {}, RecordDict(), {})
    context.state[feddyn_state_key(client)] = ArrayRecord(state)
    context.state[scaffold_state_key(client)] = ArrayRecord(state)
    control = {n: torch.full(p.shape, 0.02) for n, p in params.items()}
    content = RecordDict(
        {CONTROL: ArrayRecord(control), CONFIG: ConfigRecord({LR: 0.05})}
    )
    objective.load(context, client, model, Sharing.of(policy, model), content)
    return objective


def own_batchnorm(model: nn.Module, client: int) -> None:
    """Give `model` a client's own BatchNorm entries, as FedBN restores them
    from its state: scale, shift, running statistics and counter."""
    g = torch.Generator().manual_seed(200 + client)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(1 + torch.rand(m.running_var.shape, generator=g))
                m.num_batches_tracked.fill_(3 + client)


def both_ways(
    model_name: str,
    optimizer: ClientOptimizer,
    kind: str = "plain",
    sam: float = 0.0,
    max_grad_norm: float = 0.0,
    memory_bytes: int = 0,
    epochs: int = 2,
    sizes: tuple[int, ...] = SIZES,
    policy: str = "shared",
    dtype: torch.dtype = torch.float32,
):
    """(sequential models, results, objectives), (cohort models, results,
    objectives); under `policy` fedbn or silobn each client starts from its
    own BatchNorm entries. Models and inputs in `dtype`."""
    data = shards(sizes)
    base = build_model(model_name, (1, 28, 28), 10, seed=3).to(dtype)
    prep = PREP if dtype == torch.float32 else lambda x, g: PREP(x, g).to(dtype)
    seeds = [11 + k for k in range(len(data))]
    arms = []
    for arm in ("sequential", "cohort"):
        models = [copy.deepcopy(base) for _ in data]
        for k, model in enumerate(models):
            if policy != "shared":
                own_batchnorm(model, k)
        objectives = [
            objective_for(kind, sam, k, m, policy) for k, m in enumerate(models)
        ]
        common = dict(epochs=epochs, batch_size=8, optimizer=optimizer,
                      max_grad_norm=max_grad_norm)  # fmt: skip
        if arm == "sequential":
            results = [
                train_local(m, x, y, preprocess=prep, seed=s, objective=o, **common)
                for m, (x, y), s, o in zip(models, data, seeds, objectives, strict=True)
            ]
        else:
            results = train_cohort(
                models, data, preprocess=[prep] * len(data), seeds=seeds,
                objectives=objectives, memory_bytes=memory_bytes, **common,
            )  # fmt: skip
        arms.append((models, results, objectives))
    return arms


def assert_same(arms, lr_noise: float = 0.0) -> None:
    """Equal steps, examples, losses (relative 1e-5) and parameters
    (relative 1e-5, absolute 1e-6). With `lr_noise`, Adam's: it divides each
    entry's step by that entry's own gradient size, so an entry whose
    gradient is float noise (both ways it sums the batch in its own order)
    may move up to lr either way; at most 1 in 10,000 entries may then
    differ, by at most `lr_noise`."""
    (seq_models, seq_results, _), (coh_models, coh_results, _) = arms
    for seq, coh in zip(seq_results, coh_results, strict=True):
        assert (coh.steps, coh.num_examples) == (seq.steps, seq.num_examples)
        assert coh.loss == pytest.approx(seq.loss, rel=1e-5)
    for seq, coh in zip(seq_models, coh_models, strict=True):
        pairs = zip(seq.state_dict().items(), coh.state_dict().values(), strict=True)
        for (name, a), b in pairs:
            if not lr_noise:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
                continue
            off = ~torch.isclose(b, a, rtol=1e-5, atol=1e-6)
            assert int(off.sum()) <= max(1, a.numel() // 10_000), name
            assert float((b - a).abs().max()) <= lr_noise, name


SGD = ClientOptimizer("sgd", 0.05, momentum=0.9, weight_decay=5e-4)


@pytest.mark.parametrize(
    "optimizer",
    [
        SGD,
        ClientOptimizer("sgd", 0.05, momentum=0.0),
        ClientOptimizer("adam", 1e-3, weight_decay=1e-4),
        ClientOptimizer("adamw", 1e-3, weight_decay=1e-2),
    ],
    ids=["sgd-momentum-wd", "sgd", "adam", "adamw"],
)
def test_a_cohort_trains_as_its_clients_do_one_by_one(optimizer) -> None:
    noise = 0.05 * optimizer.lr if optimizer.name != "sgd" else 0.0
    assert_same(both_ways("mlp", optimizer), noise)


@pytest.mark.parametrize(
    ("kind", "sam"),
    [
        ("prox", 0.0),
        ("feddyn", 0.0),
        ("scaffold", 0.0),
        ("plain", 0.05),
        ("prox", 0.05),
    ],
    ids=["fedprox", "feddyn", "scaffold", "sam", "prox-sam"],
)
def test_every_objective_trains_as_it_does_alone(kind: str, sam: float) -> None:
    optimizer = ClientOptimizer(
        "sgd", 0.05, momentum=0.0 if kind == "scaffold" else 0.9
    )
    arms = both_ways("logreg", optimizer, kind, sam)
    assert_same(arms)
    (seq_models, _, seq_objectives), (coh_models, _, coh_objectives) = arms
    for k, (seq, coh) in enumerate(zip(seq_objectives, coh_objectives, strict=True)):
        seq_context = Context(1, 1, {}, RecordDict(), {})
        coh_context = Context(1, 1, {}, RecordDict(), {})
        seq.save(seq_context, k, seq_models[k])
        coh.save(coh_context, k, coh_models[k])
        assert set(coh_context.state) == set(seq_context.state)
        for key in seq_context.state:  # FedDyn's h_k+, SCAFFOLD's c_k+
            for name, array in seq_context.state[key].items():
                np.testing.assert_allclose(
                    coh_context.state[key][name].numpy(), array.numpy(),
                    rtol=1e-4, atol=1e-5,
                )  # fmt: skip


@pytest.mark.parametrize("model", ["simple-cnn", "cnn-gn"])
def test_convolutional_models_train_as_alone_with_clipping(model: str) -> None:
    assert_same(both_ways(model, SGD, "prox", max_grad_norm=1.0, epochs=1))


CHUNK_SIZES = (37, 16, 9, 40, 23, 30, 12)


@pytest.fixture
def chunks_trained(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The shard sizes of each chunk `train_cohort` trains, in order."""
    seen: list[list[int]] = []
    train_chunk = cohort_module._train_chunk

    def spy(models, clients, *args):
        seen.append([len(c.shard[1]) for c in clients])
        return train_chunk(models, clients, *args)

    monkeypatch.setattr(cohort_module, "_train_chunk", spy)
    return seen


def per_client_bytes(model_name: str, objective: LocalObjective, sizes) -> int:
    """What `train_cohort` estimates one client takes (2 epochs, batch 8)."""
    model = build_model(model_name, (1, 28, 28), 10, seed=3)
    sample = PREP(shards(sizes)[0][0][:8], None)
    return client_footprint(model, sample, 8, SGD, objective, 2 * max(sizes)).bytes


def test_chunks_train_as_one_cohort(chunks_trained: list[list[int]]) -> None:
    objective = LocalObjective(0.0, DynTerm(0.05))
    per_client = per_client_bytes("mlp", objective, CHUNK_SIZES)
    whole = both_ways("mlp", SGD, "feddyn", sizes=CHUNK_SIZES)
    assert chunks_trained == [sorted(CHUNK_SIZES, reverse=True)]
    for clients, expected in ((1, [[40], [37], [30], [23], [16], [12], [9]]),
                              (4, [[40, 37, 30], [23, 16, 12, 9]])):  # fmt: skip
        chunks_trained.clear()
        chunked = both_ways(
            "mlp", SGD, "feddyn", memory_bytes=clients * per_client, sizes=CHUNK_SIZES
        )
        assert chunks_trained == expected  # largest first, sizes differ by <= 1
        assert_same([whole[1], chunked[1]])


def test_chunks_split_evenly_and_keep_cpu_tensors_on_the_heap() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    mlp = Footprint(bytes=2_000_000, largest=784 * 128 * 4)  # 83 under the cap
    assert HEAP_TENSOR_BYTES // mlp.largest == 83
    assert chunk_count(100, mlp, 0, cpu) == 2
    assert [len(c) for c in split_evenly(range(100), 2)] == [50, 50]  # not 83 + 17
    assert chunk_count(80, mlp, 0, cpu) == 1
    assert chunk_count(100, mlp, 0, gpu) == 1  # CUDA's allocator keeps blocks
    assert chunk_count(100, mlp, 30 * 2_000_000, gpu) == 4  # 30 fit a chunk
    assert chunk_count(100, mlp, 1, cpu) == 100  # at least one client a chunk
    at_the_bound = Footprint(bytes=1, largest=2**20)  # 32 x 1 MiB is 32 MiB
    assert chunk_count(32, at_the_bound, 0, cpu) == 2
    assert split_evenly([5, 4, 3, 2, 1, 0, 9], 3) == [[5, 4], [3, 2], [1, 0, 9]]
    assert split_evenly([1, 2], 1) == [[1, 2]]


class TransposedScale(nn.Module):
    """A user's model whose parameter enters transposed: `vmap` gives its
    gradient in the transposed layout, which the fused update must not
    misread."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(28, 28) + 0.5)
        self.head = nn.Linear(28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.squeeze(1) * self.scale.t()).flatten(1))


@pytest.mark.parametrize("optimizer", [SGD, ClientOptimizer("adam", 1e-2)])
def test_a_parameter_used_transposed_trains_as_alone(
    optimizer: ClientOptimizer,
) -> None:
    torch.manual_seed(0)
    base, data = TransposedScale(), shards(sizes=(24, 17, 30, 8))
    seeds = list(range(len(data)))
    common = dict(epochs=1, batch_size=8, optimizer=optimizer, max_grad_norm=1.0)
    sequential = [copy.deepcopy(base) for _ in data]
    for model, (x, y), seed in zip(sequential, data, seeds, strict=True):
        train_local(
            model, x, y, preprocess=PREP, seed=seed, objective=LocalObjective(),
            **common,
        )  # fmt: skip
    cohort = [copy.deepcopy(base) for _ in data]
    train_cohort(
        cohort, data, preprocess=[PREP] * len(data), seeds=seeds,
        objectives=[LocalObjective() for _ in data], **common,
    )  # fmt: skip
    for alone, together in zip(sequential, cohort, strict=True):
        torch.testing.assert_close(together.scale, alone.scale, rtol=1e-5, atol=1e-6)


def test_one_step_matches_the_gradient_by_hand() -> None:
    """Three clients (a stacked step: more than `SOLO_CLIENTS`), logistic
    regression on two examples each, one SGD step:
    theta - lr (softmax(z) - onehot(y)) x^T / n, by hand."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 3))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[0.1, -0.2], [0.0, 0.3], [0.2, 0.1]]))
        model[1].bias.zero_()
    xs = [torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([[3.0, 0.0], [1.0, 1.0]]),
          torch.tensor([[0.5, -1.0], [2.0, 2.0]])]  # fmt: skip
    ys = [torch.tensor([0, 2]), torch.tensor([1, 1]), torch.tensor([2, 0])]
    assert len(xs) > SOLO_CLIENTS
    identity = lambda x, g: x  # noqa: E731
    models = [copy.deepcopy(model) for _ in xs]
    train_cohort(
        models, [(x.view(2, 1, 1, 2), y) for x, y in zip(xs, ys, strict=True)],
        epochs=1, batch_size=2, optimizer=ClientOptimizer("sgd", 0.5, momentum=0.0),
        preprocess=[identity] * 3, seeds=[0, 1, 2],
        objectives=[LocalObjective() for _ in xs],
    )  # fmt: skip
    for trained, x, y in zip(models, xs, ys, strict=True):
        w = model[1].weight.detach().numpy().astype(np.float64)
        z = x.numpy() @ w.T
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        residual = (p - np.eye(3)[y.numpy()]) / 2
        expected_w = w - 0.5 * residual.T @ x.numpy()
        expected_b = -0.5 * residual.sum(0)
        np.testing.assert_allclose(
            trained[1].weight.detach().numpy(), expected_w, rtol=1e-5
        )
        np.testing.assert_allclose(
            trained[1].bias.detach().numpy(), expected_b, rtol=1e-5, atol=1e-7
        )
    assert not torch.equal(models[0][1].weight, models[1][1].weight)


def test_what_a_cohort_refuses_and_what_it_takes() -> None:
    plain = LocalObjective()
    assert cohort_problem(build_model("mlp", (1, 28, 28), 10, 0), plain, SGD) is None
    bn = build_model("mlp-bn", (1, 28, 28), 10, 0)
    assert cohort_problem(bn, plain, SGD) is None
    bn[2].momentum = None  # a cumulative average: 1 / num_batches_tracked
    assert "momentum=None" in cohort_problem(bn, plain, SGD)
    dropout = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(784, 10))
    assert "dropout" in cohort_problem(dropout, plain, SGD)

    class Opaque:  # a user's term without the affine form
        exclude_bn = False

    assert "affine" in cohort_problem(dropout[::2], LocalObjective(0.0, Opaque()), SGD)


ADAM = ClientOptimizer("adam", 1e-3, weight_decay=1e-4)
F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize(
    ("model", "optimizer", "kind", "sam", "dtype"),
    [
        ("mlp-bn", SGD, "plain", 0.0, F32),
        ("mlp-bn", SGD, "plain", 0.0, F64),
        ("mlp-bn", ADAM, "prox", 0.0, F64),
        ("mlp-bn", ClientOptimizer("sgd", 0.05, momentum=0.0), "scaffold", 0.0, F64),
        ("mlp-bn", SGD, "prox", 0.05, F64),
        ("cnn", ADAM, "scaffold", 0.0, F32),
        ("cnn", SGD, "prox", 0.0, F64),
        ("cnn", ADAM, "scaffold", 0.0, F64),
    ],
    ids=["mlp-bn-sgd-f32", "mlp-bn-sgd", "mlp-bn-adam-prox", "mlp-bn-scaffold",
         "mlp-bn-prox-sam", "cnn-adam-scaffold-f32", "cnn-sgd-prox",
         "cnn-adam-scaffold"],
)  # fmt: skip
def test_batchnorm_models_train_as_alone_with_their_statistics(
    model: str, optimizer: ClientOptimizer, kind: str, sam: float, dtype: torch.dtype
) -> None:
    """Parameters, running means and variances and batch counters equal the
    sequential ones, over stacked steps whose batches differ in size,
    skipped 1-sample batches and a client finishing alone.

    Mostly in float64: in float32 a few steps of these models on noise
    inputs already amplify rounding past 1e-5 in both trainings alike (a
    max-pool or ReLU tie broken the other way; Adam's steps on the bias
    before a BatchNorm, whose gradient is rounding noise), while in float64
    the two agree to about 1e-12, so there the test holds the arithmetic,
    not the rounding, to 1e-5."""
    arms = both_ways(model, optimizer, kind, sam, sizes=BN_SIZES, dtype=dtype)
    noise = 0.05 * optimizer.lr if optimizer.name != "sgd" else 0.0
    assert_same(arms, noise)
    (_, seq_results, _), (coh_models, _, _) = arms
    for trained, result in zip(coh_models, seq_results, strict=True):
        counters = [b for n, b in trained.named_buffers() if "num_batches" in n]
        assert counters and all(int(c) == result.steps for c in counters)


def test_batchnorm_chunks_train_as_alone(chunks_trained: list[list[int]]) -> None:
    per_client = per_client_bytes(
        "mlp-bn", LocalObjective(0.0, ProxTerm(0.1)), BN_SIZES
    )
    for clients, expected in ((1, [[30], [25], [21], [17], [13]]),
                              (3, [[30, 25], [21, 17, 13]])):  # fmt: skip
        chunks_trained.clear()
        assert_same(
            both_ways("mlp-bn", SGD, "prox", memory_bytes=clients * per_client,
                      sizes=BN_SIZES)
        )  # fmt: skip
        assert chunks_trained == expected


def test_a_shard_without_a_step_is_refused_before_any_client_trains() -> None:
    """As `train_local`: a BatchNorm model skips 1-sample batches, so a
    1-sample shard gives no step. The cohort says so before its first chunk
    (the largest shards) has trained any model in place."""
    base = build_model("mlp-bn", (1, 28, 28), 10, seed=3)
    data = shards((21, 13, 1))
    models = [copy.deepcopy(base) for _ in data]
    with pytest.raises(ValueError, match="a shard of 1 samples gives no training step"):
        train_cohort(
            models, data, epochs=1, batch_size=8, optimizer=SGD,
            preprocess=[PREP] * len(data), seeds=[0, 1, 2],
            objectives=[LocalObjective() for _ in data],
            memory_bytes=1,  # one client a chunk
        )  # fmt: skip
    for model in models:
        for name, value in model.state_dict().items():
            assert torch.equal(value, base.state_dict()[name]), name


@pytest.mark.parametrize("policy", ["fedbn", "silobn"])
def test_local_batchnorm_entries_train_as_alone(policy: str) -> None:
    """FedBN and SiloBN: each client starts from its own BatchNorm entries
    (left out of FedProx's anchor under FedBN) and keeps training them."""
    assert_same(both_ways("cnn", SGD, "prox", sizes=BN_SIZES, policy=policy, dtype=F64))


def test_a_clients_memory_estimate_grows_with_its_batch() -> None:
    model = build_model("cnn-gn", (1, 28, 28), 10, 0)
    sample = PREP(shards(sizes=(4,))[0][0], None)
    small = client_footprint(model, sample, 8, SGD, LocalObjective())
    large = client_footprint(model, sample, 64, SGD, LocalObjective())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert 3 * params < small.bytes < large.bytes
    # the largest tensor: the head's weight (3136 x 128) at batch 8, the
    # first convolution's output (64 x 32 x 28 x 28) at batch 64
    assert small.largest == 3136 * 128 * 4
    assert large.largest == 64 * 32 * 28 * 28 * 4


def test_the_largest_tensor_of_an_mlp_is_its_first_gradient() -> None:
    model = build_model("mlp", (1, 28, 28), 10, 0)
    sample = PREP(shards(sizes=(10,))[0][0], None)
    footprint = client_footprint(model, sample, 10, SGD, LocalObjective())
    assert footprint.largest == 784 * 128 * 4

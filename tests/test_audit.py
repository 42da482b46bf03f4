"""`pollen audit`: the server's view of a round is exactly the client's
update (checked against autograd by hand, under client-side clipping, FedSA
and SecAgg+), the command writes its numbers and picture, and bad input is
refused before anything trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pollen.audit import AuditError
from pollen.audit.inversion import simulated_update
from pollen.audit.server_view import audit_problem, server_view
from pollen.cli import main
from pollen.runs.checkpoints import Checkpoint, save_checkpoint
from pollen.runs.lr_schedule import SCHEDULE_KEY, PlateauSchedule
from pollen.settings import Settings
from pollen.task.train import Preprocess
from tests.conftest import PROJECT, write_mnist_slices

PLAIN = {
    "data-set": "mnist", "model": "cnn-gn", "momentum": 0.0, "weight-decay": 0.0,
    "augment": False, "num-clients": 10, "client-frac": 0.2, "lr": 0.1,
    "local-epochs": 1, "batch-size": 32, "rounds": 10, "seed": 0, "device": "cpu",
}  # fmt: skip


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    root = tmp_path_factory.mktemp("audit-data")
    write_mnist_slices(root / "data", root / "own.npz")
    return root / "data"


@pytest.fixture(scope="module")
def shared_data() -> Path:  # module-scoped twin of conftest's
    from tests.conftest import SHARED_DATA

    if not (SHARED_DATA / "mnist.npz").exists():
        pytest.skip(f"real MNIST not found at {SHARED_DATA}")
    return SHARED_DATA


def settings(data_root: Path, **overrides: object) -> Settings:
    return Settings.from_run_config({**PLAIN, "data-root": str(data_root), **overrides})


def by_hand(view, lr: float, clip: float = 10.0) -> dict[str, torch.Tensor]:
    """-lr x the gradient of the cross-entropy on the client's example(s),
    through the dataset's normalisation, clipped to `max-grad-norm` (10 by
    default): one full-batch SGD step."""
    prep = Preprocess(view.mean, view.std)
    loss = F.cross_entropy(view.model(prep(view.originals, None)), view.labels.long())
    names = list(view.observed)
    params = dict(view.model.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in names])
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    scale = min(1.0, clip / (norm + 1e-6))
    return {n: -lr * scale * g for n, g in zip(names, grads, strict=True)}


def assert_same_update(
    observed: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    """Equal up to float32 rounding: the client's new - old loses the low
    bits of a small step, so the tolerance scales with each entry's size."""
    assert set(observed) == set(expected)
    for name, update in observed.items():
        scale = float(expected[name].abs().max())
        torch.testing.assert_close(update, expected[name], rtol=1e-3, atol=1e-4 * scale)


def test_the_view_is_one_sgd_step_on_the_clients_example(
    data_root: Path, tmp_path: Path
) -> None:
    view = server_view(settings(data_root), client=None, examples=1, workdir=tmp_path)
    assert view.round == 1 and view.clients == (view.clients[0],)
    training = view.training
    assert (training.steps, training.lr, training.clients) == (1, 0.1, 1)
    assert training.max_grad_norm == 10.0  # replayed, as the client clipped
    assert (
        view.originals.shape == (1, 1, 28, 28) and view.originals.dtype == torch.uint8
    )
    assert set(view.observed) == {n for n, _ in view.model.named_parameters()}
    assert_same_update(view.observed, by_hand(view, 0.1))
    assert "421,738 of the model's 421,738" in view.sees


def test_client_side_clipping_is_what_the_server_sees(
    data_root: Path, tmp_path: Path
) -> None:
    clipped = settings(
        data_root, **{"central-dp": "fixed", "central-clip-on": "client",
                      "central-clip-norm": 0.01},
    )  # fmt: skip
    view = server_view(clipped, client=None, examples=1, workdir=tmp_path)
    norm = math.sqrt(
        sum(float((v.double() ** 2).sum()) for v in view.observed.values())
    )
    assert norm == pytest.approx(0.01, rel=1e-3)
    assert "clipped by the client" in view.sees
    raw = by_hand(view, 0.1)
    cosine = (
        sum(float((view.observed[n] * raw[n]).sum()) for n in raw)
        / norm
        / (math.sqrt(sum(float((g.double() ** 2).sum()) for g in raw.values())))
    )
    assert cosine == pytest.approx(1.0, abs=1e-4)  # the same direction, scaled


def test_secagg_shows_the_sum_of_the_rounds_clients(
    data_root: Path, tmp_path: Path
) -> None:
    three = {"client-frac": 0.3}  # SecAgg+ needs 3 clients a round
    secure = server_view(
        settings(data_root, **three, **{"secure-aggregation": "secagg+"}),
        client=None, examples=1, workdir=tmp_path / "sum",
    )  # fmt: skip
    assert len(secure.clients) == 3 and secure.training.clients == 3
    alone = [
        server_view(
            settings(data_root, **three),
            client=c,
            examples=1,
            workdir=tmp_path / f"{c}",
        )
        for c in secure.clients
    ]
    summed = {n: sum(view.observed[n] for view in alone) for n in secure.observed}
    assert_same_update(secure.observed, summed)
    assert "the sum of 3 clients' updates" in secure.sees


def test_fedsa_shows_only_the_lora_a_matrices(data_root: Path, tmp_path: Path) -> None:
    """Only the A matrices travel; in a client's first step B is zero, so A
    does not move (one step sends zeros), in its second it does."""
    fedsa = {"strategy": "fedsa", "model": "cnn-lora", "lora-dropout": 0.0}
    one, two = (
        server_view(
            settings(data_root, **fedsa, **{"local-epochs": epochs}),
            client=None,
            examples=2,
            workdir=tmp_path / str(epochs),
        )
        for epochs in (1, 2)
    )
    assert set(one.observed) == set(two.observed)
    assert one.observed and all("lora_a" in name for name in one.observed)
    assert not any(update.any() for update in one.observed.values())
    assert all(update.any() for update in two.observed.values())
    with pytest.raises(AuditError, match=r"has BatchNorm.*--examples 2 or more"):
        server_view(settings(data_root, **fedsa), client=None, examples=1,
                    workdir=tmp_path)  # fmt: skip


def test_a_checkpoint_gives_the_next_round_its_model_and_rate(
    data_root: Path, tmp_path: Path
) -> None:
    s = settings(data_root)
    first = server_view(s, client=None, examples=1, workdir=tmp_path / "1")
    model = {k: v.detach().numpy() + 0.01 for k, v in first.model.state_dict().items()}
    schedule = PlateauSchedule.from_settings(s)
    schedule.lr = 0.05
    checkpoint = Checkpoint(3, model, {}, {SCHEDULE_KEY: schedule.state_dict()})
    view = server_view(s, client=None, examples=1, workdir=tmp_path / "4",
                       checkpoint=checkpoint)  # fmt: skip
    assert view.round == 4 and view.training.lr == 0.05
    weight = view.model.state_dict()["3.bias"].numpy()
    np.testing.assert_allclose(weight, model["3.bias"])
    assert_same_update(view.observed, by_hand(view, 0.05))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"momentum": 0.9}, "momentum=0.9: the attacks replay SGD without momentum; "
         "set momentum=0"),
        ({"local-objective": "prox"}, "set local-objective='plain'"),
        ({"augment": True}, "set augment=false"),
    ],
)  # fmt: skip
def test_what_the_attacks_cannot_replay_is_refused(
    overrides: dict, message: str
) -> None:
    problem = audit_problem(Settings.from_run_config({**PLAIN, **overrides}))
    assert problem is not None and message in problem


def test_a_client_not_sampled_or_not_in_the_run_is_refused(
    data_root: Path, tmp_path: Path
) -> None:
    s = settings(data_root)
    sampled = server_view(s, client=None, examples=1, workdir=tmp_path)
    secure = settings(
        data_root, **{"client-frac": 0.3, "secure-aggregation": "secagg+"}
    )
    drawn = server_view(secure, client=None, examples=1, workdir=tmp_path).clients
    assert sampled.clients[0] in drawn  # the same draw, one more client
    other = next(c for c in range(10) if c not in drawn)
    with pytest.raises(AuditError, match=f"client {other} does not train in round 1"):
        server_view(s, client=other, examples=1, workdir=tmp_path)
    with pytest.raises(AuditError, match="--client 10 is not one of the run's clients"):
        server_view(s, client=10, examples=1, workdir=tmp_path)


def pollen_audit(
    capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """`pollen audit` in this process (its torch import paid once): the
    exit code, what it printed and its error line."""
    code = main(["audit", str(PROJECT), *args])
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def run_config(data_root: Path) -> str:
    return " ".join(
        f"{k}={json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"
        for k, v in {**PLAIN, "data-root": str(data_root)}.items()
    )


def test_the_command_writes_its_numbers_and_picture(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "audit"
    code, printed, error = pollen_audit(
        capsys, "-c", run_config(data_root), "--attack", "idlg", "--iterations", "20",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, error
    report = json.loads((out / "audit.json").read_text())
    assert report["attack"] == "idlg" and report["round"] == 1
    assert len(report["images"]) == 1 and report["settings"]["model"] == "cnn-gn"
    image = report["images"][0]
    assert image["psnr"] > 0 and -1 <= image["ssim"] <= 1
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PSNR" in printed and "the server sees client" in printed
    code, _, error = pollen_audit(
        capsys, "-c", run_config(data_root), "--out", str(out)
    )
    assert code == 2 and "is not empty" in error


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--examples", "0"], "--examples: 0 is not in 1..64"),
        (["--attack", "gan"], "invalid choice: 'gan'"),
    ],
)
def test_bad_flags_are_refused_by_the_parser(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["audit", str(PROJECT), *flags])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_configuration_it_cannot_replay_fails_before_anything_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, _, error = pollen_audit(capsys, "-c", "momentum=0.9", "--out", str(out))
    assert code == 2 and "set momentum=0" in error
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "examples"),
    [
        ({"model": "cnn", "batch-size": 2}, 4),  # BatchNorm, 2 shuffled batches
        ({"batch-size": 2, "local-epochs": 2}, 8),  # 8 steps in the client's order
        ({"normalize": False}, 2),
    ],
)
def test_the_replay_on_the_true_examples_gives_the_observed_update(
    data_root: Path, tmp_path: Path, overrides: dict, examples: int
) -> None:
    """What the attacks match against: the client's local training replayed
    on its own examples (BatchNorm in train mode, the batches of the run's
    seed, the inputs as the client normalised them) is its update."""
    view = server_view(settings(data_root, **overrides), client=None,
                       examples=examples, workdir=tmp_path)  # fmt: skip
    inputs = Preprocess(view.mean, view.std)(view.originals, None)
    view.model.train()
    replayed = simulated_update(view.model, inputs, view.labels.long(), view.training)
    assert_same_update(view.observed, {k: replayed[k].detach() for k in view.observed})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"head-epochs": 1, "sharing": "fedper"}, "set head-epochs=0"),
        ({"freeze-head": True, "sharing": "fedper"}, "set freeze-head=false"),
        ({"model": "cnn-lora", "lora-dropout": 0.1}, "set lora-dropout=0"),
        ({"model": "mobilenet", "data-set": "cifar10"}, "a model without dropout"),
        ({"attack": "sign-flip", "attackers": 0.2}, "attack='none'"),
    ],
)
def test_what_the_replay_would_get_wrong_is_refused(
    overrides: dict, message: str
) -> None:
    problem = audit_problem(Settings.from_run_config({**PLAIN, **overrides}))
    assert problem is not None and message in problem


def test_a_dp_sgd_view_says_whose_budget_and_replays_without_clipping(
    data_root: Path, tmp_path: Path
) -> None:
    view = server_view(settings(data_root, dp=True), client=None, examples=1,
                       workdir=tmp_path)  # fmt: skip
    assert "DP-SGD at epsilon 10 for a client of 1 example" in view.sees
    assert view.training.max_grad_norm == 0 and view.training.order == ()
    noise = by_hand(view, 0.1)  # the noise swamps one clipped gradient
    cosine = sum(float((view.observed[n] * noise[n]).sum()) for n in noise)
    assert abs(cosine) < 0.5 * math.sqrt(
        sum(float((v**2).sum()) for v in view.observed.values())
        * sum(float((g**2).sum()) for g in noise.values())
    )


def test_a_file_as_out_a_bad_checkpoint_and_a_failed_audit_exit_2_leaving_nothing(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    code, _, error = pollen_audit(
        capsys, "-c", run_config(data_root), "--out", str(a_file)
    )
    assert code == 2 and "is a file" in error
    out = tmp_path / "never"
    code, _, error = pollen_audit(
        capsys, "-c", run_config(data_root), "--client", "10", "--out", str(out)
    )
    assert code == 2 and "is not one of the run's clients" in error
    assert not out.exists()
    s = settings(data_root)
    model = server_view(s, client=None, examples=1, workdir=tmp_path).model
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    run_dir = tmp_path / "run"
    save_checkpoint(
        run_dir, Checkpoint(2, state, {}, {"settings": s.to_run_config()}), 1
    )
    code, _, error = pollen_audit(
        capsys, "--from", str(run_dir), "-c", "model='mlp'", "--out", str(out)
    )
    assert code == 2 and "mlp" in error and not out.exists()

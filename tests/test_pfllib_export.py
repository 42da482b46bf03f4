"""The side-by-side harness's converter: pollen's shards in PFLlib's files,
read back as PFLlib's `read_client_data` reads them, are the examples
pollen's model sees (`benchmarks/pfllib_side_by_side.py`)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from pollen.settings import Settings
from pollen.task.node_data import NodeData
from pollen.task.train import Preprocess
from tests.conftest import PROJECT


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    return importlib.import_module("pfllib_side_by_side")


def test_pollens_shards_read_back_as_pfllib_reads_them(
    harness: ModuleType, tmp_path: Path
) -> None:
    settings = Settings.from_run_config(
        {"data-set": "digits", "num-clients": 3, "partition": "niid", "alpha": 0.3}
    )
    sizes = harness.write_dataset(settings, tmp_path)
    data = NodeData(settings)
    dataset = data.dataset()
    prep = Preprocess(dataset.mean, dataset.std)
    for client in range(3):
        for split, shard in (("train", data.train_shard), ("test", data.test_shard)):
            with open(tmp_path / split / f"{client}.npz", "rb") as f:  # as PFLlib
                read = np.load(f, allow_pickle=True)["data"].tolist()
            images, labels = shard(client, torch.device("cpu"))
            np.testing.assert_array_equal(read["y"], labels.numpy())
            np.testing.assert_allclose(read["x"], prep(images, None).numpy())
            assert read["x"].dtype == np.float32 and read["x"].shape[1:] == (1, 8, 8)
        assert sizes[client] == len(data.test_shard(client, torch.device("cpu"))[1])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_clients"] == 3
    assert config["pollen settings"]["partition"] == "niid"


def pfllib_round(
    number: int, evaluations: list[tuple[float, float]], seconds: str
) -> str:
    """What a PFLlib server prints for one round: its heading, each
    evaluation as `serverbase.evaluate` prints it, and its time line."""
    lines = [f"\n-------------Round number: {number}-------------", "\nEvaluate"]
    for accuracy, spread in evaluations:
        lines += [
            "Averaged Train Loss: 0.5000",
            f"Averaged Test Accuracy: {accuracy:.4f}",
            "Averaged Test AUC: 0.9000",
            f"Std Test Accuracy: {spread:.4f}",
            "Std Test AUC: 0.0100",
        ]
    return "\n".join([*lines, seconds])


def test_pfllib_output_is_read_for_the_clients_own_models(harness: ModuleType) -> None:
    timed = "------------------------- time cost ------------------------- {}"
    plain = "\n".join(
        pfllib_round(r, [(0.1 * r, 0.01 * r)], timed.format(40 + r)) for r in range(3)
    )
    fedavg = harness.METHODS["fedavg"]
    assert harness.pfllib_results(plain, fedavg, 2) == ([0.1, 0.2], [0.01, 0.02],
                                                        [40, 41, 42])  # fmt: skip
    # Ditto: the global models first, then the personal ones, every round
    ditto = "\n".join(
        pfllib_round(r, [(0.1 * r, 0.01), (0.5 + 0.1 * r, 0.02 * r)], timed.format(9))
        for r in range(3)
    )
    assert harness.pfllib_results(ditto, harness.METHODS["ditto"], 2)[:2] == (
        [0.6, 0.7], [0.02, 0.04],
    )  # fmt: skip
    # MOON's and FedProto's servers print their round's time after dashes alone
    untitled = "\n".join(
        pfllib_round(r, [(0.3, 0.1)], "-" * 50 + " 1.5e-05") for r in range(3)
    )
    assert (
        harness.pfllib_results(untitled, harness.METHODS["moon"], 2)[2] == [1.5e-05] * 3
    )
    # FedBABU: the fine-tuned models are tested once, after the rounds
    babu = plain + "\n\nBest accuracy.\n0.2\n" + pfllib_round(9, [(0.8, 0.05)], "")
    assert harness.pfllib_results(babu, harness.METHODS["fedbabu"], 2)[:2] == (
        [0.8], [0.05],
    )  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"3 accuracies, 3 spreads and 3 round times .*; 2, 2 and 2 expected",
    ):
        harness.pfllib_results(plain, fedavg, 1)


def test_every_method_is_a_valid_pollen_run(harness: ModuleType) -> None:
    from pollen.deployment.run_config import resolve_settings

    base = f"{harness.BASE} rounds=2"
    for name, method in harness.METHODS.items():
        overrides = harness.pollen_overrides(method, 1, 2)
        settings = resolve_settings(PROJECT, [base, overrides])
        assert settings.model == (method.model or "fedavg-cnn"), name
        assert settings.num_clients == 20 and settings.seed == 1, name
    fedbn = resolve_settings(
        PROJECT, [base, harness.pollen_overrides(harness.METHODS["fedbn"], 1, 2)]
    )
    assert (fedbn.model, fedbn.bn_policy) == ("cnn", "fedbn")
    fedbabu = harness.pollen_overrides(harness.METHODS["fedbabu"], 3, 5)
    assert resolve_settings(PROJECT, [base, fedbabu]).personal_eval_every == 5


def test_pfllib_s_fedbn_model_is_pollen_s_with_its_batchnorm_named_bn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PFLlib's FedBN keeps local the parameters named *bn*: the driver's
    renaming marks exactly the BatchNorm layers' and computes as before."""
    from pollen.task.models import MODELS

    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    driver = importlib.import_module("pfllib_main")
    torch.manual_seed(0)
    model = MODELS["cnn"]((1, 28, 28), 10)
    plain = {n: p.clone() for n, p in model.named_parameters()}
    images = torch.randn(4, 1, 28, 28)
    model.eval()
    expected = model(images)
    renamed = driver.bn_named(model)
    named = dict(renamed.named_parameters())
    assert [n for n in named if "bn" in n] == [
        "0.0.1.bn.weight", "0.0.1.bn.bias", "0.1.1.bn.weight", "0.1.1.bn.bias"
    ]  # fmt: skip
    assert [n.replace(".bn.", ".") for n in named] == list(plain)
    assert torch.equal(renamed(images), expected)


def test_the_table_sets_the_frameworks_side_by_side(
    harness: ModuleType, capsys: pytest.CaptureFixture
) -> None:
    def run(framework: str, repeat: int, accuracy: float, seconds: float) -> object:
        return harness.Run(framework, "fedavg", repeat, accuracy, 0.1, [accuracy],
                           [99.0, seconds, seconds])  # fmt: skip

    runs = [run("pollen", 1, 0.80, 20.0), run("pollen", 2, 0.84, 22.0),
            run("pfllib", 1, 0.81, 40.0), run("pfllib", 2, 0.81, 44.0)]  # fmt: skip
    harness.print_table(runs, ["fedavg", "local"])
    row = capsys.readouterr().out.splitlines()[-1]
    # 82 ± 2.83 against 81 ± 0; combined sqrt(8), which the lead of 1 is
    # within; 21 s against 42 s a round (each run's first round left out)
    assert row == (
        "| fedavg | 2 | 82.00 ± 2.83 | 81.00 ± 0.00 | +1.00 | 2.83 | yes "
        "| 10.00 / 10.00 | 21.0 / 42.0 | 0.50 |"
    )
    runs[2:] = [run("pfllib", 1, 0.71, 40.0), run("pfllib", 2, 0.71, 44.0)]
    # 82 ± 2.83 against 71 ± 0: a lead of 11 is not within 2.83
    harness.print_table(runs, ["fedavg"])
    assert "| +11.00 | 2.83 | no |" in capsys.readouterr().out

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

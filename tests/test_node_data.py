"""Node-config data on the ClientApp: a node's own `data-root` for the run's
data set, and a `data-file` of a node's own examples, which it trains on
whole, validated, without any copy of the data set."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

import pollen.task.inputs
import pollen.task.node_data
from pollen import client_app
from pollen.settings import Settings
from pollen.task.data import SPECS, DataError, load_dataset
from pollen.task.inputs import settings_model
from pollen.task.models import build_model
from pollen.task.partition import PartitionError
from pollen.task.shards import federated_data, shard_fingerprints
from pollen.task.sharing import Sharing
from pollen.task.train import Preprocess, evaluate
from tests.conftest import SHARED_DATA, write_mnist_slices
from tests.test_sharing import message

pytestmark = pytest.mark.usefixtures("task_identity")


def run_config(data_set: str = "digits", **overrides) -> dict:
    config = {
        "data-set": data_set, "model": "mlp", "num-clients": 4, "batch-size": 32,
        "lr": 0.05, "device": "cpu", "download": False, **overrides,
    }  # fmt: skip
    return Settings.from_run_config(config).to_run_config()


def node(client: int, clients: int = 4, **extra) -> dict:
    """A node config as `flower-supernode --node-config` gives it."""
    return {"partition-id": client, "num-partitions": clients, **extra}


def global_model(config: dict) -> ArrayRecord:
    spec = SPECS[config["data-set"]]
    shape = (spec.channels, spec.size, spec.size)
    model = build_model(config["model"], shape, spec.num_classes, config["seed"])
    return ArrayRecord(model.state_dict())


def query(context: Context) -> dict:
    msg = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="query"
    )
    return dict(client_app.query(msg, context).content["node"])


def train(context: Context, client: int) -> Message:
    sent = global_model(context.run_config)
    return client_app.train(message("train", sent, client, 1), context)


def arrays_of(reply: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reply.content["arrays"].items()}


def images(n: int, size: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size), np.uint8)


def labels(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 10, n)


def write_node_file(path: Path, **arrays: np.ndarray) -> str:
    np.savez_compressed(path, **arrays)
    return str(path)


@pytest.mark.parametrize("name", ["digits", "mnist", "fashion-mnist"])
def test_spec_statistics_are_what_the_loader_computes(name: str) -> None:
    stem = name.replace("-", "_")
    if name != "digits" and not (SHARED_DATA / f"{stem}.npz").exists():
        pytest.skip(f"real {name} not found at {SHARED_DATA}")
    dataset = load_dataset(name, SHARED_DATA, download=False)
    assert SPECS[name].mean == pytest.approx(dataset.mean, rel=1e-12)
    assert SPECS[name].std == pytest.approx(dataset.std, rel=1e-12)


def test_simulation_query_reports_the_shard_and_no_own_data() -> None:
    config = run_config(partition="silos", **{"num-clients": 2})
    context = Context(1, 1, node(1, clients=2), RecordDict(), config)
    _, shards = federated_data(Settings.from_run_config(config))
    reply = query(context)
    fingerprint = shard_fingerprints(Settings.from_run_config(config), [1])[1]
    assert reply == {
        "partition-id": 1, "num-partitions": 2,
        "num-examples": len(shards[1]), "own-data": False,
        "shard-fingerprint": fingerprint,
    }  # fmt: skip
    assert len(shards[1]) != len(shards[0])  # it is client 1's shard, not any


def test_a_copy_of_the_data_set_in_another_order_gives_another_fingerprint(
    shared_data: Path, tmp_path: Path
) -> None:
    """Same images, sorted by class (as an image folder lists them): every
    IID shard has the server's size but other examples; only the fingerprint
    tells."""
    original, sorted_copy = tmp_path / "original", tmp_path / "sorted"
    write_mnist_slices(original, tmp_path / "unused.npz")
    with np.load(original / "mnist.npz") as npz:
        arrays = dict(npz)
    order = np.argsort(arrays["y_train"], kind="stable")
    sorted_copy.mkdir()
    np.savez(sorted_copy / "mnist.npz", **{**arrays, "x_train": arrays["x_train"][order],
             "y_train": arrays["y_train"][order]})  # fmt: skip
    config = run_config("mnist", partition="iid", **{"data-root": str(original)})
    server = shard_fingerprints(Settings.from_run_config(config), [0, 1, 2, 3])
    assert len(set(server.values())) == 4

    def answer(root: Path) -> dict:
        node_config = node(1, **{"data-root": str(root)})
        return query(Context(1, 1, node_config, RecordDict(), config))

    same, other = answer(original), answer(sorted_copy)
    assert same["shard-fingerprint"] == server[1]
    assert other["num-examples"] == same["num-examples"]
    assert other["shard-fingerprint"] != server[1]


def test_node_data_root_replaces_the_runs(shared_data: Path, tmp_path: Path) -> None:
    """The run's data-root (the server's path) is empty here: the node loads
    the data set from its own, and trains exactly as a node that found it at
    the run's data-root."""
    elsewhere = run_config("mnist", **{"num-clients": 20, "data-root": str(tmp_path)})
    here = run_config("mnist", **{"num-clients": 20, "data-root": str(shared_data)})
    lost = Context(1, 1, node(3, 20), RecordDict(), elsewhere)
    with pytest.raises(DataError, match="no data for 'mnist'"):
        train(lost, 3)
    own_root = node(3, 20, **{"data-root": str(shared_data)})
    mine = Context(2, 1, own_root, RecordDict(), elsewhere)
    assert query(mine)["num-examples"] == 3000 and not query(mine)["own-data"]
    reply = train(mine, 3)
    reference = train(Context(3, 1, node(3, 20), RecordDict(), here), 3)
    assert reply.content["metrics"]["num-examples"] == 3000
    got, expected = arrays_of(reply), arrays_of(reference)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize(
    "layout",
    [lambda x: x[:, 0], lambda x: x.transpose(0, 2, 3, 1), lambda x: x],
    ids=["HW", "HWC", "CHW"],
)
def test_a_file_of_a_shards_examples_trains_like_the_shard(
    tmp_path: Path, layout
) -> None:
    """Client 2's own file holds exactly its shard: same model as in simulation,
    whatever the file's image layout."""
    config = run_config()
    dataset, shards = federated_data(Settings.from_run_config(config))
    x = dataset.x_train[shards[2]].numpy()
    path = write_node_file(
        tmp_path / "mine.npz",
        x_train=layout(x),
        y_train=dataset.y_train[shards[2]].numpy(),
    )
    own = Context(1, 1, node(2, **{"data-file": path}), RecordDict(), config)
    simulated = Context(2, 1, node(0), RecordDict(), config)  # serves clients 0, 2
    reply, reference = train(own, 2), train(simulated, 2)
    assert reply.content["metrics"]["num-examples"] == len(shards[2])
    got, expected = arrays_of(reply), arrays_of(reference)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, err_msg=name)


def test_a_data_file_node_needs_no_copy_of_the_data_set(tmp_path: Path) -> None:
    """mnist is nowhere on this node: it trains on its file's 37 examples,
    evaluates on the file's own test examples and has no global metrics."""
    config = run_config("mnist", **{"data-root": str(tmp_path / "nothing")})
    x_test, y_test = images(11, 28, seed=1), labels(11, seed=1)
    path = write_node_file(
        tmp_path / "mine.npz",
        x_train=images(37, 28), y_train=labels(37), x_test=x_test, y_test=y_test,
    )  # fmt: skip
    context = Context(1, 1, node(1, **{"data-file": path}), RecordDict(), config)
    assert query(context) == {
        "partition-id": 1, "num-partitions": 4, "num-examples": 37, "own-data": True,
        "shard-fingerprint": "",  # its own examples: nothing the server could check
    }  # fmt: skip
    assert train(context, 1).content["metrics"]["num-examples"] == 37
    sent = global_model(config)
    reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
    metrics = reply.content["metrics"]
    assert math.isnan(metrics["global-accuracy"]) and math.isnan(metrics["global-loss"])
    model = build_model("mlp", (1, 28, 28), 10, config["seed"])
    model.load_state_dict(sent.to_torch_state_dict())
    spec = SPECS["mnist"]
    loss, accuracy = evaluate(
        model, torch.from_numpy(x_test[:, None]), torch.from_numpy(y_test),
        batch_size=128, preprocess=Preprocess(spec.mean, spec.std),
    )  # fmt: skip
    assert metrics["num-examples"] == 11
    assert metrics["local-loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["local-accuracy"] == pytest.approx(accuracy)


def test_global_metrics_come_from_the_data_set_where_the_node_has_it(
    tmp_path: Path,
) -> None:
    """digits ships with scikit-learn, so every node has its test split; a
    file without test examples gives NaN local metrics, not an error. (Under
    Ditto a client keeps a model of its own, so it tests on the global split.)"""
    config = run_config(strategy="ditto")
    path = write_node_file(tmp_path / "mine.npz", x_train=images(9), y_train=labels(9))
    own = Context(1, 1, node(1, **{"data-file": path}), RecordDict(), config)
    simulated = Context(2, 1, node(1), RecordDict(), config)
    sent = global_model(config)
    got, expected = (
        client_app.evaluate_personal(message("evaluate", sent, 1, 1), c).content[
            "metrics"
        ]
        for c in (own, simulated)
    )
    assert got["global-loss"] == pytest.approx(expected["global-loss"], rel=1e-12)
    assert got["global-accuracy"] == expected["global-accuracy"]
    assert math.isnan(got["local-accuracy"]) and got["num-examples"] == 0


def test_cached_backbone_features_of_a_file_are_its_own(tmp_path: Path) -> None:
    """Client 0's features from a shard of the data set, cached first in this
    process, are not taken for the features of client 0's own file."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (60, 32, 32, 3), np.uint8)
    np.savez(
        tmp_path / "cifar10.npz",
        x_train=pixels[:40], y_train=np.arange(40) % 10,
        x_test=pixels[40:], y_test=np.arange(20) % 10,
    )  # fmt: skip
    path = write_node_file(
        tmp_path / "mine.npz", x_train=pixels[20:], y_train=np.arange(40) % 10
    )
    replies = {}
    for cache in (True, False):
        config = run_config(
            "cifar10", **{
                "data-root": str(tmp_path), "model": "vgg16-lora",
                "backbone-weights": "random", "augment": False, "sharing": "lora",
                "cache-features": cache, "num-clients": 1, "lora-rank": 2,
            },
        )  # fmt: skip
        settings = Settings.from_run_config(config)
        model = settings_model(settings, federated_data(settings)[0])
        shared = Sharing.of(settings.sharing_policy, model).shared
        sent = ArrayRecord({k: model.state_dict()[k] for k in shared})
        simulated = Context(1, 1, node(0, 1), RecordDict(), config)
        client_app.train(message("train", sent, 0, 1), simulated)
        cached = len(pollen.task.inputs._FEATURES)
        own = Context(2, 1, node(0, 1, **{"data-file": path}), RecordDict(), config)
        replies[cache] = arrays_of(client_app.train(message("train", sent, 0, 1), own))
        assert (
            len(pollen.task.inputs._FEATURES) == cached + cache
        )  # the file's, not reused
    for name, value in replies[True].items():
        np.testing.assert_allclose(value, replies[False][name], atol=1e-5)


def test_a_data_file_node_serves_its_partition_id_only(tmp_path: Path) -> None:
    path = write_node_file(tmp_path / "mine.npz", x_train=images(9), y_train=labels(9))
    context = Context(1, 1, node(0, **{"data-file": path}), RecordDict(), run_config())
    with pytest.raises(PartitionError, match="holds only client 0's examples"):
        train(context, 1)


def test_the_file_is_read_once_and_again_when_it_changes(
    tmp_path: Path, monkeypatch
) -> None:
    reads = []
    read = pollen.task.node_data.read_node_file
    monkeypatch.setattr(
        pollen.task.node_data, "read_node_file", lambda *a: reads.append(a) or read(*a)
    )
    path = write_node_file(tmp_path / "mine.npz", x_train=images(9), y_train=labels(9))
    context = Context(1, 1, node(0, **{"data-file": path}), RecordDict(), run_config())
    assert [query(context)["num-examples"] for _ in range(3)] == [9, 9, 9]
    train(context, 0)
    assert len(reads) == 1
    write_node_file(Path(path), x_train=images(12), y_train=labels(12))
    assert query(context)["num-examples"] == 12 and len(reads) == 2


def test_node_config_paths_must_be_strings() -> None:
    context = Context(1, 1, node(0, **{"data-file": 5}), RecordDict(), run_config())
    with pytest.raises(ValueError, match=r"node config data-file=5: expected a path"):
        query(context)


@pytest.mark.parametrize(
    ("node_config", "why"),
    [
        ({"num-partitions": 2}, "partition-id=None: expected an integer"),
        ({"partition-id": "0", "num-partitions": 2}, "partition-id='0': expected an"),
        ({"partition-id": 0}, "num-partitions=None: expected an integer"),
        ({"partition-id": True, "num-partitions": 2}, "partition-id=True: expected"),
        ({"partition-id": 2, "num-partitions": 2}, "partition-id=2: expected 0 <="),
        ({"partition-id": -1, "num-partitions": 2}, "partition-id=-1: expected 0 <="),
    ],
)
def test_a_bad_partition_in_the_node_config_is_named(node_config, why) -> None:
    """A SuperNode started by hand without (or with a wrong) partition."""
    context = Context(1, 1, node_config, RecordDict(), run_config())
    with pytest.raises(ValueError, match=re.escape(why)):
        query(context)


def _arrays(**changes) -> dict[str, np.ndarray]:
    arrays = {"x_train": images(6), "y_train": labels(6)}
    return {k: v for k, v in {**arrays, **changes}.items() if v is not None}


def _save(arrays: dict[str, np.ndarray]):
    return lambda path: np.savez(path, **arrays)


def _single_npy(path: Path) -> None:
    with path.open("wb") as f:
        np.save(f, images(6))


def _truncated(path: Path) -> None:
    np.savez_compressed(path, **_arrays())
    path.write_bytes(path.read_bytes()[:300])


BAD_FILES = {
    "missing-labels": (
        _save(_arrays(y_train=None)),
        "lacks y_train; a node data-file holds x_train, y_train, optionally "
        "x_test, y_test",
    ),
    "float-pixels": (
        _save(_arrays(x_train=images(6).astype(np.float32))),
        "x_train has dtype float32; expected uint8 pixels 0..255",
    ),
    "wrong-size": (
        _save(_arrays(x_train=images(6, size=28))),
        "x_train has shape [6, 28, 28]; digits needs [N, 8, 8], [N, 8, 8, 1] or "
        "[N, 1, 8, 8]",
    ),
    "rgb-for-grey": (
        _save(_arrays(x_train=np.zeros((6, 8, 8, 3), np.uint8))),
        "x_train has shape [6, 8, 8, 3]; digits needs",
    ),
    "label-out-of-range": (
        _save(_arrays(y_train=np.arange(6) * 2)),
        "y_train has labels 0..10; digits has classes 0..9",
    ),
    "float-labels": (
        _save(_arrays(y_train=labels(6).astype(np.float64))),
        "y_train has dtype float64; expected ints",
    ),
    "empty": (
        _save(_arrays(x_train=images(0), y_train=labels(0))),
        "train split is empty",
    ),
    "length-mismatch": (
        _save(_arrays(y_train=labels(5))),
        "y_train has shape [5]; expected [6], one label per image of x_train",
    ),
    "test-without-labels": (
        _save(_arrays(x_test=images(3))),
        "holds x_test without its pair; a node data-file holds both x_test and y_test",
    ),
    "bad-test-labels": (
        _save(_arrays(x_test=images(3), y_test=np.array([0, 1, -1]))),
        "y_test has labels -1..1; digits has classes 0..9",
    ),
    "pickled-objects": (
        _save(_arrays(y_train=np.array([{}] * 6, dtype=object))),
        "y_train holds pickled Python objects",
    ),
    "not-a-zip": (
        lambda path: path.write_text("x_train,y_train\n"),
        "truncated or not a .npz",
    ),
    "truncated": (_truncated, "truncated or not a .npz"),
    "single-npy": (
        _single_npy,
        "is a single .npy array, not an .npz; a node data-file holds x_train, y_train",
    ),
    "a-directory": (lambda path: path.mkdir(), "truncated or not a .npz"),
    "missing": (lambda path: None, "No such file or directory; node config data-file"),
}


@pytest.mark.parametrize(("make", "problem"), BAD_FILES.values(), ids=BAD_FILES)
def test_a_bad_data_file_is_a_clear_error_naming_it(
    tmp_path: Path, make, problem: str
) -> None:
    path = tmp_path / "node-data.npz"
    make(path)
    context = Context(
        1, 1, node(0, **{"data-file": str(path)}), RecordDict(), run_config()
    )
    with pytest.raises(DataError) as caught:
        query(context)
    assert str(path) in str(caught.value) and problem in str(caught.value)
    with pytest.raises(DataError, match=re.escape(problem)):
        train(context, 0)

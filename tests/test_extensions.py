"""A user's own models and data sets (`pollen.extensions`): named by import
path or by an installed package's entry point, validated as a built-in one
is before anything runs, refused with one line naming the key otherwise.
(A real run of them: tests/test_simulation.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pollen.catalog import DATA_SETS, MODELS
from pollen.extensions import (
    DATA_SET_GROUP,
    MODEL_GROUP,
    ExtensionError,
    Registration,
    data_set_info,
    import_path,
    model_info,
    registered,
)
from pollen.listing import datasets, models
from pollen.settings import Settings, SettingsError
from pollen.task.data import DataError, load_dataset, read_node_file, user_dataset
from pollen.task.models import build_model
from tests.user_package import (
    ENTRY_POINTS,
    PACKAGE,
    on_path,
    write_distribution,
    write_user_package,
)

NET, DATA, RULES = f"{PACKAGE}.nets", f"{PACKAGE}.data", f"{PACKAGE}.rules"


@pytest.fixture(scope="module", autouse=True)
def user_package(tmp_path_factory) -> Iterator[Path]:
    """The user's package on the path, registered as an installed one (the
    entry points are read again on the way in and out: pollen reads them
    once per process)."""
    root = write_user_package(tmp_path_factory.mktemp("user"), entry_points=True)
    with on_path(root):
        yield root


def settings(**values: object) -> Settings:
    return Settings.from_run_config(
        {key.replace("_", "-"): value for key, value in values.items()}
    )


def test_an_import_path_names_a_model_and_a_data_set_which_the_settings_record() -> (
    None
):
    s = settings(model=f"{NET}:tiny_net", data_set=f"{DATA}:blobs", num_clients=4)
    assert (s.model, s.data_set) == (f"{NET}:tiny_net", f"{DATA}:blobs")
    assert s.to_run_config()["model"] == f"{NET}:tiny_net"  # settings.json
    info = data_set_info(s.data_set)
    assert (info.channels, info.side, info.classes, info.train_examples) == (
        1,
        6,
        3,
        160,
    )
    assert info.summary.startswith("Three classes of 6x6 grey images")
    # "auto" takes the defaults for a user's data set
    assert (s.lr, s.momentum, s.batch_size, s.local_epochs, s.partition) == (
        0.01, 0.9, 16, 2, "iid",
    )  # fmt: skip
    net = model_info(s.model, s.data_set)
    assert (net.batchnorm, net.lora, net.dropout, net.summary) == (
        False, False, False, "A perceptron with one hidden layer of 16.",
    )  # fmt: skip


def test_a_user_model_trains_on_a_built_in_data_set_and_the_reverse() -> None:
    settings(model=f"{NET}:tiny_net", data_set="digits")
    settings(model="cnn", data_set=f"{DATA}:blobs")
    with pytest.raises(SettingsError, match=r"'simple-cnn' needs images of at least"):
        settings(model="simple-cnn", data_set=f"{DATA}:blobs")


def test_an_installed_packages_entry_points_name_parts_and_are_listed() -> None:
    s = settings(model="tiny", data_set="blobs", num_clients=4)
    assert data_set_info("blobs").classes == 3
    assert model_info(s.model, s.data_set).name == "tiny"
    assert f"tiny             {NET}:tiny_net (an installed package's)" in models()
    assert f"{DATA}:blobs (an installed package's)" in datasets()


# two installed packages that register the name `twin` in three groups with
# different import paths (alphaparts' into userparts, so naming one by its
# import path works), and the built-in name `mlp`
TWINS = {
    "alphaparts": (f"{NET}:tiny_net", f"{DATA}:blobs", f"{RULES}:UniformMean"),
    "betaparts": (f"{NET}:bn_net", f"{DATA}:features", "betaparts.rules:Mean"),
}


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[Path]:
    """`alphaparts` and `betaparts` installed (their metadata only: pollen
    imports neither for a name they clash on)."""
    for package, (net, data, rule) in TWINS.items():
        write_distribution(
            tmp_path,
            package,
            f"[pollen.models]\ntwin = {net}\nmlp = {package}.nets:mlp\n"
            f"[pollen.data_sets]\ntwin = {data}\n"
            f"[pollen.aggregators]\ntwin = {rule}\n",
        )
    with on_path(tmp_path):
        yield tmp_path


@pytest.mark.parametrize(
    ("key", "group", "alpha", "beta"),
    [
        ("model", MODEL_GROUP, *(paths[0] for paths in TWINS.values())),
        ("data-set", DATA_SET_GROUP, *(paths[1] for paths in TWINS.values())),
        ("aggregator", "pollen.aggregators", *(paths[2] for paths in TWINS.values())),
    ],
)
def test_a_name_two_installed_packages_register_is_refused_naming_both(
    twins: Path, key: str, group: str, alpha: str, beta: str
) -> None:
    """The package last on the path won, silently; now the run is refused
    before anything is imported, naming both packages and the ways out."""
    line = (
        f"{key}='twin' is ambiguous: 2 installed packages register it under "
        f"entry-point group {group}, alphaparts as {alpha!r} and betaparts as "
        f"{beta!r}; uninstall all but one, or name the one you mean by its "
        f"import path ({key}={alpha!r})"
    )
    config = {"num-clients": 4, "client-frac": 0.5}
    with pytest.raises(SettingsError, match=f"^{re.escape(line)}$"):
        Settings.from_run_config({**config, key: "twin"})
    with pytest.raises(ExtensionError, match=f"^{re.escape(line)}$"):
        import_path("twin", group)
    Settings.from_run_config({**config, key: alpha})  # the import path still works


def test_a_built_in_name_two_packages_register_is_still_the_built_in(
    twins: Path,
) -> None:
    assert len(registered(MODEL_GROUP)["mlp"]) == 2
    assert settings(model="mlp").model == "mlp"
    assert model_info("mlp", "digits") is MODELS["mlp"]


def test_one_import_path_registered_twice_is_one_registration(tmp_path: Path) -> None:
    """userparts visible twice on the path, and another package registering
    `tiny` with userparts' own import path: the same function, no clash."""
    write_distribution(tmp_path, PACKAGE, ENTRY_POINTS)
    write_distribution(
        tmp_path, "copyparts", f"[pollen.models]\ntiny = {NET}:tiny_net\n"
    )
    with on_path(tmp_path):
        (found,) = registered(MODEL_GROUP)["tiny"]
        assert found.path == f"{NET}:tiny_net"
        settings(model="tiny", data_set="blobs", num_clients=4)
        assert f"tiny             {NET}:tiny_net (an installed package's)" in models()


def test_built_in_names_are_the_catalogues_entries() -> None:
    assert data_set_info("digits") is DATA_SETS["digits"]
    assert model_info("mlp-bn", "digits") is MODELS["mlp-bn"]


def test_a_user_model_is_built_from_the_seed_and_a_data_set_loaded_once() -> None:
    a, b = (build_model(f"{NET}:tiny_net", (1, 6, 6), 3, seed=5) for _ in "ab")
    first, second = a.state_dict(), b.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    images = load_dataset(f"{DATA}:blobs", "nowhere", download=False)
    assert images is load_dataset(f"{DATA}:blobs", "nowhere", download=False)
    assert images.x_train.dtype == torch.uint8 and images.input_shape == (1, 6, 6)
    assert images.mean[0] > 0.2  # normalised with its training split's statistics
    features = load_dataset(f"{DATA}:features", "nowhere", download=False)
    assert features.x_train.shape == (40, 5, 1, 1)  # features: channels of a pixel
    assert (features.mean, features.std) == ((0.0,) * 5, (1.0,) * 5)  # as given


def test_model_features_come_from_the_built_module() -> None:
    assert model_info(f"{NET}:bn_net", f"{DATA}:blobs").batchnorm
    assert model_info(f"{NET}:lora_net", f"{DATA}:blobs").lora
    settings(model=f"{NET}:lora_net", data_set=f"{DATA}:blobs", sharing="lora-a")
    with pytest.raises(SettingsError, match=r"dp=true with model='userparts.nets:bn"):
        settings(model=f"{NET}:bn_net", data_set=f"{DATA}:blobs", dp=True)
    with pytest.raises(SettingsError, match=r"bn-policy='fedbn' with model='userp"):
        settings(model=f"{NET}:tiny_net", bn_policy="fedbn")
    with pytest.raises(SettingsError, match=r"sharing='lora-a' needs a model with"):
        settings(model=f"{NET}:tiny_net", sharing="lora-a")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nowhere.nets:tiny_net", r"^model='nowhere.nets:tiny_net': cannot import "
         r"'nowhere.nets:tiny_net' \(ModuleNotFoundError: No module named "
         r"'nowhere'\); it must be importable where pollen runs"),
        (f"{NET}:absent", r"^model='userparts.nets:absent': cannot import .*"
         r"\(AttributeError: module 'userparts.nets' has no attribute 'absent'\)"),
        (f"{NET}:NOT_CALLABLE", r"'userparts.nets:NOT_CALLABLE' is a int, not a "
         r"function"),
        (f"{NET}:raises", r"its factory raised RuntimeError: needs a GPU for "
         r"data-set 'digits' \(1x8x8, 10 classes\)"),
        (f"{NET}:not_a_module", r"its factory returned a str, not a torch.nn.Module"),
        (f"{NET}:wrong_input", r"cannot take a batch of inputs for data-set "
         r"'digits' \(1x8x8, 10 classes\): RuntimeError"),
        (f"{NET}:wrong_outputs", r"gives \[2, 11\] for a batch of 2 for data-set "
         r"'digits' \(1x8x8, 10 classes\); expected logits \[2, 10\], one per class"),
        (f"{NET}:two_outputs", r"gives a tuple of 2 \(\[2, 10\], \[2, 16\]\) for a "
         r"batch of 2 for data-set 'digits' \(1x8x8, 10 classes\); expected logits"),
        (f"{NET}:frozen", r"^model='userparts.nets:frozen' has no trainable "
         r"parameters \(650 parameters, none with requires_grad\): every client's "
         r"optimiser would have nothing to train"),
        ("no-such-net", r"^invalid value for 'model': 'no-such-net'; allowed: one of "
         r"mlp, .*, or a user's: an import path 'module:function' or a name "
         r"registered under entry-point group pollen.models"),
    ],
)  # fmt: skip
def test_a_model_pollen_cannot_use_is_refused_naming_key_and_cause(
    name: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=message) as refused:
        settings(model=name)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        ("raises", r"its loader raised FileNotFoundError: blobs.npz"),
        ("not_a_mapping", r"its loader returned a tuple; a loader returns a mapping "
         r"of x_train, y_train, x_test, y_test, classes"),
        ("without_classes", r"its loader's mapping lacks classes"),
        ("float_labels", r"y_train is float32 of shape \[160\]; expected integer "
         r"labels \[160\]"),
        ("labels_beyond_classes", r"y_train has labels 0..2; classes=2 allows 0..1"),
        ("int_images", r"x_train is int64 of shape \[160, 6, 6\]; expected uint8 "
         r"images"),
    ],
)  # fmt: skip
def test_a_data_set_loader_returning_the_wrong_form_is_refused(
    loader: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=rf"^data-set='{DATA}:{loader}': {message}"):
        settings(data_set=f"{DATA}:{loader}")


def test_a_users_aggregator_is_checked_by_its_own_rules_and_composed() -> None:
    """`aggregator` takes a `Rule` subclass by import path or entry point;
    `Settings` asks it what it refuses (here its fewest replies, 2), and the
    strategy aggregates with it."""
    from pollen.strategies.compose import build_strategy

    s = settings(aggregator=f"{RULES}:UniformMean", num_clients=4, client_frac=0.5)
    assert s.to_run_config()["aggregator"] == f"{RULES}:UniformMean"
    uniform = settings(aggregator="uniform", num_clients=4, client_frac=0.5)
    assert uniform.aggregator == "uniform"
    with pytest.raises(SettingsError, match=r"needs 2 replies per round; a round "):
        settings(aggregator=f"{RULES}:UniformMean", num_clients=4, client_frac=0.25)
    strategy, _ = build_strategy(s, build_model("mlp", (1, 8, 8), 10, 0))
    assert type(strategy.aggregator).__name__ == "UniformMean"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("aggregator", f"{RULES}:Missing", r"aggregator='userparts.rules:Missing': "
         r"cannot import 'userparts.rules:Missing' \(AttributeError"),
        ("server-update", "nomodule.here:Update", r"server-update='nomodule.here:"
         r"Update': cannot import .*ModuleNotFoundError"),
        ("local-objective", "median", r"invalid value for 'local-objective': "
         r"'median'; allowed: .*import path 'module:Class'"),
        ("aggregator", "collections:OrderedDict", r"aggregator='collections:"
         r"OrderedDict' is no class subclassing pollen\.strategies\.aggregation\.Rule"),
        ("server-update", "numpy:median", r"server-update='numpy:median' is no "
         r"class subclassing pollen\.strategies\.server_update\.ServerUpdate"),
        ("local-objective", "collections:OrderedDict", r"is no class subclassing "
         r"pollen\.task\.objective_parts\.Plain, as a user's local-objective"),
    ],
)  # fmt: skip
def test_a_part_pollen_cannot_import_is_refused_naming_key_and_cause(
    key: str, value: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({key: value})


def blob_file(path: Path, **changes: object) -> Path:
    """A node's own examples of the user's `blobs` (6x6 grey, 3 classes)."""
    rng = np.random.default_rng(3)
    arrays = {
        "x_train": rng.integers(0, 256, (5, 6, 6), np.uint8),
        "y_train": np.array([0, 1, 2, 1, 0]),
        **changes,
    }
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_a_nodes_own_file_of_a_users_data_set_is_normalised_as_the_loaders(
    tmp_path: Path,
) -> None:
    """The node calls the user's loader for the shape, classes and
    statistics; its own examples are what it trains on."""
    name = f"{DATA}:blobs"
    own = read_node_file(name, blob_file(tmp_path / "own.npz"))
    loaded = user_dataset(name)
    assert (own.num_classes, own.input_shape) == (3, (1, 6, 6))
    assert (own.mean, own.std) == (loaded.mean, loaded.std)
    assert own.y_train.tolist() == [0, 1, 2, 1, 0] and len(own.y_test) == 0
    assert own.x_train.dtype == torch.uint8 and own.source == str(tmp_path / "own.npz")


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"x_train": np.zeros((5, 8, 8), np.uint8)}, "x_train is uint8 [1, 8, 8] per "
         "example; data-set 'userparts.data:blobs' is uint8 [1, 6, 6]"),
        ({"x_train": np.zeros((5, 1, 6, 6), np.float32)}, "x_train is float32 [1, 6, 6] "
         "per example; data-set 'userparts.data:blobs' is uint8"),
        ({"y_train": np.array([0, 1, 2, 3, 0])}, "y_train has labels 0..3; classes=3"),
        ({"x_train": np.zeros((0, 6, 6), np.uint8), "y_train": np.zeros(0, int)},
         "the train split is empty"),
    ],
)  # fmt: skip
def test_a_nodes_own_file_unlike_the_users_data_set_is_refused(
    tmp_path: Path, changes: dict, problem: str
) -> None:
    path = blob_file(tmp_path / "own.npz", **changes)
    with pytest.raises(DataError, match=re.escape(problem)):
        read_node_file(f"{DATA}:blobs", path)


def test_entry_points_are_read_once_per_process(user_package: Path) -> None:
    """A second check of a registered name reads no metadata again."""
    registered.cache_clear()
    assert registered("pollen.models")["tiny"] == (
        Registration(PACKAGE, f"{PACKAGE}.nets:tiny_net"),
    )
    settings(model="tiny", data_set=f"{DATA}:blobs", num_clients=4)
    assert registered.cache_info().misses == 1  # pollen.models, read once
    assert registered("pollen.models") is registered("pollen.models")

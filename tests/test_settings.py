"""Run-config validation: every bad value fails with one line naming it."""

from __future__ import annotations

import tomllib

import pytest

from pollen.catalog import MODELS, Part, assumed_training
from pollen.deployment.run_config import prepare_run
from pollen.presets import departures
from pollen.runs.checkpoints import first_difference
from pollen.settings import Settings, SettingsError
from tests.conftest import PROJECT


def test_defaults_are_valid_and_follow_the_seeds() -> None:
    s = Settings.from_run_config({})
    assert (s.seed, s.num_clients, s.client_frac) == (845, 10, 0.25)
    # the client's hyper-parameters: the data set's (digits) measured defaults
    assert (s.lr, s.momentum, s.batch_size, s.local_epochs) == (0.05, 0.9, 16, 2)
    assert (s.test_batch_size, s.alpha, s.min_size, s.rounds) == (128, 0.5, 10, 10)
    assert (s.lr_factor, s.lr_patience, s.min_lr) == (0.5, 5, 1e-6)


@pytest.mark.parametrize(
    ("data_set", "lr"),
    [("digits", 0.05), ("mnist", 0.01), ("fashion-mnist", 0.01), ("cifar10", 0.005)],
)
def test_auto_client_hyper_parameters_are_the_data_sets_and_a_value_wins(
    data_set: str, lr: float
) -> None:
    auto = Settings.from_run_config({"data-set": data_set})
    assert (auto.lr, auto.momentum, auto.batch_size, auto.local_epochs) == (
        lr, 0.9, 16, 2,
    )  # fmt: skip
    given = Settings.from_run_config(
        {"data-set": data_set, "lr": 0.2, "momentum": 0.0, "batch-size": 64,
         "local-epochs": 5}
    )  # fmt: skip
    assert (given.lr, given.momentum, given.batch_size, given.local_epochs) == (
        0.2, 0.0, 64, 5,
    )  # fmt: skip
    assert given.to_run_config()["lr"] == 0.2 and auto.to_run_config()["lr"] == lr


@pytest.mark.parametrize(
    ("data_set", "model", "optimizer", "lr"),
    [
        ("mnist", "cnn", "sgd", 0.01),  # the cnn takes the mlp's rates
        ("mnist", "mlp", "adamw", 0.001),
        ("mnist", "cnn", "adam", 0.001),  # adaptive rates hold for any model
        ("digits", "mlp", "adamw", 0.01),
        ("cifar10", "mlp", "adam", 0.0003),
    ],
)
def test_auto_lr_follows_the_client_optimizer_whatever_the_model(
    data_set: str, model: str, optimizer: str, lr: float
) -> None:
    config = {"data-set": data_set, "model": model, "client-optimizer": optimizer}
    assert Settings.from_run_config(config).lr == lr
    assert Settings.from_run_config({**config, "lr": 0.2}).lr == 0.2


def test_pyproject_declares_every_key_with_the_same_type() -> None:
    pyproject = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    config = pyproject["tool"]["flwr"]["app"]["config"]
    declared = {key: default for key, default, _, _ in Settings.describe()}
    assert set(config) == set(declared)
    for key, value in config.items():
        assert type(value) is type(declared[key]), key
    quick = Settings.from_run_config(config)
    assert (quick.data_set, quick.num_clients, quick.strategy) == (
        "digits",
        10,
        "fedavg",
    )


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("data-set", "imagenet", "one of digits, mnist"),
        (
            "model",
            "resnet",
            "one of mlp, logreg, mlp-bn, cnn, cnn-gn, simple-cnn, fedavg-cnn, cnn-lora, mobilenet, "
            "vgg16-lora",
        ),
        (
            "partition",
            "random",
            "one of auto, iid, niid, niid-client, pathological, silos, natural",
        ),
        (
            "class-assignment",
            "balanced",
            "one of first-deterministic, deterministic, random",
        ),
        ("strategy", "fedsgd", "one of fedavg, fedavgm"),
        ("bn-policy", "bn", "one of shared, fedbn, silobn"),
        ("server-update", "avg", "one of auto, fedavg, feddyn"),
        ("device", "tpu", "one of auto, cpu, cuda, mps"),
        ("client-frac", 0.0, "in (0, 1]"),
        ("client-frac", 1.5, "in (0, 1]"),
        ("alpha", 0.0, "> 0"),
        ("alpha", -1.0, "> 0"),
        ("rounds", 0, ">= 1"),
        ("num-clients", 0, ">= 1"),
        ("lr", 0.0, "> 0"),
        ("rounds", "ten", "an integer"),
        ("lr", float("nan"), "a finite number"),
        ("normalize", "yes", "true or false"),
        ("min-train-replies", 0, ">= 1"),
        ("update-norm-bound", 0.5, "0 (off) or >= 1"),
        ("update-norm-action", "zero", "one of clip, drop"),
    ],
)
def test_invalid_value_names_key_value_and_allowed(key, value, allowed) -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_run_config({key: value})
    message = str(err.value)
    assert "\n" not in message
    assert repr(key) in message and repr(value) in message and allowed in message


def test_a_model_the_data_sets_images_cannot_feed_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"'simple-cnn' needs images of at least "
                       r"16x16, not 8x8; data-set='digits'"):  # fmt: skip
        Settings.from_run_config({"model": "simple-cnn"})
    with pytest.raises(SettingsError, match="'vgg16-lora' needs colour images"):
        Settings.from_run_config({"model": "vgg16-lora", "data-set": "mnist"})
    assert Settings.from_run_config({"model": "simple-cnn", "data-set": "mnist"})
    with pytest.raises(SettingsError, match=r"'cnn' needs images of at least 4x4, "
                       r"not 1x1; data-set='synthetic'"):  # fmt: skip
        Settings.from_run_config({"model": "cnn", "data-set": "synthetic"})


def test_batch_size_one_is_refused_for_exactly_the_batchnorm_models() -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    from pollen.task.models import ModelOptions, build_model  # imports torch

    for name in MODELS:
        model = build_model(name, (3, 32, 32), 10, 0, ModelOptions())
        has_bn = any(isinstance(m, _BatchNorm) for m in model.modules())
        assert has_bn == MODELS[name].batchnorm, name
        config = {
            "model": name,
            "data-set": "cifar10",
            "batch-size": 1,
            "augment": False,
        }
        if has_bn:
            with pytest.raises(
                SettingsError, match=f"batch-size=1 with model='{name}'"
            ):
                Settings.from_run_config(config)
        else:
            assert Settings.from_run_config(config).batch_size == 1


def test_the_catalogue_marks_exactly_the_models_with_dropout_of_their_own() -> None:
    """What cohorts refuse; LoRA's dropout, `lora-dropout`, is a setting."""
    from torch.nn.modules.dropout import _DropoutNd

    from pollen.task.models import ModelOptions, build_model  # imports torch

    for name in MODELS:
        model = build_model(name, (3, 32, 32), 10, 0, ModelOptions(lora_dropout=0))
        has = any(isinstance(m, _DropoutNd) and m.p > 0 for m in model.modules())
        assert has == MODELS[name].dropout, name


def test_a_bn_policy_needs_a_model_with_batchnorm() -> None:
    """FedBN on a model without BatchNorm would silently be FedAvg."""
    with pytest.raises(
        SettingsError, match=r"bn-policy='fedbn' with model='mlp'.*mlp-bn"
    ):
        Settings.from_run_config({"bn-policy": "fedbn", "model": "mlp"})
    assert Settings.from_run_config({"bn-policy": "silobn", "model": "mlp-bn"})


@pytest.mark.parametrize(
    ("config", "every"),
    [
        ({}, 0),  # FedAvg keeps nothing: the server's evaluation says it all
        ({"bn-policy": "fedbn", "model": "mlp-bn"}, 1),
        ({"strategy": "fedper"}, 1),
        ({"strategy": "fedsa", "model": "cnn-lora"}, 1),
        ({"strategy": "ditto"}, 1),
        ({"personal-eval-every": 3}, 3),  # asked for: the global model per client
        ({"strategy": "fedrep", "personal-eval-every": 0}, 0),
    ],
)
def test_personal_evaluation_is_on_where_clients_keep_something(config, every):
    s = Settings.from_run_config(config)
    assert s.personal_eval_every == every
    assert Settings.from_run_config(s.to_run_config()) == s


def test_dp_runs_cannot_be_resumed() -> None:
    with pytest.raises(SettingsError, match="dp=true with resume is not supported"):
        Settings.from_run_config({"dp": True, "model": "cnn-gn", "resume": "runs/a"})


def test_unknown_key_is_refused() -> None:
    with pytest.raises(SettingsError, match="unknown run-config key 'learning-rate'"):
        Settings.from_run_config({"learning-rate": 0.1})


def test_integral_float_and_bool_strings_are_coerced() -> None:
    s = Settings.from_run_config({"rounds": 3.0, "augment": "false", "lr": 1})
    assert (s.rounds, s.augment, s.lr) == (3, False, 1.0)
    assert Settings.from_run_config(s.to_run_config()) == s


@pytest.mark.parametrize(
    "config",
    [{"seed": 2**63}, {"rounds": 1e300}, {"test-batch-size": 2**63}, {"lr": 10**400}],
    ids=["seed", "rounds", "test-batch-size", "lr"],
)
def test_numbers_flower_cannot_carry_are_refused_up_front(config: dict) -> None:
    """Flower's config values are signed 64-bit integers and doubles: a
    larger integer passed validation and failed inside `flwr run`, and an
    integer beyond a double's range for a float key was a traceback."""
    (key,) = config
    with pytest.raises(SettingsError, match=f"invalid value for '{key}'"):
        Settings.from_run_config(config)
    assert Settings.from_run_config({"seed": 2**63 - 1}).seed == 2**63 - 1


@pytest.mark.parametrize(
    ("preset", "update", "objective", "server_lr", "momentum"),
    [
        ("fedavg", "fedavg", "plain", 1.0, 0.0),
        ("fedavgm", "sgd", "plain", 1.0, 0.9),
        ("fedprox", "fedavg", "prox", 1.0, 0.0),
        ("fedsam", "fedavg", "sam", 1.0, 0.0),
        ("feddyn", "feddyn", "feddyn", 1.0, 0.0),
        ("fedadagrad", "adagrad", "plain", 0.01, 0.0),
        ("fedadam", "adam", "plain", 0.01, 0.0),
        ("fedyogi", "yogi", "plain", 0.01, 0.0),
    ],
)
def test_presets_resolve_auto_values(preset, update, objective, server_lr, momentum):
    s = Settings.from_run_config({"strategy": preset})
    assert (s.server_update, s.local_objective) == (update, objective)
    assert (s.server_lr, s.server_momentum) == (server_lr, momentum)
    assert Settings.from_run_config(s.to_run_config()) == s


def test_explicit_parts_override_the_preset() -> None:
    s = Settings.from_run_config(
        {"strategy": "fedadam", "local-objective": "sam", "server-lr": 0.1}
    )
    assert (s.server_update, s.local_objective, s.server_lr) == ("adam", "sam", 0.1)
    with pytest.raises(SettingsError, match="allowed: auto or a finite number"):
        Settings.from_run_config({"server-lr": "fast"})
    with pytest.raises(SettingsError, match="'b1,b2'"):
        Settings.from_run_config({"betas": "0.9"})


@pytest.mark.parametrize("objective", ["sam", "prox-sam", "feddyn-sam"])
def test_dp_refuses_every_sam_objective(objective) -> None:
    """No per-sample clipping for SAM's second pass (each objective's part,
    pollen.task.objective_parts, says whether it takes SAM's gradient)."""
    assert Settings.from_run_config({"local-objective": objective, "sam-rho": 0.2})
    with pytest.raises(SettingsError, match=f"local-objective='{objective}'"):
        Settings.from_run_config(
            {"local-objective": objective, "dp": True, "model": "cnn-gn"}
        )


@pytest.mark.parametrize(
    "preset", sorted(p.name for p in (PROJECT / "configs").glob("*.toml"))
)
def test_every_preset_file_is_valid(preset) -> None:
    config = tomllib.loads((PROJECT / "configs" / preset).read_text())
    settings = Settings.from_run_config(config)
    assert all(getattr(settings, k.replace("-", "_")) == v for k, v in config.items())


def test_a_key_added_since_a_run_counts_as_its_default_then() -> None:
    """A checkpoint or grid written before `aggregator` existed still matches
    a run config that leaves it at its default, and not one that changes it."""
    now = Settings.from_run_config({}).to_run_config()
    before = {k: v for k, v in now.items() if k != "aggregator"}
    assert first_difference(before, now, ()) is None
    assert first_difference(before, {**now, "seed": 1}, ()) == "seed"
    assert first_difference(before, {**now, "aggregator": "median"}, ()) == "aggregator"


def test_a_part_brings_the_client_settings_its_paper_assumes() -> None:
    """SCAFFOLD's objectives assume plain SGD: "auto" gives momentum 0 under
    them (whichever preset chose them), the data set's 0.9 otherwise; an
    explicit value runs as asked, with one line that says so."""
    assert Settings.from_run_config({"strategy": "scaffold"}).momentum == 0.0
    objective = {"strategy": "fedavg", "local-objective": "scaffold-sam"}
    assert Settings.from_run_config(objective).momentum == 0.0
    assert Settings.from_run_config({"strategy": "fedavg"}).momentum == 0.9
    asked = {"strategy": "scaffold", "momentum": 0.9}
    settings = Settings.from_run_config(asked)
    assert settings.momentum == 0.9
    [line] = departures(asked, settings.to_run_config())
    assert line.startswith("momentum=0.9 as asked, though scaffold assumes momentum=0")
    assert "Karimireddy" in line
    plain = {"strategy": "scaffold", "momentum": 0.0}
    assert departures(plain, Settings.from_run_config(plain).to_run_config()) == []
    other = {"strategy": "fedavg", "momentum": 0.5}
    assert departures(other, Settings.from_run_config(other).to_run_config()) == []


def test_parts_that_assume_different_client_settings_need_an_explicit_one() -> None:
    plain, heavy = (
        Part(name, "", "pollen.task.objective_parts:Plain", training={"momentum": rho})
        for name, rho in (("plain-part", 0.0), ("heavy-part", 0.5))
    )
    silent = Part("silent", "", "pollen.task.objective_parts:Plain")
    assert assumed_training(plain, silent) == {"momentum": 0.0}
    with pytest.raises(ValueError, match=r"heavy-part's 0\.5.*set momentum explicitly"):
        assumed_training(plain, heavy)


def test_pollen_run_notes_once_what_departs_from_a_part(tmp_path, capsys) -> None:
    overrides = [
        f"strategy='scaffold' momentum=0.9 output-dir='{tmp_path}' run-name='r'"
    ]
    settings, _, _ = prepare_run(PROJECT, overrides)
    assert settings.momentum == 0.9
    out = capsys.readouterr().out
    assert out.count("pollen: note: momentum=0.9 as asked") == 1
    prepare_run(PROJECT, [f"strategy='scaffold' output-dir='{tmp_path}'"])
    assert "note" not in capsys.readouterr().out


def test_paths_the_serverapp_reads_are_pinned_to_the_shells_folder(
    tmp_path, monkeypatch
) -> None:
    """The SuperLink (and its ServerApp) runs in its Flower home: a relative
    network-profile or backbone-weights file would be looked for there. They
    are made absolute as data-root is; imagenet and random stay names."""
    monkeypatch.chdir(PROJECT)
    settings, config, _ = prepare_run(
        PROJECT,
        [f"network-profile='configs/networks/mixed.toml' output-dir='{tmp_path}' "
         "backbone-weights='weights/vgg.pt'"],
    )  # fmt: skip
    assert settings.network_profile == str(PROJECT / "configs/networks/mixed.toml")
    assert settings.backbone_weights == str(PROJECT / "weights/vgg.pt")
    assert f'network-profile="{PROJECT}/configs/networks/mixed.toml"' in config
    default, _, _ = prepare_run(PROJECT, [f"output-dir='{tmp_path}'"])
    assert (default.backbone_weights, default.network_profile) == ("imagenet", "")


def test_a_number_for_a_string_key_is_told_to_quote_it() -> None:
    """TOML reads attacker-clients=3 as a number: the refusal says what the
    key takes and how to write it, where quoting would do."""
    with pytest.raises(SettingsError, match=r"allowed: 'i,j,\.\.\.' of integers >= 0 "
                       r"\(in quotes: attacker-clients='3'\)"):  # fmt: skip
        Settings.from_run_config({"attack": "sign-flip", "attacker-clients": 3})
    with pytest.raises(SettingsError, match=r"allowed: one of fedavg.*fedbuff$"):
        Settings.from_run_config({"strategy": 3})

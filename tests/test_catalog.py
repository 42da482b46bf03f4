"""The catalogue is the one declaration of pollen's names: every
implementation agrees with it, and reading it costs no torch import."""

from __future__ import annotations

import subprocess
import sys

from torch.nn.modules.batchnorm import _BatchNorm

from pollen import catalog
from pollen.strategies.aggregation import Mean, Rule
from pollen.strategies.server_update import ServerUpdate
from pollen.task.data import SPECS
from pollen.task.lora import LoRALinear
from pollen.task.models import LORA_MODELS, MODELS, ModelOptions, build_model
from pollen.task.objective_parts import Plain
from pollen.task.sharing import POLICIES


def test_reading_the_catalogue_and_settings_imports_no_torch() -> None:
    code = (
        "import sys; import pollen.catalog, pollen.settings, pollen.protocol; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_every_data_set_has_a_loader_spec() -> None:
    """Every data set read from files; a generated one has none."""
    read = {name for name, info in catalog.DATA_SETS.items() if not info.generated}
    assert set(SPECS) == read
    assert SPECS["cifar100"].num_classes == 100 and SPECS["mnist"].size == 28


def test_models_agree_with_the_builders() -> None:
    assert set(catalog.MODELS) == {*MODELS, *LORA_MODELS}
    for name, info in catalog.MODELS.items():
        channels, side = (3, 32) if info.colour_only else (1, max(16, info.min_side))
        model = build_model(name, (channels, side, side), 10, 0, ModelOptions())
        modules = list(model.modules())
        assert info.batchnorm == any(isinstance(m, _BatchNorm) for m in modules), name
        assert info.lora == any(isinstance(m, LoRALinear) for m in modules), name


def test_every_named_part_loads_its_implementation() -> None:
    for part in catalog.SERVER_UPDATES.values():
        assert issubclass(part.load(), ServerUpdate), part.name
    assert catalog.AGGREGATORS["mean"].load() is Mean
    for part in catalog.AGGREGATORS.values():
        assert issubclass(part.load(), Rule), part.name
    for part in catalog.LOCAL_OBJECTIVES.values():
        objective = part.load()
        assert issubclass(objective, Plain), part.name
        assert objective.sam == part.name.endswith("sam"), part.name
        assert not objective.term or callable(
            catalog.load(objective.term).from_settings
        )
    assert issubclass(catalog.load(catalog.CENTRAL_DP_STEP), Rule)
    assert set(POLICIES) == set(catalog.SHARING_POLICIES)
    for preset in catalog.PRESETS.values():
        assert preset["server-update"] in catalog.SERVER_UPDATES
        assert preset["local-objective"] in catalog.LOCAL_OBJECTIVES


def test_model_input_problems_name_the_model_and_the_shape() -> None:
    problem = catalog.MODELS["simple-cnn"].input_problem(1, 8)
    assert problem == "model 'simple-cnn' needs images of at least 16x16, not 8x8"
    assert "colour images" in catalog.MODELS["vgg16-lora"].input_problem(1, 28)
    assert catalog.MODELS["mlp"].input_problem(1, 8) is None


def test_a_diverged_run_names_the_likely_causes_of_its_parts() -> None:
    from pollen.runs.evaluation import divergence_hint
    from pollen.settings import Settings

    dyn = Settings.from_run_config({"strategy": "feddyn", "dyn-alpha": 0.5, "lr": 0.01})
    assert divergence_hint(dyn) == (
        "dyn-alpha=0.5 with lr=0.01; or lr=0.01 too high (max-grad-norm=10)"
    )
    adam = Settings.from_run_config({"strategy": "fedadam", "server-lr": 0.3})
    assert divergence_hint(adam).startswith("server-lr=0.3 too high; or lr=")

"""How a run's "auto" keys become values: the strategy preset, the
assumptions of the parts it combines, the data set's defaults.

A key declared with the default "auto" (`pollen.settings`) takes its value
here, in this order: the strategy preset names the server update and the
local objective (and FedAvgM's momentum, FedSA's and FedPer's sharing,
FedBuff's mode, FedRep's head epochs, Ditto's lambda, APFL's alpha,
Per-FedAvg's beta, FedALA's layers, FedRoD's personal head, FedBABU's
frozen head and fine-tuning); the parts the run
then combines state the client hyper-parameters their algorithm assumes
(`catalog.Part.training`: SCAFFOLD's plain SGD); the data set fills the
rest with its measured defaults for the client optimiser. A value the user
sets is never replaced; `departures` says when it differs from what a part
assumes.

Works on plain run-config dicts (keys spelled as in the run config), so
`Settings` resolves before it builds itself and a saved run's settings
resolve the same way. Errors are `ValueError`s (`ExtensionError` for a
user's part that cannot be imported) that `Settings` turns into one line.
"""

from __future__ import annotations

from collections.abc import Mapping

from .catalog import PRESETS, TRAINING_KEYS, Part, Scalar, assumed_training
from .extensions import data_set_info, part
from .keys import AUTO

# The keys whose positive value gives each client a whole model of its own,
# the one its personal evaluation tests (Ditto, APFL, FedALA, FedRoD), and
# those whose positive value trains a client's model just before it is tested
# (fine-tuning, Per-FedAvg's step).
PERSONAL_MODEL_KEYS = ("ditto-lambda", "apfl-alpha", "ala-layers", "personal-head")
ADAPTING_KEYS = ("fine-tune-epochs", "per-fedavg-beta")


def personal_model(values: Mapping[str, Scalar]) -> bool:
    """Whether the resolved `values` give each client a personal model."""
    return any(float(values[name]) > 0 for name in PERSONAL_MODEL_KEYS)


def adapts(values: Mapping[str, Scalar]) -> bool:
    """Whether the resolved `values` train a client's model before its test."""
    return any(float(values[name]) > 0 for name in ADAPTING_KEYS)


def keeps_own_model(sharing_policy: str, personal_model: bool) -> bool:
    """Whether clients keep entries of their own (a sharing policy other
    than shared) or a personal model: then the global model alone is not
    what a client uses."""
    return sharing_policy != "shared" or personal_model


def run_parts(values: Mapping[str, Scalar]) -> tuple[Part, ...]:
    """The parts a run combines (its server update, aggregator and local
    objective, resolved)."""
    return (
        part("server-update", str(values["server-update"])),
        part("aggregator", str(values["aggregator"])),
        part("local-objective", str(values["local-objective"])),
    )


def resolve_auto(values: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """`values` with every "auto" replaced: by the strategy preset, then for
    the client's hyper-parameters by what the run's parts assume and the
    data set's defaults for the client optimiser."""
    resolved = dict(values)
    preset = PRESETS[str(resolved["strategy"])]

    def fill(name: str, value: Scalar) -> None:
        if resolved[name] == AUTO:
            resolved[name] = value

    for name in ("server-update", "local-objective"):
        fill(name, preset[name])
    data_set = data_set_info(str(resolved["data-set"]))
    training = {
        **data_set.training.values(str(resolved["client-optimizer"])),
        **assumed_training(*run_parts(resolved)),
    }
    for name in TRAINING_KEYS:
        fill(name, training[name])
    fill("partition", data_set.partition)
    fill("server-momentum", float(preset.get("server-momentum", 0.0)))
    fill("sharing", preset.get("sharing", "all"))
    fill("mode", preset.get("mode", "sync"))
    fill("head-epochs", int(preset.get("head-epochs", 0)))
    fill("ditto-lambda", float(preset.get("ditto-lambda", 0.0)))
    fill("apfl-alpha", float(preset.get("apfl-alpha", 0.0)))
    fill("per-fedavg-beta", float(preset.get("per-fedavg-beta", 0.0)))
    fill("ala-layers", int(preset.get("ala-layers", 0)))
    fill("personal-head", bool(preset.get("personal-head", False)))
    fill("freeze-head", bool(preset.get("freeze-head", False)))
    fill("fine-tune-epochs", int(preset.get("fine-tune-epochs", 0)))
    # the paper's inference where a personal evaluation can read it: the
    # client's own model, neither replaced nor trained first, evaluated
    prototypes = (
        part("local-objective", str(resolved["local-objective"])).load().prototypes
        and not (personal_model(resolved) or adapts(resolved))
        and resolved["personal-eval-every"] != 0
    )
    fill("proto-inference", "prototypes" if prototypes else "classifier")
    sharing = resolved["sharing"]
    policy = resolved["bn-policy"] if sharing == "all" else sharing
    own = keeps_own_model(str(policy), personal_model(resolved))
    by_prototypes = resolved["proto-inference"] == "prototypes"
    fill("personal-eval-every", int(own or adapts(resolved) or by_prototypes))
    if resolved["server-lr"] == AUTO:  # the server update's own default
        update = part("server-update", str(resolved["server-update"])).load()
        resolved["server-lr"] = update.auto_server_lr
    return resolved


def departures(
    run_config: Mapping[str, Scalar], values: Mapping[str, Scalar]
) -> list[str]:
    """One line for each client hyper-parameter that `run_config` sets
    explicitly to another value than a part of the run (resolved to
    `values`) assumes, such as momentum with SCAFFOLD's plain SGD: pollen
    runs what was asked, and says so once."""
    lines = []
    for run_part in run_parts(values):
        for key, assumed in run_part.training.items():
            given = run_config.get(key, AUTO)
            if given != AUTO and values[key] != assumed:
                lines.append(
                    f"{key}={values[key]:g} as asked, though {run_part.name} assumes "
                    f"{key}={assumed:g}: {run_part.training_reason}"
                )
    return lines

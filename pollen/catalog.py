"""Every name pollen offers, declared once and importable without torch.

Data sets with their shapes and classes, models with what they need and
whether they carry BatchNorm, the composable parts of an algorithm (server
updates, aggregation rules, local objectives, sharing policies) and the
strategy presets that combine them. `pollen.settings` validates run configs
against this catalogue, the CLI lists it, and each implementation is named
here by where it lives ("module:attribute"), so a new part is one entry
here plus its own module: `load` is the one place that turns a name into
code, and a part's own rules (what it needs and refuses) travel with its
implementation, where `pollen.settings` asks them at run time.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Scalar = bool | int | float | str


@dataclass(frozen=True)
class TrainingDefaults:
    """The client's hyper-parameters where the run config leaves them "auto":
    what a data set trains well with, chosen by measurement (docs/usage.md,
    "Defaults per data set and model"); any explicit value wins.

    `lr` is the rate of SGD with momentum, `adaptive_lr` the rate of the
    adaptive client optimisers (adam, adamw): their step is the gradient over
    its running RMS, so its size does not scale with the gradient's and
    their rate sits far below SGD's. The rates were measured with the mlp
    and (SGD) the cnn, which trains best at the mlp's rate or within 0.4
    points of its best, so they do not depend on the model.
    """

    lr: float
    momentum: float = 0.9
    batch_size: int = 16
    local_epochs: int = 2
    adaptive_lr: float = 0.001

    def values(self, client_optimizer: str) -> dict[str, Scalar]:
        """Each of TRAINING_KEYS for a client trained with `client_optimizer`."""
        adaptive = client_optimizer in ADAPTIVE_OPTIMIZERS
        return {
            "lr": self.adaptive_lr if adaptive else self.lr,
            "momentum": self.momentum,
            "batch-size": self.batch_size,
            "local-epochs": self.local_epochs,
        }

    def describe(self, key: str) -> str:
        """`key`'s default, with the adaptive rate for lr: "0.01 (adam/adamw 0.001)"."""
        plain = f"{self.values('sgd')[key]:g}"
        if key != "lr":
            return plain
        return f"{plain} ({'/'.join(ADAPTIVE_OPTIMIZERS)} {self.adaptive_lr:g})"


# The run-config keys "auto" takes from `TrainingDefaults`
TRAINING_KEYS = ("lr", "momentum", "batch-size", "local-epochs")
# the client optimisers whose rate is `TrainingDefaults.adaptive_lr`
ADAPTIVE_OPTIMIZERS = ("adam", "adamw")


@dataclass(frozen=True)
class DataSetInfo:
    """A data set's images (channels x side x side), its classes, the client
    hyper-parameters it trains well with and how it is split by default.
    A generated data set reads no files: its examples are drawn from the
    seed (`synthetic`, whose 60 features are 60 channels of one pixel)."""

    name: str
    channels: int
    side: int
    classes: int
    train_examples: int  # in its training split (the most clients it can feed)
    summary: str
    training: TrainingDefaults
    partition: str = "iid"  # what partition "auto" means for it
    generated: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """A model's name, what it is, and what it asks of its inputs, its
    sharing and its training (its rules, which `pollen.settings` asks)."""

    name: str
    summary: str
    batchnorm: bool = False  # trains on 2+ samples per batch; refused under DP-SGD
    lora: bool = False  # has LoRA layers: sharing lora-a / lora applies
    dropout: bool = False  # dropout beyond `lora-dropout`'s: refused by cohorts
    min_side: int = 0  # smallest image side it takes
    colour_only: bool = False
    # a frozen backbone whose features `cache-features` computes once
    frozen_backbone: bool = False
    linear: bool = True  # has an nn.Linear layer: FedPer's local classifier
    body: bool = True  # has trained layers below its classifier (logreg: none)

    def input_problem(self, channels: int, side: int) -> str | None:
        """Why this model cannot take `channels` x `side` x `side` images, or None."""
        if self.colour_only and (channels != 3 or side < self.min_side):
            return (
                f"model {self.name!r} needs colour images of at least "
                f"{self.min_side}x{self.min_side} (cifar10, cifar100), not "
                f"{channels}x{side}x{side}"
            )
        if side < self.min_side:
            return (
                f"model {self.name!r} needs images of at least "
                f"{self.min_side}x{self.min_side}, not {side}x{side}"
            )
        return None

    def sharing_problem(self, sharing: str) -> str | None:
        """Why this model cannot share by `sharing`, or None: LoRA's
        sharings need LoRA layers, and FedPer's local classifier is none."""
        if sharing in LORA_SHARING and not self.lora:
            return (
                f"sharing={sharing!r} needs a model with LoRA layers; model is "
                f"{self.name!r}; allowed: " + ", ".join(_models(lambda m: m.lora))
            )
        if sharing in HEAD_SHARING and not self.linear:
            return (
                f"sharing={sharing!r} with model={self.name!r}: it splits the model "
                "at the last nn.Linear layer (the classifier), and this model has "
                "none"
            )
        if sharing in HEAD_SHARING and self.lora:
            return (
                f"sharing={sharing!r} with model={self.name!r}: its classifier is a "
                "LoRA head, whose sharing is lora-a (FedSA) or lora; allowed with "
                f"{sharing}: " + ", ".join(_models(lambda m: not m.lora))
            )
        return None

    def cache_problem(self, cache_features: bool, augment: bool) -> str | None:
        """A frozen backbone's cached features are computed from un-augmented
        images, so they cannot be augmented."""
        if not (self.frozen_backbone and cache_features and augment):
            return None
        return (
            "cache-features=true with augment=true: features are computed once, "
            "from un-augmented images; set augment=false or cache-features=false"
        )

    def batchnorm_problem(
        self, dp: bool, bn_policy: str, batch_size: int
    ) -> str | None:
        """BatchNorm mixes a batch's samples: no DP-SGD, no step on one
        sample; and a BatchNorm policy needs BatchNorm layers."""
        name = repr(self.name)
        if dp and self.batchnorm:
            return (
                f"dp=true with model={name}: its BatchNorm mixes the samples of a "
                "batch, so per-sample gradients (DP-SGD) are undefined; allowed "
                "with dp: " + ", ".join(_models(lambda m: not m.batchnorm))
            )
        if bn_policy != "shared" and not self.batchnorm:
            return (
                f"bn-policy={bn_policy!r} with model={name}, which has no "
                "BatchNorm layer to keep local (the run would be plain FedAvg); "
                "models with BatchNorm: " + ", ".join(_models(lambda m: m.batchnorm))
            )
        if self.batchnorm and batch_size == 1:
            return (
                f"batch-size=1 with model={name}: BatchNorm cannot train on one "
                "sample, so no step would be taken; use batch-size=2 or more, or "
                "a model without BatchNorm (mlp, cnn-gn, simple-cnn)"
            )
        return None


def _models(has: Callable[[ModelInfo], bool]) -> list[str]:
    """The names of the models that `has` a feature."""
    return [name for name, info in MODELS.items() if has(info)]


def load(path: str) -> Any:
    """The object at `path` ("module:attribute", the attribute dotted where
    an entry point names one: "module:Class.factory"), its module imported
    on first use: how every part, pollen's own or a plug-in, is reached."""
    module, _, attribute = path.partition(":")
    return functools.reduce(
        getattr, attribute.split("."), importlib.import_module(module)
    )


@dataclass(frozen=True)
class Part:
    """One composable part of an algorithm: its name, what it does and the
    object that implements it ("module:attribute", imported on first use).

    The implementation carries the part's rules: `problem(settings)` (a
    classmethod) says why the part cannot run with a run's settings, or
    None, and `pollen.settings` asks it of every part a run combines (the
    fewest replies an aggregator is defined for, the modes and the other
    parts it refuses), so no rule of a part is copied elsewhere.
    """

    name: str
    summary: str
    implementation: str
    # the likely cause when a run with this part diverges ({settings attribute})
    divergence_hint: str = ""
    # client hyper-parameters (TRAINING_KEYS) the part's algorithm assumes:
    # "auto" takes these before the data set's, an explicit value wins
    training: Mapping[str, Scalar] = field(default_factory=dict)
    # why the part assumes them (said when a run config sets another value)
    training_reason: str = ""

    def load(self) -> Any:
        """The implementing object (a class or a function)."""
        return load(self.implementation)


def _by_name(*items: Any) -> dict[str, Any]:
    return {item.name: item for item in items}


# The learning rates are the best of four after 2 rounds (docs/usage.md,
# "Defaults per data set and model"): SGD's of 0.005, 0.01, 0.02 and 0.05 for
# the mlp (configs/grids/defaults-lr.toml; the cnn's best are the same or
# within 0.4 points, defaults-lr-cnn.toml), AdamW's of 0.0003, 0.001, 0.003
# and 0.01 for the mlp (defaults-lr-adam.toml). cifar100's are cifar10's,
# synthetic's adaptive rate Adam's customary 0.001 (not measured). digits
# keeps the quick run's tuned SGD rate 0.05. synthetic takes the FedProx
# paper's plain SGD at 0.01 with batch 10 (one epoch, not its 20).
DATA_SETS: dict[str, DataSetInfo] = _by_name(
    DataSetInfo("digits", 1, 8, 10, 1437, "scikit-learn's 8x8 digits (1,797 images)",
                TrainingDefaults(lr=0.05, adaptive_lr=0.01)),
    DataSetInfo("mnist", 1, 28, 10, 60000, "handwritten digits",
                TrainingDefaults(lr=0.01)),
    DataSetInfo("fashion-mnist", 1, 28, 10, 60000, "Zalando's clothing images",
                TrainingDefaults(lr=0.01)),
    DataSetInfo("cifar10", 3, 32, 10, 50000, "32x32 colour images, 10 classes",
                TrainingDefaults(lr=0.005, adaptive_lr=0.0003)),
    DataSetInfo("cifar100", 3, 32, 100, 50000, "32x32 colour images, 100 classes",
                TrainingDefaults(lr=0.005, adaptive_lr=0.0003)),
    DataSetInfo("synthetic", 60, 1, 10, 1_000_000,
                "FedProx's Synthetic(alpha, beta): a softmax-regression task per "
                "client, power-law sizes, generated from the seed",
                TrainingDefaults(lr=0.01, momentum=0.0, batch_size=10, local_epochs=1),
                partition="natural", generated=True),
)  # fmt: skip

MODELS: dict[str, ModelInfo] = _by_name(
    ModelInfo("mlp", "two hidden layers"),
    ModelInfo(
        "logreg",
        "softmax regression, one linear layer (FedProx's synthetic)",
        body=False,
    ),
    ModelInfo("mlp-bn", "the mlp with BatchNorm", batchnorm=True),
    ModelInfo("cnn", "small CNN with BatchNorm", batchnorm=True, min_side=4),
    ModelInfo("cnn-gn", "the cnn with GroupNorm (DP-SGD's choice)", min_side=4),
    ModelInfo("simple-cnn", "LeNet-style CNN of NIID-Bench", min_side=16),
    ModelInfo("fedavg-cnn", "FedAvg's CNN as PFLlib builds it", min_side=16),
    ModelInfo(
        "cnn-lora", "the cnn with a LoRA head", batchnorm=True, lora=True, min_side=4
    ),
    ModelInfo(
        "mobilenet", "MobileNetV2 for small images", batchnorm=True, dropout=True
    ),
    ModelInfo(
        "vgg16-lora",
        "frozen VGG16 backbone with a LoRA head (FedSA-FTL)",
        lora=True,
        min_side=32,
        colour_only=True,
        frozen_backbone=True,
    ),
)

FEDDYN_HINT = "dyn-alpha={dyn_alpha:g} with lr={lr:g}"
SERVER_UPDATES: dict[str, Part] = _by_name(
    Part("fedavg", "the aggregate is the model", "pollen.strategies.fedavg:FedAvgUpdate"),
    Part("feddyn", "uniform mean corrected by the server state h",
         "pollen.strategies.feddyn:FedDynUpdate", FEDDYN_HINT),
    *(
        Part(name, f"server {name} on the pseudo-gradient (FedOpt)",
             f"pollen.strategies.fedopt:{optimizer}", "server-lr={server_lr:g} too high")
        for name, optimizer in (("sgd", "ServerSgd"), ("adagrad", "ServerAdagrad"),
                                ("adam", "ServerAdam"), ("yogi", "ServerYogi"))
    ),
)  # fmt: skip

ROBUST = "pollen.strategies.robust"
AGGREGATORS: dict[str, Part] = _by_name(
    Part("mean", "weighted mean of the replies, per entry",
         "pollen.strategies.aggregation:Mean"),
    Part("median", "coordinate-wise median (Yin et al. 2018)", f"{ROBUST}:Median"),
    Part("trimmed-mean", "coordinate-wise mean without the trim-fraction "
         "extremes on each side (Yin et al. 2018)", f"{ROBUST}:TrimmedMean"),
    Part("krum", "the one reply closest to its n-f-2 neighbours (Blanchard "
         "et al. 2017)", f"{ROBUST}:Krum"),
    Part("multi-krum", "mean of the krum-select replies of lowest "
         "Krum score", f"{ROBUST}:MultiKrum"),
    Part("bulyan", "recursive Krum, then a trimmed mean around the median "
         "(El Mhamdi et al. 2018)", f"{ROBUST}:Bulyan"),
    Part("fednova", "normalised averaging: each update over its effective "
         "local steps (Wang et al. 2020)", "pollen.strategies.fednova:FedNova"),
)  # fmt: skip

# What a malicious client does (pollen.task.attacks): model poisoning after
# honest training, or training on flipped labels
MODEL_POISONING = ("sign-flip", "scale", "noise")
ATTACKS = ("none", *MODEL_POISONING, "label-flip")

# SCAFFOLD's control variates estimate each client's drift in plain SGD's
# gradient (Karimireddy et al. 2020, Algorithm 1; docs/algorithms.md, "SCAFFOLD
# and momentum"): its paper's local optimiser is SGD without momentum
SCAFFOLD_TRAINING: dict[str, Scalar] = {"momentum": 0.0}
SCAFFOLD_REASON = (
    "SCAFFOLD's control variates correct plain SGD's client drift (Karimireddy "
    "et al. 2020, Algorithm 1); momentum makes a round's path ten times longer, "
    "and on long local paths it fell far below FedAvg or to chance "
    "(docs/algorithms.md, 'SCAFFOLD and momentum')"
)

# "<regulariser>-sam": that regulariser, with the data gradient taken at SAM's
# perturbed point
OBJECTIVES = "pollen.task.objective_parts"
LOCAL_OBJECTIVES: dict[str, Part] = _by_name(
    Part("plain", "the data loss", f"{OBJECTIVES}:Plain"),
    Part("sam", "the data loss at SAM's perturbed point (FedSAM)",
         f"{OBJECTIVES}:Sam"),
    Part("feddyn", "FedDyn's dynamic regulariser", f"{OBJECTIVES}:FedDyn",
         divergence_hint=FEDDYN_HINT),
    Part("prox", "FedProx's proximal term", f"{OBJECTIVES}:Prox"),
    Part("feddyn-sam", "FedDyn's regulariser with SAM", f"{OBJECTIVES}:FedDynSam",
         divergence_hint=FEDDYN_HINT),
    Part("prox-sam", "FedProx's term with SAM", f"{OBJECTIVES}:ProxSam"),
    Part("moon", "MOON's model-contrastive loss (global vs previous model)",
         f"{OBJECTIVES}:Moon"),
    Part("fedproto", "FedProto's pull of each representation to its class's "
         "global prototype; the prototypes travel", f"{OBJECTIVES}:FedProto"),
    Part("scaffold", "SCAFFOLD's control-variate correction c - c_k",
         f"{OBJECTIVES}:Scaffold", training=SCAFFOLD_TRAINING,
         training_reason=SCAFFOLD_REASON),
    Part("scaffold-sam", "SCAFFOLD's correction with SAM",
         f"{OBJECTIVES}:ScaffoldSam", training=SCAFFOLD_TRAINING,
         training_reason=SCAFFOLD_REASON),
)  # fmt: skip

# user-level DP-FedAvg: off, or its clipping, both by one aggregation step
# (which replaces the aggregator)
CENTRAL_DP = ("off", "fixed", "adaptive")
CENTRAL_DP_STEP = "pollen.strategies.central_dp:CentralDP"

# Which model entries travel (pollen.task.sharing): BatchNorm policies
# under `sharing = all`, and the LoRA policies of FedSA.
BN_POLICIES = ("shared", "fedbn", "silobn")
SHARING = ("all", "lora-a", "lora", "fedper", "lg", "local")
# the sharings whose classifier, the last nn.Linear, is their own part
HEAD_SHARING = ("fedper", "lg")
LORA_SHARING = ("lora-a", "lora")
SHARING_POLICIES = (*BN_POLICIES, *SHARING[1:])
# what sharing, fine-tuning and the personal schedules (FedRep, FedBABU,
# Ditto, APFL, FedALA, FedRoD, Per-FedAvg) refuse
PERSONAL_RULES = "pollen.task.personal_rules:personal_problem"

# A strategy preset is a default combination of parts (explicit keys win):
# a server update and a local objective, plus the server momentum that makes
# FedAvgM and the sharing of FedSA.
PRESETS: dict[str, dict[str, Scalar]] = {
    "fedavg": {"server-update": "fedavg", "local-objective": "plain"},
    "fedavgm": {
        "server-update": "sgd", "local-objective": "plain", "server-momentum": 0.9,
    },
    "fedprox": {"server-update": "fedavg", "local-objective": "prox"},
    "moon": {"server-update": "fedavg", "local-objective": "moon"},
    "fedsam": {"server-update": "fedavg", "local-objective": "sam"},
    "scaffold": {"server-update": "fedavg", "local-objective": "scaffold"},
    "feddyn": {"server-update": "feddyn", "local-objective": "feddyn"},
    "fedadagrad": {"server-update": "adagrad", "local-objective": "plain"},
    "fedadam": {"server-update": "adam", "local-objective": "plain"},
    "fedyogi": {"server-update": "yogi", "local-objective": "plain"},
    "fedsa": {"server-update": "fedavg", "local-objective": "plain", "sharing": "lora-a"},
    "fedper": {"server-update": "fedavg", "local-objective": "plain", "sharing": "fedper"},
    "lg-fedavg": {"server-update": "fedavg", "local-objective": "plain", "sharing": "lg"},
    "ditto": {"server-update": "fedavg", "local-objective": "plain", "ditto-lambda": 0.1},
    "apfl": {"server-update": "fedavg", "local-objective": "plain", "apfl-alpha": 0.5},
    "per-fedavg": {
        "server-update": "fedavg", "local-objective": "plain", "per-fedavg-beta": 0.005,
    },
    "fedala": {"server-update": "fedavg", "local-objective": "plain", "ala-layers": 2},
    "fedproto": {
        "server-update": "fedavg", "local-objective": "fedproto", "sharing": "local",
    },
    "fedrod": {
        "server-update": "fedavg", "local-objective": "plain", "personal-head": True,
    },
    "fedbabu": {
        "server-update": "fedavg", "local-objective": "plain", "sharing": "fedper",
        "freeze-head": True, "fine-tune-epochs": 5,
    },
    "fedrep": {
        "server-update": "fedavg", "local-objective": "plain", "sharing": "fedper",
        "head-epochs": 2,
    },
    "fedbuff": {"server-update": "sgd", "local-objective": "plain", "mode": "async"},
}  # fmt: skip


def assumed_training(*parts: Part) -> dict[str, Scalar]:
    """The client hyper-parameters a run's parts assume (`Part.training`),
    merged; two parts that assume different values for one key cannot
    both have theirs, so that is an error the run config must settle."""
    merged: dict[str, Scalar] = {}
    for part in parts:
        for key, value in part.training.items():
            if merged.get(key, value) != value:
                raise ValueError(
                    f"the parts assume different {key} ({merged[key]} and "
                    f"{part.name}'s {value}); set {key} explicitly"
                )
            merged[key] = value
    return merged


# how the server drives training: synchronous rounds, or FedBuff's buffered
# asynchronous aggregation (pollen.strategies.asynchronous)
MODES = ("sync", "async")
# what a FedProto client's personal evaluation predicts by (pollen.task.fedproto)
PROTO_INFERENCE = ("classifier", "prototypes")
ASYNC_RULES = "pollen.strategies.async_rules:async_problem"
# the keys whose parts may need the mean aggregator or synchronous rounds
# (their `mean_only` and `synchronous_only`)
CHOOSING_KEYS = ("local-objective", "server-update")

# what `update-norm-bound` does to a larger update (pollen.strategies.replies)
NORM_ACTIONS = ("clip", "drop")
# FedDyn's server h averages the drift over all clients or this round's
FEDDYN_H_SCALES = ("num-clients", "participants")
# natural: each client is its own task (a generated data set's own split)
PARTITIONS = ("iid", "niid", "niid-client", "pathological", "silos", "natural")
CLASS_ASSIGNMENTS = ("first-deterministic", "deterministic", "random")
CLIENT_OPTIMIZERS = ("sgd", *ADAPTIVE_OPTIMIZERS)
# `backbone-weights` values that name no file (anything else is a file path)
BACKBONE_SOURCES = ("imagenet", "random")
DEVICES = ("auto", "cpu", "cuda", "mps")
# how a node trains the clients it serves in a round: one after another, or
# together as one vectorised cohort (pollen.task.cohort); what a cohort
# refuses, its rules say (pollen.task.cohort_rules)
CLIENT_EXECUTIONS = {
    "sequential": "one client after another: every model, objective and schedule",
    "cohort": (
        "a node's clients of a round trained together, vectorised with "
        "torch.func: every local objective (plain, prox, feddyn, scaffold, "
        "SAM and the -sam ones), sgd/adam/adamw, models without dropout "
        "(BatchNorm's running statistics kept per client; not with "
        "momentum=None); refused: DP-SGD, FedRep, Ditto, mode async"
    ),
}
COHORT_RULES = "pollen.task.cohort_rules:cohort_problem"
# secure aggregation: the server learns only a round's sum
# (pollen.strategies.secure_round); what it refuses, its rules say
SECURE_AGGREGATIONS = {
    "off": "the server sees each client's update (TLS protects only the link)",
    "secagg+": (
        "SecAgg+ masks: the server unmasks only the round's sum; with the mean "
        "and every server update on it (fedavg, fedopt, feddyn), any sharing, "
        "local objective (scaffold's c summed too), DP-SGD, attacks; refused: "
        "robust aggregators, fednova, central-dp, update-norm-bound, "
        "round-deadline, mode async, cohorts"
    ),
}
SECAGG_RULES = "pollen.strategies.secagg_rules:secagg_problem"
TRACKERS = ("none", "tensorboard", "mlflow")
# MLflow stores a run may name besides an http(s) tracking server
# (a database URI may name its driver: postgresql+psycopg2://)
TRACKING_STORES = ("sqlite:///", "file:///", "postgresql", "mysql", "mssql")

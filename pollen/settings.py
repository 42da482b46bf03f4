"""Every run-config key pollen understands, declared once.

A key's type, default, help text and allowed values live in the field of
`Settings` that holds it. `Settings.from_run_config` turns Flower's run config
(pyproject defaults fused with `--run-config` overrides) into a validated,
typed, frozen object; anything invalid raises `SettingsError` with one line
naming the key, the value and what is allowed, before any data is touched.

Checks that need the data (a `min-size` the data cannot meet, more
classes per client than the data set has) live with the data, in
`pollen.task.partition`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .catalog import (
    AGGREGATORS,
    ATTACKS,
    BN_POLICIES,
    CENTRAL_DP,
    CLASS_ASSIGNMENTS,
    CLIENT_OPTIMIZERS,
    CONTROL_VARIATE_OBJECTIVES,
    DATA_SETS,
    DEVICES,
    FEDDYN_H_SCALES,
    LOCAL_OBJECTIVES,
    LORA_SHARING,
    MODELS,
    MODES,
    NORM_ACTIONS,
    PARTITIONS,
    PRESETS,
    SERVER_UPDATES,
    SHARING,
    TRACKERS,
    TRACKING_STORES,
    TRAINING_KEYS,
    DataSetInfo,
    ModelInfo,
    Part,
    Scalar,
    assumed_training,
)
from .common.partition_sizes import PartitionError, check_min_size
from .common.webhook import check_url
from .extensions import (
    DATA_SET_GROUP,
    MODEL_GROUP,
    ExtensionError,
    data_set_info,
    model_info,
    names_user_part,
)
from .network_profile import NetworkProfile, ProfileError

AUTO = "auto"
# server-lr = "auto": 1 for a plain step (FedAvg's), 0.01 for the adaptive ones
# (the seed notebook's value)
AUTO_SERVER_LR = {"sgd": 1.0, "adagrad": 1e-2, "adam": 1e-2, "yogi": 1e-2}
STRATEGIES = tuple(PRESETS)
# Keys that name one invocation of a run, not what it computes: a resume or a
# finished comparison cell never differs by them
INVOCATION_KEYS = frozenset({"run-token"})


class SettingsError(ValueError):
    """An invalid run-config value; the message is one line a user can act on."""


@dataclass(frozen=True)
class Rule:
    """What a key allows: a predicate and the words that describe it."""

    check: Callable[[Any], bool]
    allowed: str


def one_of(*choices: str) -> Rule:
    return Rule(lambda v: v in choices, "one of " + ", ".join(choices))


def at_least(low: float) -> Rule:
    return Rule(lambda v: v >= low, f">= {low:g}")


def above(low: float) -> Rule:
    return Rule(lambda v: v > low, f"> {low:g}")


def in_range(low: float, high: float) -> Rule:
    return Rule(lambda v: low < v <= high, f"in ({low:g}, {high:g}]")


def part_rule(built_in: Collection[str], group: str) -> Rule:
    """A built-in name, or a user's part (`pollen.extensions`)."""
    return Rule(
        lambda v: v in built_in or names_user_part(v, group),
        "one of " + ", ".join(built_in) + ", or a user's: an import path "
        f"'module:function' or a name registered under entry-point group {group} "
        "(docs/extending.md)",
    )


def betas_rule() -> Rule:
    return Rule(lambda v: _parse_betas(v) is not None, "'b1,b2' with both in [0, 1)")


def webhook_rule() -> Rule:
    def valid(url: str) -> bool:
        try:
            return not url or bool(check_url(url))
        except ValueError:
            return False

    return Rule(valid, "an http(s) URL, or empty")


def folder_name_rule() -> Rule:
    def valid(name: str) -> bool:
        return not name or (
            not any(c in name for c in "/\\") and name.strip(". ") != ""
        )

    return Rule(valid, "a name without / or \\ (it names a folder), or empty")


def tracking_uri_rule() -> Rule:
    def valid(uri: str) -> bool:
        if not uri:
            return True
        if uri.startswith(("http://", "https://")):
            return webhook_rule().check(uri)
        scheme, _, rest = uri.partition("://")
        return uri.startswith(TRACKING_STORES) and bool(rest) and "/" not in scheme

    return Rule(
        valid,
        "empty, an http(s) URL of an MLflow tracking server, or a store URI "
        "starting with " + ", ".join(TRACKING_STORES),
    )


def _parse_clients(text: str) -> tuple[int, ...] | None:
    """'3,7' -> (3, 7); None where a part is not an integer >= 0."""
    if not text.strip():
        return ()
    try:
        clients = tuple(int(part) for part in text.split(","))
    except ValueError:
        return None
    return clients if all(c >= 0 for c in clients) else None


def _parse_betas(text: str) -> tuple[float, float] | None:
    try:
        b1, b2 = (float(part) for part in text.split(","))
    except ValueError:
        return None
    return (b1, b2) if 0 <= b1 < 1 and 0 <= b2 < 1 else None


def key(
    default: Scalar, help: str, rule: Rule | None = None, kind: type | None = None
) -> Any:
    """Declare one run-config key (as a dataclass field).

    `kind` is the value type when the default is the string "auto" (the key
    then takes "auto" or a value of that kind, and "auto" is resolved from the
    strategy preset, or for the client's hyper-parameters from the data set).
    """
    metadata = {"help": help, "rule": rule, "kind": kind or type(default)}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """A validated run configuration. Attribute `data_set` is key `data-set`."""

    # Reproducibility and compute
    seed: int = key(
        845, "seed for partitions, client sampling and training", at_least(0)
    )
    device: str = key("auto", "auto picks CUDA, then MPS, then CPU", one_of(*DEVICES))
    # Data
    data_set: str = key(
        "digits", "data set to train on", part_rule(DATA_SETS, DATA_SET_GROUP)
    )
    data_root: str = key(
        "data", "folder with <name>.npz / image folders; decoded cache goes here"
    )
    download: bool = key(True, "download with torchvision when no local copy exists")
    augment: bool = key(True, "random crop + flip for 32x32 colour data")
    normalize: bool = key(True, "standardise inputs with the data set's mean/std")
    test_batch_size: int = key(
        128, "batch size of the server's evaluation", at_least(1)
    )
    # Federation
    num_clients: int = key(10, "number of clients (data partitions)", at_least(1))
    client_frac: float = key(
        0.25, "fraction of clients sampled per round", in_range(0, 1)
    )
    # auto: the data set's measured default (catalog.TrainingDefaults)
    local_epochs: int = key(
        AUTO, "local epochs per round (auto: the data set's)", at_least(1), int
    )
    batch_size: int = key(
        AUTO, "local batch size (auto: the data set's)", at_least(1), int
    )
    lr: float = key(
        AUTO,
        "initial client learning rate (auto: the data set's for the client optimiser)",
        above(0),
        float,
    )
    momentum: float = key(
        AUTO,
        "client SGD momentum (auto: 0 for SCAFFOLD's objectives, as its paper "
        "runs it, else the data set's)",
        Rule(lambda v: 0 <= v < 1, "in [0, 1)"),
        float,
    )
    weight_decay: float = key(5e-4, "client weight decay", at_least(0))
    rounds: int = key(10, "communication rounds", at_least(1))
    model: str = key("mlp", "model architecture", part_rule(MODELS, MODEL_GROUP))
    # Algorithm: a preset, and the three parts it combines
    strategy: str = key(
        "fedavg",
        "preset: a server update + local objective (auto values below)",
        one_of(*STRATEGIES),
    )
    server_update: str = key(
        AUTO, "how the server turns replies into the next model",
        one_of(AUTO, *SERVER_UPDATES),
    )  # fmt: skip
    aggregator: str = key(
        "mean",
        "how a round's replies become one aggregate, before the server update",
        one_of(*AGGREGATORS),
    )
    trim_fraction: float = key(
        0.2,
        "aggregator trimmed-mean: share of the values dropped at each end, per "
        "coordinate",
        Rule(lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    )
    byzantine_clients: int = key(
        0,
        "aggregators krum, multi-krum, bulyan: f, the Byzantine replies a round "
        "must tolerate",
        at_least(0),
    )
    krum_select: int = key(
        0,
        "aggregator multi-krum: m, the replies of lowest score averaged (0: n - f)",
        at_least(0),
    )
    local_objective: str = key(
        AUTO, "what each client minimises", one_of(AUTO, *LOCAL_OBJECTIVES)
    )
    bn_policy: str = key(
        "shared",
        "BatchNorm entries: shared, fedbn (all local), silobn (statistics local)",
        one_of(*BN_POLICIES),
    )
    sharing: str = key(
        AUTO,
        "what travels: all (per bn-policy), lora-a (A matrices only; auto: fedsa), "
        "lora (A and B), fedper (all but the classifier; auto: fedper)",
        one_of(AUTO, *SHARING),
    )
    head_epochs: int = key(
        AUTO,
        "FedRep: epochs of the local classifier alone (body frozen) before the "
        "local-epochs of the body (classifier frozen); needs sharing fedper "
        "(auto: 0, fedrep: 2)",
        at_least(0),
        int,
    )
    ditto_lambda: float = key(
        AUTO,
        "Ditto: each client also trains a personal model regularised by "
        "lambda/2 ||v - w||^2 towards the received global model, and is "
        "evaluated on it (auto: 0 = off, ditto: 0.1)",
        at_least(0),
        float,
    )
    client_optimizer: str = key("sgd", "client optimiser", one_of(*CLIENT_OPTIMIZERS))
    betas: str = key("0.9,0.999", "client adam/adamw betas", betas_rule())
    max_grad_norm: float = key(
        10.0, "clip each local gradient to this L2 norm (0: no clipping)", at_least(0)
    )
    sam_rho: float = key(
        0.05,
        "SAM neighbourhood radius (local-objective sam, feddyn-sam, prox-sam)",
        above(0),
    )
    prox_mu: float = key(
        0.01, "FedProx weight mu (local-objective prox, prox-sam)", at_least(0)
    )
    dyn_alpha: float = key(
        0.1, "FedDyn alpha, client regulariser and server state", above(0)
    )
    feddyn_h_scale: str = key(
        "num-clients",
        "FedDyn server h update averages over all clients or this round's",
        one_of(*FEDDYN_H_SCALES),
    )
    feddyn_exclude_bn: bool = key(
        True, "keep BatchNorm weights out of FedDyn's correction and regulariser"
    )
    server_lr: float = key(
        AUTO, "server step size (sgd: 1, adaptive: 0.01 when auto)", above(0), float
    )
    server_momentum: float = key(
        AUTO,
        "server heavy-ball momentum for sgd (FedAvgM; auto: 0.9 for fedavgm, else 0)",
        Rule(lambda v: 0 <= v < 1, "in [0, 1)"),
        float,
    )
    beta1: float = key(
        0.9,
        "adaptive server first-moment decay",
        Rule(lambda v: 0 <= v < 1, "in [0, 1)"),
    )
    beta2: float = key(
        0.99, "adam/yogi second-moment decay", Rule(lambda v: 0 <= v < 1, "in [0, 1)")
    )
    tau: float = key(1e-3, "adaptive server adaptivity (denominator offset)", above(0))
    bias_correction: bool = key(
        False, "adaptive server: divide moments by 1 - beta^t (the notebook's Adam)"
    )
    personal_eval_every: int = key(
        AUTO,
        "evaluate each client's own model (its local entries or Ditto's personal "
        "model; the global model where it keeps none) on its own test shard every "
        "N rounds (0: never; auto: 1 where clients keep entries or a personal "
        "model, else 0)",
        at_least(0),
        int,
    )
    # LoRA heads and the frozen VGG16 backbone (models cnn-lora, vgg16-lora)
    lora_rank: int = key(
        8, "LoRA rank r (seed 002: 8 for CIFAR-10, 16 for CIFAR-100)", at_least(1)
    )
    lora_alpha: float = key(
        8.0, "LoRA scale alpha; the update is alpha/r * B A", above(0)
    )
    lora_dropout: float = key(
        0.1, "dropout on the LoRA path", Rule(lambda v: 0 <= v < 1, "in [0, 1)")
    )
    backbone_weights: str = key(
        "imagenet",
        "vgg16-lora backbone: imagenet (torchvision download), random, or a file path",
    )
    cache_features: bool = key(
        True,
        "frozen backbone: compute each image's features once, train the head on them",
    )
    # Differential privacy (DP-SGD with Opacus)
    dp: bool = key(False, "train with DP-SGD: per-sample clipping and Gaussian noise")
    dp_epsilon: float = key(
        10.0, "privacy budget epsilon for the whole planned run", above(0)
    )
    dp_delta: float = key(
        1e-5, "privacy parameter delta", Rule(lambda v: 0 < v < 1, "in (0, 1)")
    )
    dp_max_grad_norm: float = key(1.0, "per-sample gradient clipping bound C", above(0))
    # Central (user-level) DP: clip each client's update, noise on the server
    central_dp: str = key(
        "off",
        "user-level DP-FedAvg: fixed or adaptive clipping of each update, "
        "Gaussian noise on the server's sum (off: none)",
        one_of(*CENTRAL_DP),
    )
    central_clip_on: str = key(
        "server",
        "who clips first (the server always clips too)",
        one_of("server", "client"),
    )
    central_clip_norm: float = key(
        1.0, "central DP: the clipping norm C (adaptive: its start)", above(0)
    )
    central_noise_multiplier: float = key(
        1.0, "central DP: z, noise std z C on the sum of clipped updates", above(0)
    )
    central_epsilon: float = key(
        0.0,
        "central DP: calibrate the noise multiplier so that `rounds` rounds spend "
        "this epsilon at dp-delta (0: use central-noise-multiplier)",
        at_least(0),
    )
    central_clip_quantile: float = key(
        0.5,
        "adaptive clipping: the share of updates C aims to leave unclipped",
        Rule(lambda v: 0 < v < 1, "in (0, 1)"),
    )
    central_clip_lr: float = key(0.2, "adaptive clipping: step of log C", above(0))
    central_count_noise: float = key(
        0.0,
        "adaptive clipping: std of the noise on the unclipped count (0: clients "
        "per round / 20)",
        at_least(0),
    )
    # Untrusted clients: what the server does with replies it cannot use
    min_train_replies: int = key(
        1,
        "fewest valid training replies a round aggregates; with fewer the round is "
        "skipped and the model kept",
        at_least(1),
    )
    update_norm_bound: float = key(
        0.0,
        "clip or drop an update whose norm exceeds k x the round's median (0: off)",
        Rule(lambda v: v == 0 or v >= 1, "0 (off) or >= 1"),
    )
    update_norm_action: str = key(
        "clip", "what update-norm-bound does to a larger update", one_of(*NORM_ACTIONS)
    )
    # Attacks, to test the robust aggregators (pollen.task.attacks)
    attack: str = key(
        "none",
        "what the attacking clients do: sign-flip (send -s x update), scale (s x "
        "update), noise (N(0, s^2) instead of the update), label-flip (train on "
        "C-1-y); s is attack-scale",
        one_of(*ATTACKS),
    )
    attack_scale: float = key(10.0, "s of sign-flip, scale and noise", above(0))
    attackers: float = key(
        0.0,
        "share of the clients that attack, drawn by seed (or attacker-clients)",
        Rule(lambda v: 0 <= v < 1, "in [0, 1)"),
    )
    attacker_clients: str = key(
        "",
        "the clients that attack, as 'i,j,...' (instead of attackers)",
        Rule(lambda v: _parse_clients(v) is not None, "'i,j,...' of integers >= 0"),
    )
    # Participation: who must be there, how long to wait for them
    min_available_nodes: int = key(
        1,
        "connected SuperNodes needed before a round starts; waits up to node-wait s, "
        "then stops the run",
        at_least(1),
    )
    min_train_nodes: int = key(
        1,
        "fewest clients sampled per round (more than client-frac x num-clients "
        "when larger; capped by the clients whose node is connected)",
        at_least(1),
    )
    node_wait: float = key(
        120.0,
        "seconds to wait for min-available-nodes (and for a first node at start)",
        at_least(0),
    )
    round_deadline: float = key(
        0.0,
        "seconds after which a synchronous round aggregates what arrived; later "
        "replies are discarded and recorded as late (0: none; simulated seconds "
        "under network-profile in simulation)",
        at_least(0),
    )
    # Asynchronous training (FedBuff) and the simulated network
    mode: str = key(
        AUTO,
        "sync rounds, or async buffered aggregation (FedBuff; auto: async for fedbuff)",
        one_of(AUTO, *MODES),
    )
    concurrency: int = key(
        0,
        "async: clients training at once (0: as many as a synchronous round samples)",
        at_least(0),
    )
    buffer_size: int = key(
        0,
        "async: replies per server update, K of FedBuff (0: half the concurrency, "
        "at least 1)",
        at_least(0),
    )
    network_profile: str = key(
        "",
        "a network profile (TOML, configs/networks/): the simulated clock's links "
        "and slowdowns (empty: none)",
    )
    round_timeout: float = key(
        3600.0,
        "seconds to wait for a round's replies; a client without a reply by then "
        "is recorded as a failure",
        above(0),
    )
    state_memory_mib: float = key(
        16.0,
        "MiB of client state (h_k, c_k, local entries) a node keeps in memory; "
        "beyond it the least recently trained clients' state goes to disk until "
        "they are sampled again (0: no bound)",
        at_least(0),
    )
    # Checkpoints and notifications
    checkpoint_every: int = key(
        0, "save global model + server state every N rounds (0: never)", at_least(0)
    )
    checkpoint_keep: int = key(
        3, "how many of the newest checkpoints to keep", at_least(1)
    )
    resume: str = key("", "a run directory whose latest checkpoint this run continues")
    notify_url: str = key(
        "",
        "webhook for progress messages (empty: env POLLEN_NOTIFY_URL, or none)",
        webhook_rule(),
    )
    notify_every: int = key(
        10, "notify every N rounds (0: start and end only)", at_least(0)
    )
    tracker: str = key(
        "none",
        "experiment tracking besides the run's files: none, tensorboard (event "
        "files in <run>/tensorboard/; the tensorboard extra) or mlflow (an MLflow "
        "run at tracking-uri; the mlflow extra)",
        one_of(*TRACKERS),
    )
    tracking_uri: str = key(
        "",
        "where tracker=mlflow logs: http(s)://host:port of a tracking server, "
        "sqlite:///file.db, file:///dir (empty: where a resumed run logged, else "
        "env MLFLOW_TRACKING_URI, else sqlite:///<output-dir>/mlflow.db)",
        tracking_uri_rule(),
    )
    tracking_experiment: str = key(
        "",
        "the MLflow experiment a tracked run joins (empty: 'pollen'; under pollen "
        "compare, the comparison directory's name)",
        folder_name_rule(),
    )
    # Partitioning
    partition: str = key(
        AUTO,
        "how training data is split (auto: iid, natural for synthetic: each "
        "client its own generated task)",
        one_of(AUTO, *PARTITIONS),
    )
    synthetic_alpha: float = key(
        1.0,
        "data-set synthetic: alpha, how much the clients' models differ",
        at_least(0),
    )
    synthetic_beta: float = key(
        1.0,
        "data-set synthetic: beta, how much the clients' inputs differ",
        at_least(0),
    )
    alpha: float = key(
        0.5, "Dirichlet concentration for partition=niid and niid-client", above(0)
    )
    min_size: int = key(
        10, "minimum samples per client for partition=niid and niid-client", at_least(0)
    )
    classes_per_client: int = key(
        2, "classes per client for partition=pathological", at_least(1)
    )
    class_assignment: str = key(
        "first-deterministic",
        "which classes each client holds for partition=pathological: "
        "'first-deterministic' (client i's first class is i mod classes, the others "
        "drawn by seed, as in NIID-Bench), 'deterministic' (client i holds classes "
        "i, i+1, ... mod classes: every class on equally many clients when "
        "num-clients x classes-per-client is a multiple of the classes), 'random' "
        "(all drawn by seed; a class may go unused)",
        one_of(*CLASS_ASSIGNMENTS),
    )
    print_labels: bool = key(False, "print each client's label counts")
    # ReduceLROnPlateau on the server's test loss
    lr_factor: float = key(
        0.5, "lr multiplier on a plateau", Rule(lambda v: 0 < v < 1, "in (0, 1)")
    )
    lr_patience: int = key(5, "rounds without improvement before a cut", at_least(0))
    min_lr: float = key(1e-6, "lower bound of the lr", at_least(0))
    lr_threshold: float = key(1e-4, "relative improvement that counts", at_least(0))
    lr_cooldown: int = key(0, "rounds to wait after a cut", at_least(0))
    # Results
    output_dir: str = key("results", "folder that holds one directory per run")
    run_name: str = key(
        "",
        "name of this run's directory inside output-dir (default: generated)",
        folder_name_rule(),
    )

    run_token: str = key(
        "",
        "set by `pollen run`: the token of the run directory it claimed, which the "
        "ServerApp echoes into summary.json (leave empty)",
    )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Scalar]) -> Settings:
        """Validate a Flower run config; unknown keys and bad values raise."""
        fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(run_config) - set(fields))
        if unknown:
            raise SettingsError(unknown_key_message(unknown[0], fields))
        values: dict[str, Scalar] = {}
        for name, f in fields.items():
            raw = run_config.get(name, f.default)
            if raw == AUTO and f.default == AUTO:
                values[name] = AUTO
                continue
            value = _coerce(name, raw, f.metadata["kind"], f.default == AUTO)
            rule: Rule | None = f.metadata["rule"]
            if rule is not None and not rule.check(value):
                raise SettingsError(
                    f"invalid value for {name!r}: {raw!r}; allowed: "
                    + ("auto or " if f.default == AUTO else "")
                    + rule.allowed
                )
            values[name] = value
        _resolve_preset(values)
        _check_combination(values)
        return cls(**{name.replace("-", "_"): v for name, v in values.items()})

    @property
    def sharing_policy(self) -> str:
        """The policy name `Sharing.of` takes: `sharing`, or `bn-policy` under all."""
        return self.bn_policy if self.sharing == "all" else self.sharing

    @property
    def keeps_own_model(self) -> bool:
        """Clients keep entries or a model of their own (`keeps_own_model`)."""
        return keeps_own_model(self.sharing_policy, self.ditto_lambda)

    @property
    def clients_keep_state(self) -> bool:
        """Clients carry state from round to round (entries or a model of
        their own, FedDyn's h_k, SCAFFOLD's c_k), which only a run that
        checkpoints saves for a resume."""
        return self.keeps_own_model or self.local_objective.startswith(
            ("feddyn", "scaffold")
        )

    @property
    def attacking_clients(self) -> frozenset[int]:
        """The clients that attack: `attacker-clients`, or round(attackers x
        num-clients) of them drawn by a generator seeded by `seed`."""
        if self.attack == "none":
            return frozenset()
        if self.attacker_clients:
            return frozenset(_parse_clients(self.attacker_clients) or ())
        count = round(self.attackers * self.num_clients)
        rng = random.Random(f"attackers-{self.seed}")
        return frozenset(rng.sample(range(self.num_clients), count))

    @property
    def sample_size(self) -> int:
        """The clients a synchronous round asks when every node is connected."""
        return sample_size(self.num_clients, self.client_frac, self.min_train_nodes)

    @property
    def client_betas(self) -> tuple[float, float]:
        """`betas` as numbers (validated when the settings were made)."""
        return _parse_betas(self.betas) or (0.9, 0.999)

    def to_run_config(self) -> dict[str, Scalar]:
        """The settings as run-config keys (what `settings.json` holds)."""
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
        }

    @classmethod
    def describe(cls) -> list[tuple[str, Scalar, str, str]]:
        """(key, default, help, allowed) for every key: the reference table."""
        return [
            (
                f.name.replace("_", "-"),
                f.default,
                f.metadata["help"],
                _allowed_text(f),
            )
            for f in dataclasses.fields(cls)
        ]


def _allowed_text(f: dataclasses.Field) -> str:
    rule: Rule | None = f.metadata["rule"]
    text = rule.allowed if rule else ""
    if f.default == AUTO and f.metadata["kind"] is not str:
        text = f"auto or {text}"
    return text


def unknown_key_message(name: str, known: Collection[str]) -> str:
    """One line for a key pollen does not know: the closest known keys when
    the name looks like a typo of one, else where the whole list is."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.75)
    hint = (
        "did you mean " + " or ".join(repr(k) for k in close) + "?"
        if close
        else "`pollen list keys` lists every key"
    )
    return f"unknown run-config key {name!r}; {hint}"


def keeps_own_model(sharing_policy: str, ditto_lambda: float) -> bool:
    """Whether clients keep entries of their own (a sharing policy other
    than shared) or a personal model (Ditto): then the global model alone is
    not what a client uses."""
    return sharing_policy != "shared" or ditto_lambda > 0


def sample_size(num_clients: int, fraction: float, minimum: int) -> int:
    """max(minimum, floor(fraction x num_clients)), at most num_clients."""
    return min(max(minimum, int(fraction * num_clients + 1e-9)), num_clients)


def _resolve_preset(values: dict[str, Scalar]) -> None:
    """Replace every "auto" with the value the strategy preset gives it, or
    for the client's hyper-parameters the data set's defaults for the client
    optimiser."""
    data_set = _data_set(values)
    preset = PRESETS[str(values["strategy"])]
    for name in ("server-update", "local-objective"):
        if values[name] == AUTO:
            values[name] = preset[name]
    training = {
        **data_set.training.values(str(values["client-optimizer"])),
        **_assumed_training(values),
    }
    for name in TRAINING_KEYS:
        if values[name] == AUTO:
            values[name] = training[name]
    if values["partition"] == AUTO:
        values["partition"] = data_set.partition
    if values["server-momentum"] == AUTO:
        values["server-momentum"] = float(preset.get("server-momentum", 0.0))
    if values["sharing"] == AUTO:
        values["sharing"] = preset.get("sharing", "all")
    if values["mode"] == AUTO:
        values["mode"] = preset.get("mode", "sync")
    if values["head-epochs"] == AUTO:
        values["head-epochs"] = int(preset.get("head-epochs", 0))
    if values["ditto-lambda"] == AUTO:
        values["ditto-lambda"] = float(preset.get("ditto-lambda", 0.0))
    if values["personal-eval-every"] == AUTO:
        policy = (
            values["bn-policy"] if values["sharing"] == "all" else values["sharing"]
        )
        own = keeps_own_model(str(policy), float(values["ditto-lambda"]))
        values["personal-eval-every"] = int(own)
    if values["server-lr"] == AUTO:
        values["server-lr"] = AUTO_SERVER_LR.get(str(values["server-update"]), 1.0)


def _data_set(values: Mapping[str, Scalar]) -> DataSetInfo:
    """The run's data set: a built-in's entry, or a user's, loaded."""
    try:
        return data_set_info(str(values["data-set"]))
    except ExtensionError as err:
        raise SettingsError(str(err)) from None


def _model(values: Mapping[str, Scalar]) -> ModelInfo:
    """The run's model: a built-in's entry, or a user's, built on the data."""
    try:
        return model_info(str(values["model"]), str(values["data-set"]))
    except ExtensionError as err:
        raise SettingsError(str(err)) from None


def _run_parts(values: Mapping[str, Scalar]) -> tuple[Part, ...]:
    """The parts a run combines (its server update, aggregator and local
    objective resolved)."""
    return (
        SERVER_UPDATES[str(values["server-update"])],
        AGGREGATORS[str(values["aggregator"])],
        LOCAL_OBJECTIVES[str(values["local-objective"])],
    )


def _assumed_training(values: Mapping[str, Scalar]) -> dict[str, Scalar]:
    try:
        return assumed_training(*_run_parts(values))
    except ValueError as err:
        raise SettingsError(str(err)) from None


def departures(run_config: Mapping[str, Scalar], settings: Settings) -> list[str]:
    """One line for each client hyper-parameter that `run_config` sets
    explicitly to another value than a part of the run assumes (SCAFFOLD's
    plain SGD): pollen runs what was asked, and says so once."""
    values = settings.to_run_config()
    lines = []
    for part in _run_parts(values):
        for key, assumed in part.training.items():
            given = run_config.get(key, AUTO)
            if given != AUTO and values[key] != assumed:
                lines.append(
                    f"{key}={values[key]:g} as asked, though {part.name} assumes "
                    f"{key}={assumed:g}: {part.training_reason}"
                )
    return lines


def first_difference(
    recorded: Mapping[str, Any], run_config: Mapping[str, Any], ignored: Collection[str]
) -> str | None:
    """The first key (in sorted order, outside `ignored`) whose value in
    `run_config` differs from the one a run recorded, or None: whether a saved
    run computed what `run_config` asks. A key the run did not record was
    added to pollen since, so the run had its default."""
    defaults = {key: default for key, default, _, _ in Settings.describe()}
    resolved = {**defaults, **recorded}
    with contextlib.suppress(KeyError):  # a record too old to name its strategy
        _resolve_preset(resolved)  # an "auto" key added since: its preset's value
    for key in sorted(run_config):
        then = recorded.get(key, resolved.get(key))  # a key added since: its default
        if key not in ignored and then != run_config[key]:
            return key
    return None


def _check_combination(values: dict[str, Scalar]) -> None:
    """Refuse combinations of valid values that cannot work together."""
    data_set, model = _data_set(values), _model(values)
    if problem := model.input_problem(data_set.channels, data_set.side):
        raise SettingsError(f"{problem}; data-set={values['data-set']!r}")
    if values["sharing"] in LORA_SHARING and not model.lora:
        raise SettingsError(
            f"sharing={values['sharing']!r} needs a model with LoRA layers; "
            f"model is {values['model']!r}; allowed: "
            + ", ".join(name for name, m in MODELS.items() if m.lora)
        )
    if values["sharing"] == "fedper" and model.lora:
        raise SettingsError(
            f"sharing='fedper' with model={values['model']!r}: its classifier is a "
            "LoRA head, whose sharing is lora-a (FedSA) or lora; allowed with "
            "fedper: " + ", ".join(name for name, m in MODELS.items() if not m.lora)
        )
    if values["head-epochs"] and values["sharing"] != "fedper":
        raise SettingsError(
            f"head-epochs={values['head-epochs']} with sharing="
            f"{values['sharing']!r}: FedRep trains the client's own classifier "
            "first, so the classifier must stay local; set sharing='fedper' (or "
            "strategy='fedrep')"
        )
    if values["ditto-lambda"] and (values["dp"] or values["sharing"] in LORA_SHARING):
        raise SettingsError(
            f"ditto-lambda with {'dp=true' if values['dp'] else 'a LoRA sharing'}: "
            "Ditto's personal model trains the whole model without DP-SGD on the "
            "client's data; allowed with ditto: dp=false and sharing all or fedper"
        )
    if values["head-epochs"] and values["dp"]:
        raise SettingsError(
            "head-epochs with dp=true: DP-SGD's budget is planned for one "
            "training pass per round; set head-epochs=0"
        )
    if values["sharing"] != "all" and values["bn-policy"] != "shared":
        raise SettingsError(
            f"bn-policy={values['bn-policy']!r} with sharing={values['sharing']!r}: "
            "a sharing other than all decides every entry itself (BatchNorm "
            "included); leave bn-policy at shared"
        )
    if (
        values["model"] == "vgg16-lora"
        and values["cache-features"]
        and values["augment"]
    ):
        raise SettingsError(
            "cache-features=true with augment=true: features are computed once, "
            "from un-augmented images; set augment=false or cache-features=false"
        )
    if data_set.generated != (values["partition"] == "natural"):
        raise SettingsError(
            f"partition={values['partition']!r} with data-set={values['data-set']!r}: "
            "a generated data set (synthetic) is split by its generator, each "
            "client its own task, and only it; allowed: partition='natural' (or "
            "'auto') with synthetic, any other with an image data set"
        )
    if data_set.generated and values["num-clients"] > data_set.train_examples:
        raise SettingsError(
            f"num-clients={values['num-clients']} with data-set="
            f"{values['data-set']!r}; allowed: 1 to {data_set.train_examples:,}"
        )
    if values["num-clients"] > data_set.train_examples:
        raise SettingsError(
            f"num-clients={values['num-clients']} with data-set="
            f"{values['data-set']!r}, whose training split has "
            f"{data_set.train_examples:,} examples: every client needs at least "
            f"one; allowed: 1 to {data_set.train_examples}"
        )
    try:
        check_min_size(values["partition"], values["num-clients"],
                       values["min-size"], data_set.train_examples)  # fmt: skip
    except PartitionError as err:
        raise SettingsError(f"{err} (data-set={values['data-set']!r})") from None
    if (
        values["partition"] == "pathological"
        and values["classes-per-client"] > data_set.classes
    ):
        raise SettingsError(
            f"classes-per-client={values['classes-per-client']} with data-set="
            f"{values['data-set']!r}, which has {data_set.classes} classes; "
            f"allowed: 1 to {data_set.classes}"
        )
    if values["dp"] and model.batchnorm:
        raise SettingsError(
            f"dp=true with model={values['model']!r}: its BatchNorm mixes the "
            "samples of a batch, so per-sample gradients (DP-SGD) are undefined; "
            "allowed with dp: "
            + ", ".join(n for n, m in MODELS.items() if not m.batchnorm)
        )
    if values["bn-policy"] != "shared" and not model.batchnorm:
        raise SettingsError(
            f"bn-policy={values['bn-policy']!r} with model={values['model']!r}, "
            "which has no BatchNorm layer to keep local (the run would be plain "
            "FedAvg); models with BatchNorm: "
            + ", ".join(name for name, m in MODELS.items() if m.batchnorm)
        )
    if model.batchnorm and values["batch-size"] == 1:
        raise SettingsError(
            f"batch-size=1 with model={values['model']!r}: BatchNorm cannot train "
            "on one sample, so no step would be taken; use batch-size=2 or more, "
            "or a model without BatchNorm (mlp, cnn-gn, simple-cnn)"
        )
    if values["dp"] and str(values["local-objective"]).endswith("sam"):
        raise SettingsError(
            f"dp=true with local-objective={values['local-objective']!r}: SAM's "
            "second pass has no per-sample clipping; allowed with dp: "
            + ", ".join(o for o in LOCAL_OBJECTIVES if not o.endswith("sam"))
        )
    if (
        values["local-objective"] in CONTROL_VARIATE_OBJECTIVES
        and values["client-optimizer"] != "sgd"
    ):
        raise SettingsError(
            f"local-objective={values['local-objective']!r} with client-optimizer="
            f"{values['client-optimizer']!r}: SCAFFOLD's c_k^+ = c_k - c + "
            "(x - y) / (lr K) reads the round's mean gradient off SGD steps; "
            "allowed: client-optimizer='sgd'"
        )
    _check_aggregator(values)
    _check_central_dp(values)
    _check_attack(values)
    _check_async(values)
    if values["network-profile"]:
        try:
            NetworkProfile.load(Path(str(values["network-profile"])))
        except ProfileError as err:
            raise SettingsError(f"network-profile: {err}") from None
    if values["tracking-uri"] and values["tracker"] != "mlflow":
        raise SettingsError(
            f"tracking-uri={values['tracking-uri']!r} with tracker="
            f"{values['tracker']!r}: only tracker='mlflow' logs to a tracking URI"
        )
    if values["dp"] and values["resume"]:
        raise SettingsError(
            "dp=true with resume is not supported: the noise is calibrated for "
            "the run as planned, and a node without its state files would count "
            "its privacy spending from zero; start a new run instead"
        )


def _check_aggregator(values: dict[str, Scalar]) -> None:
    """Refuse an aggregator other than the mean where its result would be
    misused or undefined for the round's sample."""
    aggregator = values["aggregator"]
    if values["krum-select"] and aggregator != "multi-krum":
        raise SettingsError(
            f"krum-select={values['krum-select']} with aggregator={aggregator!r}: "
            "only multi-krum averages several replies; set aggregator='multi-krum'"
        )
    if aggregator == "mean":
        return
    if values["local-objective"] in CONTROL_VARIATE_OBJECTIVES:
        raise SettingsError(
            f"aggregator={aggregator!r} with local-objective="
            f"{values['local-objective']!r}: SCAFFOLD's server control variate "
            "moves by every accepted client's Delta c_k while the model would "
            "follow another rule, so c would stop tracking the clients' "
            "corrections; allowed with scaffold: mean"
        )
    if values["server-update"] == "feddyn":
        raise SettingsError(
            f"aggregator={aggregator!r} with server-update='feddyn': FedDyn's "
            "server state h is corrected by the plain mean of the participants' "
            "models (Acar et al. 2021, eq. 4); another aggregate breaks that "
            "correction; allowed with feddyn: mean"
        )
    if values["mode"] == "async":
        raise SettingsError(
            f"aggregator={aggregator!r} with mode='async': FedBuff aggregates "
            "its buffer by the staleness-weighted mean; allowed with async: mean"
        )
    if aggregator == "fednova" and values["client-optimizer"] != "sgd":
        raise SettingsError(
            f"aggregator='fednova' with client-optimizer="
            f"{values['client-optimizer']!r}: FedNova's effective steps a_k are "
            "defined for SGD (with momentum); allowed: client-optimizer='sgd'"
        )
    f, select = int(values["byzantine-clients"]), int(values["krum-select"])
    n = sample_size(
        int(values["num-clients"]), float(values["client-frac"]),
        int(values["min-train-nodes"]),
    )  # fmt: skip
    needed = {"krum": 2 * f + 3, "multi-krum": 2 * f + 3, "bulyan": 4 * f + 3}.get(
        str(aggregator), 1
    )
    if n < needed:
        rule = {"bulyan": "n >= 4f + 3"}.get(str(aggregator), "n >= 2f + 3")
        raise SettingsError(
            f"aggregator={aggregator!r} with byzantine-clients={f} needs {rule} "
            f"replies per round ({needed}); a round samples {n} (client-frac x "
            "num-clients); sample more clients or lower byzantine-clients"
        )
    if aggregator == "trimmed-mean" and int(float(values["trim-fraction"]) * n) == 0:
        raise SettingsError(
            f"trim-fraction={values['trim-fraction']:g} of the {n} replies a round "
            f"samples trims none (floor({values['trim-fraction']:g} x {n}) = 0): the "
            f"rule would be the plain mean; allowed: at least {1 / n:g}"
        )
    if aggregator == "multi-krum" and select > n - f:
        raise SettingsError(
            f"krum-select={select} above n - f = {n - f} (a round samples {n}, "
            f"byzantine-clients={f}): multi-Krum would average Byzantine replies "
            "too; allowed: 1 to n - f, or 0 for n - f"
        )


def _check_central_dp(values: dict[str, Scalar]) -> None:
    """Refuse what would break user-level DP or cannot be accounted for."""
    mode = values["central-dp"]
    if mode == "off":
        return
    reasons = {
        "aggregator": (values["aggregator"] != "mean", "central DP is the "
                       "aggregation step itself (a clipped, noised sum); leave "
                       "aggregator at mean"),
        "mode": (values["mode"] == "async", "FedBuff's buffer changes the sum's "
                 "sensitivity; use mode='sync'"),
        "local-objective": (values["local-objective"] in CONTROL_VARIATE_OBJECTIVES,
                            "SCAFFOLD's Delta c_k would leave the clients without "
                            "noise; use another local objective"),
        "dp": (bool(values["dp"]), "choose example-level DP-SGD (dp=true) or "
               "user-level central DP, not both"),
        "update-norm-bound": (bool(values["update-norm-bound"]), "a bound relative "
                              "to the round's median norm lets one client change "
                              "the others' contributions; set update-norm-bound=0 "
                              "(central DP clips every update to C)"),
        "resume": (bool(values["resume"]), "the rounds after the checkpoint were "
                   "released once already, and a resumed accountant would not "
                   "count them; start a new run instead"),
        "model": (
            _model(values).batchnorm
            and values["sharing"] in ("all", "fedper")
            and values["bn-policy"] == "shared",
            "BatchNorm's running statistics would be released with noise (a "
            "negative variance breaks the model); set bn-policy='silobn' or "
            "'fedbn', or use a model without BatchNorm (mlp, cnn-gn, simple-cnn)",
        ),
    }  # fmt: skip
    for key, (refused, why) in reasons.items():
        if refused:
            raise SettingsError(
                f"central-dp={mode!r} with {key}={values[key]!r}: {why}"
            )
    z, count = (
        float(values["central-noise-multiplier"]),
        float(values["central-count-noise"]),
    )
    if values["central-epsilon"]:
        from .common.noise import noise_for_epsilon  # opacus: only here

        z = noise_for_epsilon(
            float(values["central-epsilon"]),
            int(values["rounds"]),
            float(values["dp-delta"]),
        )
    if mode == "adaptive":
        count = count or sample_size(
            int(values["num-clients"]), float(values["client-frac"]),
            int(values["min-train-nodes"]),
        ) / 20  # fmt: skip
        if 2 * count <= z:
            raise SettingsError(
                f"central-dp='adaptive': the count noise {count:g} must exceed "
                f"central-noise-multiplier / 2 = {z / 2:g} (Andrew et al. 2021, "
                "Theorem 1); raise central-count-noise or sample more clients"
            )


def _check_attack(values: dict[str, Scalar]) -> None:
    """An attack needs attackers, attackers need an attack, and the named
    clients must exist."""
    attack, share = values["attack"], values["attackers"]
    named = _parse_clients(str(values["attacker-clients"])) or ()
    if attack == "none":
        if share or named:
            raise SettingsError(
                "attackers or attacker-clients without an attack: set attack to "
                "one of " + ", ".join(ATTACKS[1:])
            )
        return
    if share and named:
        raise SettingsError(
            "attackers and attacker-clients are both set; name the clients or "
            "give a share, not both"
        )
    if not share and not named:
        raise SettingsError(
            f"attack={attack!r} without attackers: set attackers (a share of the "
            "clients) or attacker-clients ('i,j,...')"
        )
    clients = int(values["num-clients"])
    if any(c >= clients for c in named):
        raise SettingsError(
            f"attacker-clients={values['attacker-clients']!r}: clients are 0 to "
            f"{clients - 1} (num-clients={clients})"
        )
    if share and round(float(share) * clients) == 0:
        raise SettingsError(
            f"attackers={share:g} of num-clients={clients} rounds to no client; "
            f"allowed: at least {1 / clients:g}"
        )


def _check_async(values: dict[str, Scalar]) -> None:
    """Refuse what buffered asynchronous training cannot do."""
    if values["mode"] != "async":
        return
    if values["local-objective"] in CONTROL_VARIATE_OBJECTIVES:
        raise SettingsError(
            f"mode='async' with local-objective={values['local-objective']!r}: "
            "SCAFFOLD's control variates are defined for synchronous rounds of "
            "one model version; allowed with async: "
            + ", ".join(
                o for o in LOCAL_OBJECTIVES if o not in CONTROL_VARIATE_OBJECTIVES
            )
        )
    if values["server-update"] == "feddyn":
        raise SettingsError(
            "mode='async' with server-update='feddyn': FedDyn's server state h "
            "corrects a synchronous round's mean of one model version; allowed "
            "with async: " + ", ".join(u for u in SERVER_UPDATES if u != "feddyn")
        )
    if values["round-deadline"]:
        raise SettingsError(
            "round-deadline with mode='async': a deadline ends a synchronous "
            "round; async mode has no rounds to end (set round-deadline=0)"
        )
    concurrency, buffer = values["concurrency"], values["buffer-size"]
    if concurrency and buffer and buffer > concurrency:  # type: ignore[operator]
        raise SettingsError(
            f"buffer-size={buffer} above concurrency={concurrency}: the buffer "
            "would wait for more replies than clients train at once"
        )


KIND_NAMES = {
    int: "an integer",
    float: "a finite number",
    bool: "true or false",
    str: "a string",
}


def _coerce(name: str, raw: Scalar, kind: type, auto: bool = False) -> Scalar:
    """Give `raw` the type of the key's default, refusing lossy conversions."""
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    elif kind is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif kind is float:
        number = isinstance(raw, int | float) and not isinstance(raw, bool)
        if number and math.isfinite(raw):
            return float(raw)
    elif isinstance(raw, str):
        return raw
    raise SettingsError(
        f"invalid value for {name!r}: {raw!r}; allowed: "
        + ("auto or " if auto else "")
        + KIND_NAMES.get(kind, kind.__name__)
    )

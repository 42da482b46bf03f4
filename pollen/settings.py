"""Every run-config key pollen understands, declared once.

A key's type, default, help text and allowed values live in the field of
`Settings` that holds it (how a key is declared and checked on its own:
`pollen.keys`). `Settings.from_run_config` turns Flower's run config
(pyproject defaults fused with `--run-config` overrides) into a validated,
typed, frozen object: each value checked, every "auto" resolved
(`pollen.presets`), then the combination; anything invalid raises
`SettingsError` with one line naming the key, the value and what is
allowed, before any data is touched.

A part's own rules (an aggregator's fewest replies, the modes and other
parts it refuses) live with the part: `Settings` asks each part the run
combines through the catalogue's import paths (`problem(settings)`), and
each mode its rules module (FedBuff's, cohorts', SecAgg+'s, personal
training's), never by a static import, as it will ask a user's own
plug-in part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .catalog import (
    ASYNC_RULES,
    ATTACKS,
    BN_POLICIES,
    CENTRAL_DP,
    CENTRAL_DP_STEP,
    CHOOSING_KEYS,
    CLASS_ASSIGNMENTS,
    CLIENT_EXECUTIONS,
    CLIENT_OPTIMIZERS,
    COHORT_RULES,
    DATA_SETS,
    DEVICES,
    FEDDYN_H_SCALES,
    MODELS,
    MODES,
    NORM_ACTIONS,
    PARTITIONS,
    PERSONAL_RULES,
    PRESETS,
    PROTO_INFERENCE,
    SECAGG_RULES,
    SECURE_AGGREGATIONS,
    SHARING,
    TRACKERS,
    Scalar,
    load,
)
from .common.accountants import ACCOUNTANTS
from .common.attackers import attack_problem, attacking, parse_clients
from .common.partition_sizes import split_problem
from .extensions import (
    DATA_SET_GROUP,
    MODEL_GROUP,
    PART_KEYS,
    ExtensionError,
    data_set_info,
    model_info,
    part,
)
from .keys import (
    AUTO,
    Rule,
    SettingsError,
    above,
    allowed_text,
    at_least,
    betas_rule,
    checked_values,
    folder_name_rule,
    fraction,
    in_range,
    key,
    key_name,
    one_of,
    open_fraction,
    parse_betas,
    part_of,
    part_rule,
    tracking_uri_rule,
    unit_interval,
    webhook_rule,
)
from .network_profile import NetworkProfile, ProfileError
from .presets import (
    ADAPTING_KEYS,
    PERSONAL_MODEL_KEYS,
    adapts,
    keeps_own_model,
    personal_model,
    resolve_auto,
)

STRATEGIES = tuple(PRESETS)
# Keys that name one invocation of a run, not what it computes: a resume or a
# finished comparison cell never differs by them
INVOCATION_KEYS = frozenset({"run-token"})


@dataclass(frozen=True)
class Settings:
    """A validated run configuration. Attribute `data_set` is key `data-set`."""

    # Reproducibility and compute
    seed: int = key(
        845, "seed for partitions, client sampling and training", at_least(0)
    )
    device: str = key("auto", "auto picks CUDA, then MPS, then CPU", one_of(*DEVICES))
    client_execution: str = key(
        "sequential",
        "how a simulated node trains the clients it serves in a round: one "
        "after another, or as one vectorised cohort (docs/cohorts.md)",
        one_of(*CLIENT_EXECUTIONS),
    )
    cohort_memory_mib: float = key(
        1024.0,
        "cohort: MiB one vectorised chunk of a node's cohort may take; a larger "
        "cohort trains in consecutive chunks (0: no bound; on the CPU a chunk "
        "also keeps each tensor of a step under 32 MiB by its estimate, "
        "docs/cohorts.md)",
        at_least(0),
    )
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
        fraction(),
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
        part_of("server-update", AUTO),
    )  # fmt: skip
    aggregator: str = key(
        "mean",
        "how a round's replies become one aggregate, before the server update",
        part_of("aggregator"),
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
        AUTO,
        "what each client minimises",
        part_of("local-objective", AUTO),
    )
    bn_policy: str = key(
        "shared",
        "BatchNorm entries: shared, fedbn (all local), silobn (statistics local)",
        one_of(*BN_POLICIES),
    )
    sharing: str = key(
        AUTO,
        "what travels: all (per bn-policy), lora-a (A matrices only; auto: fedsa), "
        "lora (A and B), fedper (all but the classifier; auto: fedper), lg (the "
        "classifier only; auto: lg-fedavg), local (nothing of the model: local "
        "training alone, or FedProto's prototypes; auto: fedproto)",
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
    apfl_alpha: float = key(
        AUTO,
        "APFL: each client also keeps a personal model v mixed with the global "
        "one as alpha v + (1 - alpha) w, learns alpha from this start, and is "
        "evaluated on the mixture (auto: 0 = off, apfl: 0.5)",
        unit_interval(),
        float,
    )
    per_fedavg_beta: float = key(
        AUTO,
        "Per-FedAvg: each local step is w <- w - beta grad f(w - lr grad f(w; D); "
        "D') on two batches (first-order MAML), and a personal evaluation first "
        "takes one step of rate lr; beta stays fixed where the lr schedule lowers "
        "lr (auto: 0 = off, per-fedavg: 0.005)",
        at_least(0),
        float,
    )
    ala_layers: int = key(
        AUTO,
        "FedALA: each client starts its round from theta_i + (theta - theta_i) * W "
        "in its last N parameter tensors, W learned element-wise on its data, "
        "theta below (auto: 0 = off, fedala: 2, the classifier)",
        at_least(0),
        int,
    )
    ala_sample: float = key(
        0.8, "FedALA: share of a client's examples W is learned on", in_range(0, 1)
    )
    ala_eta: float = key(1.0, "FedALA: learning rate of W", above(0))
    personal_head: bool = key(
        AUTO,
        "FedRoD: each client keeps a second classifier of its own, trained on "
        "the shared classifier's logits plus its own, while the shared model "
        "trains on the balanced softmax of the client's label counts; a client "
        "tests both heads summed (auto: false, fedrod: true)",
        kind=bool,
    )
    freeze_head: bool = key(
        AUTO,
        "FedBABU: the classifier (the last nn.Linear) is never trained and "
        "keeps the common initialisation; only the body trains and travels; "
        "needs sharing fedper (auto: false, fedbabu: true)",
        kind=bool,
    )
    fine_tune_epochs: int = key(
        AUTO,
        "personal evaluation first fine-tunes the client's whole model for N "
        "epochs on its training shard at the round's lr, and tests that (not "
        "kept; FedBABU's personalisation, or FedAvg-FT with fedavg) (auto: 0 = "
        "off, fedbabu: 5)",
        at_least(0),
        int,
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
    moon_mu: float = key(
        1.0,
        "MOON weight mu of the model-contrastive loss (local-objective moon; "
        "the paper: 5 on CIFAR-10, 1 on CIFAR-100)",
        at_least(0),
    )
    moon_tau: float = key(
        0.5, "MOON temperature tau of the model-contrastive loss", above(0)
    )
    proto_lambda: float = key(
        1.0,
        "FedProto weight lambda of the distance of each representation to its "
        "class's global prototype (local-objective fedproto; the paper: 1 on "
        "MNIST and FEMNIST, 0.1 on CIFAR-10)",
        at_least(0),
    )
    proto_inference: str = key(
        AUTO,
        "FedProto: what a personal evaluation predicts by: the client's model "
        "(classifier), or the global prototype nearest each example's "
        "representation (prototypes: the paper's inference, PFLlib's test; "
        "auto: prototypes with local-objective fedproto and no personal model, "
        "adaptation or personal-eval-every=0, else classifier)",
        one_of(AUTO, *PROTO_INFERENCE),
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
        fraction(),
        float,
    )
    beta1: float = key(
        0.9,
        "adaptive server first-moment decay",
        fraction(),
    )
    beta2: float = key(0.99, "adam/yogi second-moment decay", fraction())
    tau: float = key(1e-3, "adaptive server adaptivity (denominator offset)", above(0))
    bias_correction: bool = key(
        False, "adaptive server: divide moments by 1 - beta^t (the notebook's Adam)"
    )
    personal_eval_every: int = key(
        AUTO,
        "evaluate each client's own model (its local entries or Ditto's personal "
        "model; the global model where it keeps none) on its own test shard every "
        "N rounds (0: never; auto: 1 where clients keep entries or a personal "
        "model, fine-tune or predict by FedProto's prototypes, else 0)",
        at_least(0),
        int,
    )
    personal_global_test: bool = key(
        True,
        "a personal evaluation also tests each client's own model on the whole "
        "global test set (one pass over it per client: with many clients the "
        "larger part of the evaluation); false: its own test shard only",
    )
    # LoRA heads and the frozen VGG16 backbone (models cnn-lora, vgg16-lora)
    lora_rank: int = key(
        8,
        "LoRA rank r (FedSA-FTL's setting: 8 for CIFAR-10, 16 for CIFAR-100)",
        at_least(1),
    )
    lora_alpha: float = key(
        8.0, "LoRA scale alpha; the update is alpha/r * B A", above(0)
    )
    lora_dropout: float = key(0.1, "dropout on the LoRA path", fraction())
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
    dp_delta: float = key(1e-5, "privacy parameter delta", open_fraction())
    dp_max_grad_norm: float = key(1.0, "per-sample gradient clipping bound C", above(0))
    accountant: str = key(
        "rdp",
        "privacy accountant of DP-SGD and central DP: it calibrates the noise and "
        "counts the budget (rdp: Renyi DP; prv, pld: near-exact, less noise for "
        "the same epsilon); the summary gives every accountant's epsilon",
        one_of(*ACCOUNTANTS),
    )
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
        open_fraction(),
    )
    central_clip_lr: float = key(0.2, "adaptive clipping: step of log C", above(0))
    central_count_noise: float = key(
        0.0,
        "adaptive clipping: std of the noise on the unclipped count (0: clients "
        "per round / 20)",
        at_least(0),
    )
    # Secure aggregation (SecAgg+): the server learns only each round's sum
    secure_aggregation: str = key(
        "off",
        "secagg+: clients mask their quantised updates so the server unmasks only "
        "the round's sum (docs/secure-aggregation.md)",
        one_of(*SECURE_AGGREGATIONS),
    )
    secagg_threshold: float = key(
        0.6,
        "secagg+: share of a client's holders (itself and its neighbours) that "
        "must survive to unmask it; above half",
        in_range(0.5, 1),
    )
    secagg_neighbours: float = key(
        1.0,
        "secagg+: share of the round's other clients each client masks with and "
        "shares its secrets with (1: all, as the original SecAgg)",
        in_range(0, 1),
    )
    secagg_ahead: bool = key(
        True,
        "secagg+: set up the next round's keys and shares in this round's training "
        "and unmask exchanges when every client it samples trains in this one (two "
        "exchanges a round instead of four)",
    )
    secagg_clip: float = key(
        8.0,
        "secagg+: each entry of a weighted update (the change from the global "
        "model times n_k / the round's largest shard) is clipped to +-this",
        above(0),
    )
    secagg_bits: int = key(
        24,
        "secagg+: quantisation steps 2^bits over [-clip, clip]; a round's sum "
        "must fit 32 bits, so bits + log2(clients per round) <= 32",
        Rule(lambda v: 8 <= v <= 30, "in [8, 30]"),
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
        fraction(),
    )
    attacker_clients: str = key(
        "",
        "the clients that attack, as 'i,j,...' (instead of attackers)",
        Rule(lambda v: parse_clients(v) is not None, "'i,j,...' of integers >= 0"),
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
        "seconds to wait for min-available-nodes (and for a first node at start), "
        "and for each node's answer to pollen's query (at least 30)",
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
    partition_draws: int = key(
        30,
        "draws of partition=niid before a min-size none meets is refused: the "
        "first from seed, each later one from a seed derived from it",
        at_least(1),
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
        "num-clients is a multiple of the classes, or classes-per-client is all of them), 'random' "
        "(all drawn by seed; a class may go unused)",
        one_of(*CLASS_ASSIGNMENTS),
    )
    print_labels: bool = key(False, "print each client's label counts")
    # ReduceLROnPlateau on the server's test loss
    lr_factor: float = key(0.5, "lr multiplier on a plateau", open_fraction())
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
        values = checked_values(dataclasses.fields(cls), run_config)
        try:
            values = resolve_auto(values)
        except ValueError as err:  # a user's part or the parts' assumptions
            raise SettingsError(str(err)) from None
        settings = cls(**{name.replace("-", "_"): v for name, v in values.items()})
        _check_combination(settings)
        return settings

    @property
    def sharing_policy(self) -> str:
        """The policy name `Sharing.of` takes: `sharing`, or `bn-policy` under all."""
        return self.bn_policy if self.sharing == "all" else self.sharing

    @property
    def shares_model(self) -> bool:
        """Some entry of the model travels (every sharing but `local`, under
        which the server's model never changes)."""
        return self.sharing != "local"

    @property
    def keeps_own_model(self) -> bool:
        """Clients keep entries or a model of their own (`keeps_own_model`)."""
        return keeps_own_model(self.sharing_policy, self.personal_model)

    @property
    def personal_model(self) -> bool:
        """Clients keep a whole personal model (Ditto's v_k, APFL's v_i,
        FedALA's theta_i, FedRoD's second head): `presets.personal_model`."""
        return personal_model(self._values(PERSONAL_MODEL_KEYS))

    @property
    def adapts(self) -> bool:
        """A client's model trains before its personal test (fine-tuning,
        Per-FedAvg's step): `presets.adapts`."""
        return adapts(self._values(ADAPTING_KEYS))

    def _values(self, names: tuple[str, ...]) -> dict[str, Scalar]:
        """The values of the keys `names` (run-config spelling)."""
        return {name: getattr(self, name.replace("-", "_")) for name in names}

    @property
    def clients_keep_state(self) -> bool:
        """Clients carry state from round to round (entries or a model of
        their own, FedDyn's h_k, SCAFFOLD's c_k), which only a run that
        checkpoints saves for a resume."""
        objective = part("local-objective", self.local_objective).load()
        return self.keeps_own_model or objective.keeps_state

    @property
    def attacking_clients(self) -> frozenset[int]:
        """The clients that attack: `attacker-clients`, or round(attackers x
        num-clients) of them drawn by a generator seeded by `seed`."""
        return attacking(self.attack, self.attackers, self.attacker_clients,
                         self.num_clients, self.seed)  # fmt: skip

    @property
    def sample_size(self) -> int:
        """The clients a synchronous round asks when every node is connected."""
        return sample_size(self.num_clients, self.client_frac, self.min_train_nodes)

    @property
    def client_betas(self) -> tuple[float, float]:
        """`betas` as numbers (validated when the settings were made)."""
        return parse_betas(self.betas) or (0.9, 0.999)

    def to_run_config(self) -> dict[str, Scalar]:
        """The settings as run-config keys (what `settings.json` holds)."""
        return {key_name(f): getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def describe(cls) -> list[tuple[str, Scalar, str, str]]:
        """(key, default, help, allowed) for every key: the reference table."""
        return [
            (key_name(f), f.default, f.metadata["help"], allowed_text(f))
            for f in dataclasses.fields(cls)
        ]


def sample_size(num_clients: int, fraction: float, minimum: int) -> int:
    """max(minimum, floor(fraction x num_clients)), at most num_clients."""
    return min(max(minimum, int(fraction * num_clients + 1e-9)), num_clients)


def _check_combination(s: Settings) -> None:
    """Refuse combinations of valid values that cannot work together: the
    first problem `_problems` finds, as one line."""
    try:
        problem = next((p for p in _problems(s) if p), None)
    except ExtensionError as err:  # a user's part that cannot be imported
        raise SettingsError(str(err)) from None
    if problem:
        raise SettingsError(problem)


def _problems(s: Settings) -> Iterator[str | None]:
    """What each rule says of `s`, in order, lazily: the model's rules, what
    clients keep of their own, the data's split, the run's parts (asked of
    each), central DP, the attack, asynchronous training, cohorts, secure
    aggregation, the network profile, tracking and resuming."""
    data_set, model = data_set_info(s.data_set), model_info(s.model, s.data_set)
    if problem := model.input_problem(data_set.channels, data_set.side):
        yield f"{problem}; data-set={s.data_set!r}"
    yield model.sharing_problem(s.sharing)
    yield load(PERSONAL_RULES)(s)
    yield model.cache_problem(s.cache_features, s.augment)
    yield split_problem(data_set, s.partition, s.num_clients, s.min_size,
                        s.classes_per_client)  # fmt: skip
    yield model.batchnorm_problem(s.dp, s.bn_policy, s.batch_size)
    yield from _part_problems(s)
    if s.central_dp != "off":
        yield load(CENTRAL_DP_STEP).problem(s)
    yield attack_problem(s.attack, s.attackers, s.attacker_clients, s.num_clients)
    if s.mode == "async":
        yield load(ASYNC_RULES)(s)
    if s.client_execution == "cohort":
        yield load(COHORT_RULES)(s)
    if s.secure_aggregation != "off":
        yield load(SECAGG_RULES)(s)
    yield _profile_problem(s.network_profile)
    if s.tracking_uri and s.tracker != "mlflow":
        yield (
            f"tracking-uri={s.tracking_uri!r} with tracker={s.tracker!r}: only "
            "tracker='mlflow' logs to a tracking URI"
        )
    if s.dp and s.resume:
        yield (
            "dp=true with resume is not supported: the noise is calibrated for "
            "the run as planned, and a node without its state files would count "
            "its privacy spending from zero; start a new run instead"
        )


def _part_problems(s: Settings) -> Iterator[str | None]:
    """Ask the run's parts what they refuse: its local objective, the
    aggregators its objective and server update allow, then the aggregator
    itself, each loaded from the catalogue."""
    objective = part("local-objective", s.local_objective).load()
    if s.local_objective not in PART_KEYS["local-objective"][0]:  # a user's
        yield _term_problem(s.local_objective, objective.term)
        yield _term_problem(s.local_objective, getattr(objective, "batch_term", ""))
    yield objective.problem(s)
    if s.krum_select and s.aggregator != "multi-krum":
        yield (
            f"krum-select={s.krum_select} with aggregator={s.aggregator!r}: only "
            "multi-krum averages several replies; set aggregator='multi-krum'"
        )
    for chooser in CHOOSING_KEYS:
        name = getattr(s, chooser.replace("-", "_"))
        if (why := part(chooser, name).load().mean_only) and s.aggregator != "mean":
            yield f"aggregator={s.aggregator!r} with {chooser}={name!r}: {why}"
    yield part("server-update", s.server_update).load().problem(s)
    yield part("aggregator", s.aggregator).load().problem(s)


def _term_problem(name: str, term: str | None) -> str | None:
    """Why a user's local objective's term (its regulariser or batch term,
    "module:Class") cannot be imported, or None: found here, not in every client after
    start-up (pollen's own terms import torch, which validation spares)."""
    if not term:
        return None
    try:
        load(term)
    except Exception as err:  # a user's module runs on import: anything ends here
        return (
            f"local-objective={name!r}: its term {term!r} cannot be imported "
            f"({type(err).__name__}: {err})"
        )
    return None


def _profile_problem(path: str) -> str | None:
    """Why the network profile at `path` cannot be read, or None (no profile
    or a valid one)."""
    if not path:
        return None
    try:
        NetworkProfile.load(Path(path))
    except ProfileError as err:
        return f"network-profile: {err}"
    return None

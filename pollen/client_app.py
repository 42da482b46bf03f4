"""ClientApp: assemble this client's model, train or evaluate it, reply.

A node serves one client (its `partition-id`) or, in a simulation with fewer
nodes than clients, several; the server names the client in each message.
Training asks the client's local objective (`pollen.task.objectives`) and,
under DP-SGD, its privacy ledger (`pollen.task.privacy`) to load their state,
trains, and asks them to save it; the keys of messages and state are
`pollen.protocol`'s. What a client keeps between rounds lives in
`context.state`, per client: the model entries its sharing policy keeps
local (FedBN's BatchNorm, FedSA's LoRA B matrices), its objective's state
(FedDyn's h_k) and, under DP-SGD, the steps its privacy accountant has
counted. When the run checkpoints, that state is
also written to the client's disk after each round it trains and read back
by a resumed run (`pollen.task.client_state`). Only shared entries are accepted
from the server and only shared entries are sent back.

Where a node's examples come from is its own business (node config, both
optional): `data-root` replaces the run's `data-root` (a path on the server's
machine) as the folder this node loads the run's data set from, and
`data-file` names a .npz of the node's own examples, which it trains on whole
as client `partition-id` instead of a shard of the data set
(`pollen.task.data.read_node_file`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from .catalog import MODEL_POISONING
from .common.clipping import clipped_reply
from .common.steps import effective_steps
from .deployment.warm_hint import hint_mod
from .extensions import data_set_info
from .protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    CLIP_NORM,
    CONFIG,
    EFFECTIVE_STEPS,
    EVAL_SECONDS,
    LOCAL_STEPS,
    LR,
    METRICS,
    NODE_RECORD,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    OWN_DATA,
    PERSONAL_METRICS,
    SERVER_ROUND,
    SHARD_FINGERPRINT,
    SLOWDOWN,
    TRAIN_LOSS,
    TRAIN_SECONDS,
    UPDATE_NORM,
    ditto_state_key,
    local_entries_key,
)
from .settings import Settings
from .task import client_state
from .task.attacks import flipped_labels, poisoned
from .task.data import Dataset
from .task.inputs import model_inputs, settings_model
from .task.node_data import NodeData, OwnData
from .task.objectives import LocalObjective, ProxTerm, frozen_bn_statistics
from .task.privacy import (
    PrivacyLedger,
    PrivacyPlan,
    check_private_model,
    train_private,
)
from .task.sharing import Sharing
from .task.train import (
    ClientOptimizer,
    Preprocess,
    TrainResult,
    Transform,
    client_seed,
    evaluate,
    pick_device,
    train_local,
    training_only,
)

# Under pollen's warm executor, each message leaves the parent a hint of what
# to preload for the next (`warm_up`); elsewhere the mod does nothing.
app = ClientApp(mods=[hint_mod(Path(__file__).resolve().parent.parent)])

DATA_ROOT = "data-root"  # node config: where this node finds the run's data set
DATA_FILE = "data-file"  # node config: a .npz of this node's own examples


@cache
def _settings(items: frozenset) -> Settings:
    return Settings.from_run_config(dict(items))


def node_settings(context: Context) -> Settings:
    """The run's settings as this node uses them: with its own `data-root`
    where its node config names one."""
    settings = _settings(frozenset(context.run_config.items()))
    root = _node_path(context, DATA_ROOT)
    return settings if root is None else replace(settings, data_root=root)


def node_data(context: Context) -> NodeData:
    """Where this node's examples come from: shards of the run's data set or,
    with node config `data-file`, its own file (client `partition-id`'s)."""
    settings = node_settings(context)
    path = _node_path(context, DATA_FILE)
    if path is None:
        return NodeData(settings)
    client, _ = node_partition(context)
    return NodeData(settings, OwnData.of(settings.data_set, path, client))


def node_partition(context: Context) -> tuple[int, int]:
    """This node's `partition-id` and `num-partitions` (its node config; set
    by the simulation, by `pollen deploy`, or by hand on a SuperNode)."""
    values = []
    for key in (CLIENT, NUM_PARTITIONS):
        value = context.node_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"node config {key}={value!r}: expected an integer; start the "
                "SuperNode with --node-config 'partition-id=K num-partitions=N'"
            )
        values.append(value)
    client, count = values
    if not 0 <= client < count:
        raise ValueError(
            f"node config partition-id={client}: expected 0 <= partition-id < "
            f"num-partitions ({count})"
        )
    return client, count


def _node_path(context: Context, key: str) -> str | None:
    """Node-config `key` as a path; None where it is absent or empty."""
    value = context.node_config.get(key, "")
    if not isinstance(value, str):
        raise ValueError(
            f"node config {key}={value!r}: expected a path in quotes "
            f'({key}="/path/to/it")'
        )
    return value or None


def warm_up(run_config: dict, node_config: dict) -> None:
    """Load what this node's tasks of a run read first: the data set, the
    node's training shard on the CPU (the device of a warm executor's parent,
    which must never touch CUDA; a GPU run copies the shard over), and the
    model and optimiser once, for the modules they import on first use
    (torch's optimisers import its compiler stack: 2 s). Nothing here runs a
    backward pass: autograd's threads must not exist in a process that forks."""
    context = Context(
        run_id=0, node_id=0, node_config=node_config, state=RecordDict(),
        run_config=run_config,
    )  # fmt: skip
    client, _ = node_partition(context)
    data = node_data(context)
    data.num_examples(client)
    data.shard_fingerprint(client)
    data.train_shard(client, torch.device("cpu"))
    model = settings_model(data.settings, data.dataset())
    ClientOptimizer(data.settings.client_optimizer).build(list(model.parameters()))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (its node config),
    how many examples it trains that client on and whether they are its own
    (node config `data-file`) rather than a shard of the run's data set.

    A resumed run's query also names the checkpoint it resumes from: client
    state that earlier runs wrote after it is deleted here, before any round.
    """
    config = msg.content.get(CONFIG)
    if isinstance(config, ConfigRecord):
        store = client_state.store_for(context, config)
        if store is not None:
            store.forget_abandoned(
                context.run_id, int(config.get(client_state.RESUME_ROUND, 0))
            )
    client, num_partitions = node_partition(context)
    data = node_data(context)
    record = ConfigRecord(
        {
            CLIENT: client,
            NUM_PARTITIONS: num_partitions,
            NUM_EXAMPLES: data.num_examples(client),
            OWN_DATA: data.own is not None,
            SHARD_FINGERPRINT: data.shard_fingerprint(client),
        }
    )
    return Message(RecordDict({NODE_RECORD: record}), reply_to=msg)


@dataclass
class ClientModel:
    """One client's model for this message: shared entries from the server,
    local ones from `context.state` (or the common initialisation)."""

    data: NodeData
    client: int
    server_round: int
    dataset: Dataset
    model: torch.nn.Module
    sharing: Sharing
    device: torch.device

    @classmethod
    def assemble(cls, msg: Message, context: Context) -> ClientModel:
        data = node_data(context)
        settings = data.settings
        config = msg.content[CONFIG]
        client = int(config[CLIENT])
        data.check_client(client)
        client_state.restore(context, client, config)
        dataset = data.dataset()
        # Same seed as the server's model: local entries start where its do.
        model = settings_model(settings, dataset)
        sharing = Sharing.of(settings.sharing_policy, model)
        arrays: ArrayRecord = msg.content[ARRAYS]
        if set(arrays) != set(sharing.shared):
            raise ValueError(
                f"server sent {len(arrays)} entries; sharing policy "
                f"{settings.sharing_policy} shares {len(sharing.shared)} "
                f"(same settings on both sides?)"
            )
        state = model.state_dict()
        state.update(arrays.to_torch_state_dict())
        local = context.state.get(local_entries_key(client))
        if isinstance(local, ArrayRecord):
            state.update(local.to_torch_state_dict())
        model.load_state_dict(state)
        device = pick_device(settings.device)
        return cls(
            data, client, int(config[SERVER_ROUND]), dataset, model.to(device),
            sharing, device,
        )  # fmt: skip

    @property
    def settings(self) -> Settings:
        return self.data.settings

    def preprocess(self, augment: bool) -> Preprocess:
        return Preprocess(
            self.dataset.mean,
            self.dataset.std,
            normalize=self.settings.normalize,
            augment=augment and self.dataset.augmentable,
            device=self.device,
        )

    def inputs(
        self, split: Hashable, x: torch.Tensor, augment: bool
    ) -> tuple[torch.Tensor, Transform]:
        """What the model sees of `x` (see `pollen.task.model_inputs`)."""
        return model_inputs(
            self.settings, split, self.model, x, self.preprocess(augment)
        )

    def loss_and_accuracy(
        self, split: Hashable, examples: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[float, float]:
        """The model's test loss and accuracy on `examples`; NaN for none."""
        if examples is None or not len(examples[1]):
            return float("nan"), float("nan")
        images, y = examples
        x, prep = self.inputs(split, images, augment=False)
        return evaluate(
            self.model, x, y, batch_size=self.settings.test_batch_size, preprocess=prep
        )

    def entries(self, names: tuple[str, ...]) -> ArrayRecord:
        state = self.model.state_dict()
        return ArrayRecord({name: state[name].detach().cpu() for name in names})

    def reply(
        self,
        msg: Message,
        metrics: MetricRecord,
        arrays: ArrayRecord | None = None,
        records: dict[str, ArrayRecord] | None = None,
    ) -> Message:
        records = {**(records or {}), **({} if arrays is None else {ARRAYS: arrays})}
        content = RecordDict(
            {
                **records,
                METRICS: metrics,
                CLIENT_RECORD: ConfigRecord({CLIENT: self.client}),
            }
        )
        return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The local objective on this client's shard, from the global model."""
    cm = ClientModel.assemble(msg, context)
    s = cm.settings
    config = msg.content[CONFIG]
    images, y = cm.data.train_shard(cm.client, cm.device)
    attacking = cm.client in s.attacking_clients
    if attacking and s.attack == "label-flip":
        y = flipped_labels(y, data_set_info(s.data_set).classes)
    x, prep = cm.inputs(cm.data.split_key("train", cm.client), images, s.augment)
    objective = LocalObjective.from_settings(s)
    objective.load(context, cm.client, cm.model, cm.sharing, msg.content)
    optimizer = ClientOptimizer(
        s.client_optimizer, float(config[LR]), s.momentum, s.weight_decay,
        s.client_betas,
    )  # fmt: skip
    run = LocalRun(
        cm, x, y, optimizer, prep, client_seed(s.seed, cm.server_round, cm.client)
    )
    received = (  # Ditto's anchor and its personal model's first start
        {k: v.detach().clone() for k, v in cm.model.state_dict().items()}
        if s.ditto_lambda
        else {}
    )
    _load_optimizer_modules(s.client_optimizer)
    started = time.perf_counter()
    if s.dp:
        result, metrics = run.private(context, objective)
    else:
        if s.head_epochs:
            run.head(objective)
        # FedRep: then the shared body alone, the classifier frozen
        body = training_only(cm.model, cm.sharing.shared)
        with body if s.head_epochs else nullcontext():
            result = run.epochs(cm.model, s.local_epochs, objective)
        metrics = {TRAIN_LOSS: result.loss}
    if s.ditto_lambda:
        run.personal(context, received)
    seconds = time.perf_counter() - started
    straggle(seconds, node_slowdown(context))
    objective.save(context, cm.client, cm.model)
    if cm.sharing.local:
        context.state[local_entries_key(cm.client)] = cm.entries(cm.sharing.local)
    client_state.persist(context, cm.client, cm.server_round, config)
    client_state.spill(context, config, _state_limit(s), cm.client)
    metrics = MetricRecord(
        {
            NUM_EXAMPLES: result.num_examples,
            TRAIN_SECONDS: seconds,
            **step_metrics(s, result.steps, float(config[LR]), objective),
            **metrics,
        }
    )
    shared = cm.entries(cm.sharing.shared)
    if CLIP_NORM in config:  # central DP, clipped here first
        shared, norm = clipped_reply(
            msg.content[ARRAYS], shared, float(config[CLIP_NORM])
        )
        metrics[UPDATE_NORM] = norm
    if attacking and s.attack in MODEL_POISONING:
        shared = poisoned(
            s.attack, msg.content[ARRAYS], shared, s.attack_scale, run.seed
        )
    return cm.reply(msg, metrics, shared, objective.reply_records())


@dataclass
class LocalRun:
    """One round's local training on one client: its model, examples (after
    any label flip), optimiser, preprocessing and seed, and the passes that
    train on them. Each pass draws from its own seeds (`seed`, `seed + 3`,
    `seed + 6`: `train_local` uses three from its seed)."""

    cm: ClientModel
    x: torch.Tensor
    y: torch.Tensor
    optimizer: ClientOptimizer
    prep: Transform
    seed: int

    def epochs(
        self,
        model: torch.nn.Module,
        epochs: int,
        objective: LocalObjective,
        seed_offset: int = 0,
    ) -> TrainResult:
        """`epochs` of SGD steps on `model` for `objective`."""
        s = self.cm.settings
        return train_local(
            model, self.x, self.y,
            epochs=epochs, batch_size=s.batch_size, optimizer=self.optimizer,
            preprocess=self.prep, seed=self.seed + seed_offset,
            max_grad_norm=s.max_grad_norm, objective=objective,
        )  # fmt: skip

    def head(self, objective: LocalObjective) -> None:
        """FedRep's first phase (Collins et al. 2021, Algorithm 1): `head-epochs`
        epochs of the client's own classifier with the shared body frozen (its
        BatchNorm statistics too); the body's epochs follow with the classifier
        frozen. The objective's regulariser anchors shared entries only, so this
        phase keeps SAM but no regulariser."""
        model = self.cm.model
        with training_only(model, self.cm.sharing.local), frozen_bn_statistics(model):
            self.epochs(
                model,
                self.cm.settings.head_epochs,
                LocalObjective(objective.sam_rho),
                3,
            )

    def personal(self, context: Context, received: dict[str, torch.Tensor]) -> None:
        """Ditto's personal step (Li et al. 2021, Algorithm 1): the client's own
        model v_k (the received model before its first round) trains
        `local-epochs` on F_k(v) + lambda/2 ||v - w^t||^2, w^t the received
        global model, and stays in `context.state`; it never travels."""
        cm = self.cm
        personal = settings_model(cm.settings, cm.dataset)
        stored = context.state.get(ditto_state_key(cm.client))
        start = (
            stored.to_torch_state_dict()
            if isinstance(stored, ArrayRecord)
            else received
        )
        personal.load_state_dict(start)
        personal.to(cm.device)
        pull = ProxTerm(cm.settings.ditto_lambda)
        pull.anchor = {
            name: received[name].to(cm.device)
            for name, p in personal.named_parameters()
            if p.requires_grad
        }
        self.epochs(
            personal, cm.settings.local_epochs, LocalObjective(regularizer=pull), 6
        )
        state = {k: v.detach().cpu() for k, v in personal.state_dict().items()}
        context.state[ditto_state_key(cm.client)] = ArrayRecord(state)

    def private(
        self, context: Context, objective: LocalObjective
    ) -> tuple[TrainResult, dict[str, float]]:
        """DP-SGD for one round; the privacy spent over every round so far. The
        loss on the private batches is not covered by epsilon, so it does not
        leave the client."""
        cm = self.cm
        check_private_model(cm.model, cm.settings.model)
        plan = PrivacyPlan.from_settings(cm.settings, len(self.y))
        ledger = PrivacyLedger.load(context, cm.client, plan)
        result = train_private(
            cm.model, self.x, self.y, plan=plan, optimizer=self.optimizer,
            preprocess=self.prep, seed=self.seed, objective=objective,
        )  # fmt: skip
        ledger.spend(result.steps)
        ledger.save(context, cm.client)
        return result, ledger.metrics()


def step_metrics(
    settings: Settings, steps: int, lr: float, objective: LocalObjective
) -> dict[str, float]:
    """The round's local steps and, for SGD, FedNova's effective number a_k
    under its momentum and the objective's pull (`strategies.fednova`)."""
    metrics = {LOCAL_STEPS: float(steps)}
    if settings.client_optimizer == "sgd":
        metrics[EFFECTIVE_STEPS] = effective_steps(
            steps, lr, settings.momentum, objective.pull
        )
    return metrics


@cache
def _load_optimizer_modules(name: str) -> None:
    """Build one optimiser of this kind on a throwaway tensor, once per
    process: torch imports its compiler stack on the first optimiser (2 s),
    which is not training time and must not count in `train-seconds`."""
    ClientOptimizer(name).build([torch.zeros(1, requires_grad=True)])


def node_slowdown(context: Context) -> float:
    """This node's compute slowdown (node config `slowdown`, set by `pollen
    compare --network` from the profile; 1 where absent)."""
    value = context.node_config.get(SLOWDOWN, 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        raise ValueError(
            f"node config {SLOWDOWN}={value!r}: expected a number >= 1 (1: this "
            "machine's speed)"
        )
    return float(value)


def straggle(seconds: float, slowdown: float) -> None:
    """Make local work of `seconds` take `slowdown` times as long: a
    straggler is emulated by sleeping (slowdown - 1) x its own measured
    compute time after training, so the model it returns is the one it
    would have returned, only later."""
    if slowdown > 1:
        time.sleep((slowdown - 1) * seconds)


@app.evaluate()
def evaluate_personal(msg: Message, context: Context) -> Message:
    """This client's model (shared + local entries, or under Ditto its
    personal model) on the global test set and on its own test shard; NaN for
    either where the node has none (a node with its own data file and no copy
    of the data set has no global one), and for the global test where the
    client keeps nothing of its own (the model is the global one, which the
    server evaluates on that set already)."""
    cm = ClientModel.assemble(msg, context)
    personal = context.state.get(ditto_state_key(cm.client))
    if cm.settings.ditto_lambda and isinstance(personal, ArrayRecord):
        cm.model.load_state_dict(personal.to_torch_state_dict())
    keeps_own = bool(cm.sharing.local) or cm.settings.ditto_lambda > 0
    started = time.perf_counter()
    global_test = cm.data.global_test(cm.device) if keeps_own else None
    g_loss, g_acc = cm.loss_and_accuracy("test", global_test)
    own = cm.data.test_shard(cm.client, cm.device)
    l_loss, l_acc = cm.loss_and_accuracy(cm.data.split_key("test", cm.client), own)
    seconds = time.perf_counter() - started
    straggle(seconds, node_slowdown(context))
    personal = dict(zip(PERSONAL_METRICS, (g_acc, g_loss, l_acc, l_loss), strict=True))
    metrics = MetricRecord(
        {**personal, NUM_EXAMPLES: len(own[1]), EVAL_SECONDS: seconds}
    )
    client_state.spill(
        context, msg.content[CONFIG], _state_limit(cm.settings), cm.client
    )
    return cm.reply(msg, metrics)


def _state_limit(settings: Settings) -> int:
    """`state-memory-mib` in bytes."""
    return int(settings.state_memory_mib * 2**20)

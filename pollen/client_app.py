"""ClientApp: assemble this client's model, train or evaluate it, reply.

A node serves one client (its `partition-id`) or, in a simulation with fewer
nodes than clients, several; the server names the client in each message.
The handlers only assemble: the model from the message's shared entries and
the entries the client keeps (`context.state`), the round's examples
(`pollen.task.node_data`), one training call or evaluation, the reply. What
the round trains is `pollen.task.schedule`'s choice (plain epochs, DP-SGD,
FedRep's phases, FedBABU's body alone, Per-FedAvg's steps, Ditto's and
APFL's personal models, FedALA's adaptive start, FedRoD's personal head),
and what a personal evaluation tests its choice too; the local objective
(`pollen.task.objectives`) loads and saves its own state. What wraps the
training and evaluation handlers are ClientApp mods: central DP's clipping
on the client (`pollen.task.client_clip`), model poisoning
(`pollen.task.attacks`) and a straggler's slowdown
(`pollen.task.straggler`). The keys of messages and state are
`pollen.protocol`'s.

What a client keeps between rounds lives in `context.state`, per client: the
model entries its sharing policy keeps local (FedBN's BatchNorm, FedSA's
LoRA B matrices, FedPer's classifier, LG-FedAvg's body), its objective's
state (FedDyn's h_k, MOON's previous model), the personal models of Ditto,
APFL and FedALA, FedRoD's personal head and, under DP-SGD, the steps its privacy accountant has
counted. When the run checkpoints, that state is also written to the
client's disk after each round it trains and read back by a resumed run
(`pollen.task.client_state`). Only shared entries are accepted from the
server and only shared entries are sent back.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cache, partial
from logging import ERROR, WARNING
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
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.logger import log

from .common.cohorts import member_views, packed_reply
from .common.steps import effective_steps
from .deployment.warm_hint import hint_mod
from .protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
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
    SECAGG_KEYS,
    SECAGG_SHARES,
    SECAGG_UNMASK,
    SERVER_ROUND,
    SHARD_FINGERPRINT,
    TRAIN_LOSS,
    TRAIN_SECONDS,
    local_entries_key,
)
from .settings import Settings
from .task import client_state
from .task.attacks import poisoning_mod, trained_labels
from .task.client_clip import clipping_mod
from .task.data import Dataset
from .task.inputs import model_inputs, placed_model, settings_model
from .task.local_run import LocalRun, cohort_epochs
from .task.node_data import NodeData, node_data, node_partition
from .task.objectives import LocalObjective, diverged
from .task.schedule import local_training, personal_test
from .task.secagg_client import (
    advertise_keys,
    reveal_shares,
    secagg_mod,
    share_keys,
)
from .task.sharing import Sharing
from .task.straggler import straggler_mod
from .task.train import (
    ClientOptimizer,
    Preprocess,
    TrainResult,
    Transform,
    client_seed,
    evaluate,
    pick_device,
)

# Under pollen's warm executor, each message leaves the parent a hint of what
# to preload for the next (`warm_up`); elsewhere the mod does nothing.
app = ClientApp(mods=[hint_mod(Path(__file__).resolve().parent.parent)])


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
            data, client, int(config[SERVER_ROUND]), dataset, placed_model(settings, model, device),
            sharing, device,
        )  # fmt: skip

    @property
    def settings(self) -> Settings:
        return self.data.settings

    def new_model(self) -> torch.nn.Module:
        """The run's model at its common initialisation (on the CPU)."""
        return settings_model(self.settings, self.dataset)

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

    def local_run(self, lr: float) -> LocalRun:
        """This round's training set-up: the client's shard (its labels as an
        attacker flips them), what the model sees of it, the optimiser at
        rate `lr` and the round's seed."""
        s = self.settings
        images, y = self.data.train_shard(self.client, self.device)
        y = trained_labels(s, self.client, y)
        split = self.data.split_key("train", self.client)
        x, prep = self.inputs(split, images, s.augment)
        optimizer = ClientOptimizer(
            s.client_optimizer, lr, s.momentum, s.weight_decay, s.client_betas
        )
        seed = client_seed(s.seed, self.server_round, self.client)
        return LocalRun(
            s, self.client, self.model, self.sharing, self.device, x, y,
            optimizer, prep, seed,
        )  # fmt: skip

    def keep(self, context: Context, config: ConfigRecord) -> None:
        """Keep what outlives the round: the local entries in `context.state`,
        on the client's disk when the run checkpoints (`client_state`)."""
        if self.sharing.local:
            context.state[local_entries_key(self.client)] = self.entries(
                self.sharing.local
            )
        client_state.persist(context, self.client, self.server_round, config)
        client_state.spill(context, config, _state_limit(self.settings), self.client)

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


# Mods run outermost first: the reply is clipped, then poisoned, then (in a
# secure round) masked, then slowed.
TRAIN_MODS: list[Mod] = [
    straggler_mod(TRAIN_SECONDS), secagg_mod, poisoning_mod, clipping_mod,
]  # fmt: skip


@app.train(mods=TRAIN_MODS)
def train(msg: Message, context: Context) -> Message:
    """The round's training (`pollen.task.schedule`) of this client's model
    for its local objective, from the global model."""
    cm = ClientModel.assemble(msg, context)
    run = cm.local_run(float(msg.content[CONFIG][LR]))
    objective = LocalObjective.from_settings(cm.settings)
    objective.load(context, cm.client, cm.model, cm.sharing, msg.content, cm.new_model)
    training = local_training(cm.settings, cm.dataset)
    _load_optimizer_modules(cm.settings.client_optimizer)
    started = time.perf_counter()
    result, metrics = training(run, objective, context)
    seconds = time.perf_counter() - started
    return trained_reply(msg, context, cm, objective, result, seconds, metrics)


@app.train("cohort")
def train_cohort(msg: Message, context: Context) -> Message:
    """The round's training of every client this node serves in it, as one
    vectorised cohort (`pollen.task.cohort`): each member's message and
    reply are the ones `train` would take and give, through the same mods;
    each member's `train-seconds` is its share (by steps) of the cohort's."""
    lr = float(msg.content[CONFIG][LR])
    members: list[_Member] = []
    failed: dict[int, Exception] = {}
    for view in member_views(msg):
        try:
            members.append(_Member.prepared(view, context, lr))
        except Exception as err:  # as Flower answers `train` raising: its client's
            failed[int(view.content[CONFIG][CLIENT])] = _logged(err)
    if not members:
        return packed_reply(msg, [], failed)
    _load_optimizer_modules(members[0].cm.settings.client_optimizer)
    started = time.perf_counter()
    results = cohort_epochs([m.run for m in members], [m.objective for m in members])
    seconds = time.perf_counter() - started
    total_steps = sum(result.steps for result in results)
    answered = []
    for member, result in zip(members, results, strict=True):
        share = seconds * result.steps / total_steps
        trained = partial(
            trained_reply, cm=member.cm, objective=member.objective, result=result,
            seconds=share, metrics={TRAIN_LOSS: result.loss},
        )  # fmt: skip
        try:
            reply = through_mods(TRAIN_MODS, trained)(member.view, context)
        except Exception as err:  # its reply alone fails, as `train`'s would
            failed[member.cm.client] = _logged(err)
            continue
        answered.append((member.view, reply))
    return packed_reply(msg, answered, failed)


@dataclass
class _Member:
    """One client of a cohort, ready to train: its view of the message, its
    model, its run and its loaded objective."""

    view: Message
    cm: ClientModel
    run: LocalRun
    objective: LocalObjective

    @classmethod
    def prepared(cls, view: Message, context: Context, lr: float) -> _Member:
        """As `train` prepares its client; what would fail that client's
        training (its state, a shard without a step) raises here, before
        the cohort trains."""
        cm = ClientModel.assemble(view, context)
        run = cm.local_run(lr)
        run.check_steps()
        objective = LocalObjective.from_settings(cm.settings)
        objective.load(
            context, cm.client, cm.model, cm.sharing, view.content, cm.new_model
        )
        return cls(view, cm, run, objective)


def _logged(err: Exception) -> Exception:
    """`err`, logged with its traceback as Flower logs a ClientApp's."""
    log(ERROR, "cohort member failed alone: %s", err, exc_info=err)
    return err


def trained_reply(
    msg: Message,
    context: Context,
    cm: ClientModel,
    objective: LocalObjective,
    result: TrainResult,
    seconds: float,
    metrics: dict[str, float],
) -> Message:
    """After training: the objective's and the client's state kept (not
    after a training that diverged: the server drops its reply, and its
    state would stay non-finite), and the reply (shared entries, the
    objective's records, the round's metrics)."""
    s, config = cm.settings, msg.content[CONFIG]
    objective.save(context, cm.client, cm.model)
    if diverged(cm.model):
        log(WARNING, "pollen: client %d: training diverged (a non-finite entry); "
            "its state stays as it was before the round", cm.client)  # fmt: skip
    else:
        cm.keep(context, config)
    record = MetricRecord(
        {
            NUM_EXAMPLES: result.num_examples,
            TRAIN_SECONDS: seconds,
            **step_metrics(s, result.steps, float(config[LR]), objective),
            **metrics,
        }
    )
    shared = cm.entries(cm.sharing.shared)
    return cm.reply(msg, record, shared, objective.reply_records())


def through_mods(mods: list[Mod], handler: ClientAppCallable) -> ClientAppCallable:
    """`handler` wrapped in `mods` as a ClientApp wraps it (the first outermost)."""
    for mod in reversed(mods):
        handler = partial(mod, call_next=handler)
    return handler


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


@app.evaluate(mods=[straggler_mod(EVAL_SECONDS)])
def evaluate_personal(msg: Message, context: Context) -> Message:
    """This client's model (shared + local entries, or the personal model it
    keeps: `pollen.task.schedule.personal_test`), trained first on its
    shard where the settings say so (not kept), on the global test set and
    on its own test shard; NaN for either where the node has none (a node
    with its own data file and no copy of the data set has no global one),
    and for the global test where the client's model is the global one
    (every client would read the set alike, FedProto's prototypes too; the
    server evaluates it there already) or where the settings leave it out
    (`personal-global-test`). Under FedProto's inference the client
    predicts by the global prototypes its message carries."""
    cm = ClientModel.assemble(msg, context)
    s = cm.settings
    test = personal_test(s)
    if test.personal is not None:
        cm.model = test.personal(cm.model, context, cm.client)
    if test.adapt is not None:
        # its shard and optimiser ready first, as `train` has them
        run = cm.local_run(float(msg.content[CONFIG][LR]))
        _load_optimizer_modules(s.client_optimizer)
    started = time.perf_counter()
    if test.adapt is not None:
        test.adapt(run)
    if test.predicts is not None:
        cm.model = test.predicts(cm.model, msg.content)
    own_model = bool(cm.sharing.local) or s.personal_model or s.adapts
    global_test = (
        cm.data.global_test(cm.device) if s.personal_global_test and own_model else None
    )
    g_loss, g_acc = cm.loss_and_accuracy("test", global_test)
    own = cm.data.test_shard(cm.client, cm.device)
    l_loss, l_acc = cm.loss_and_accuracy(cm.data.split_key("test", cm.client), own)
    seconds = time.perf_counter() - started
    personal = dict(zip(PERSONAL_METRICS, (g_acc, g_loss, l_acc, l_loss), strict=True))
    metrics = MetricRecord(
        {**personal, NUM_EXAMPLES: len(own[1]), EVAL_SECONDS: seconds}
    )
    client_state.spill(context, msg.content[CONFIG], _state_limit(s), cm.client)
    return cm.reply(msg, metrics)


# SecAgg+'s query stages (pollen.task.secagg_client); its training stage is
# the train handler above, through secagg_mod
app.query(SECAGG_KEYS)(advertise_keys)
app.query(SECAGG_SHARES)(share_keys)
app.query(SECAGG_UNMASK)(reveal_shares)


def _state_limit(settings: Settings) -> int:
    """`state-memory-mib` in bytes."""
    return int(settings.state_memory_mib * 2**20)

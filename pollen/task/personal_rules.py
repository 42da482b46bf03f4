"""What clients that keep something of their own refuse, asked by
`Settings` before anything starts (torch-free: it reads the settings and
the catalogue).

- `bn-policy` decides BatchNorm's entries only under `sharing = "all"`;
  every other sharing policy decides each entry itself (`pollen.task.sharing`);
  under `local` nothing of the model travels, so the parts that act on the
  shared entries or the updates (SecAgg+, central DP, DP-SGD, server
  optimisers, robust aggregators, the norm bound, SCAFFOLD's, FedDyn's and
  MOON's terms, attacks, a global model beside a personal one) would do
  nothing and are refused, and so is a run that tests no client's model.
- FedRep (Collins et al. 2021, https://arxiv.org/abs/2102.07078) trains the
  client's own classifier first, so the classifier must stay local
  (`sharing = "fedper"`), and its two passes a round do not fit DP-SGD's
  budget, planned for one (`pollen.task.fedrep`).
- Ditto's personal model (Li et al. 2021, https://arxiv.org/abs/2012.04221)
  trains the whole model beside the global one, without DP-SGD, so it cannot
  run under DP-SGD or a LoRA sharing that trains only adapters
  (`pollen.task.ditto`).
- FedBABU's frozen head (Oh et al. 2022, https://arxiv.org/abs/2106.06042)
  never changes, so it need not travel (`sharing = "fedper"`), and FedRep's
  head phase would train it; fine-tuning before a personal evaluation trains
  the whole model without DP-SGD, and Ditto's personal model is already the
  one a client tests (`pollen.task.fedbabu`).
- APFL's personal model (Deng et al. 2020, https://arxiv.org/abs/2003.13461)
  steps beside each batch of one training pass, without DP-SGD, and is what
  its client tests: refused with DP-SGD, LoRA sharings, FedRep's phases,
  Ditto and fine-tuning (`pollen.task.apfl`).
- Per-FedAvg (Fallah et al. 2020, https://arxiv.org/abs/2002.07948) trains
  in its own loop of the plain loss, two batches a step, and personalises
  by one step before testing: refused with DP-SGD, another local objective,
  FedRep's and FedBABU's schedules, personal models and fine-tuning
  (`pollen.task.per_fedavg`).
- FedALA (Zhang et al. 2023, https://arxiv.org/abs/2212.01197) mixes the
  whole received model with the client's previous one: refused with DP-SGD,
  a sharing other than all, other personal models, Per-FedAvg and FedBABU's
  frozen head (`pollen.task.fedala`).
- FedRoD (Chen and Chao 2022, https://arxiv.org/abs/2107.00778) trains the
  shared model on the balanced softmax and a personal head beside the
  shared classifier, which must travel: refused with DP-SGD, a sharing
  other than all, a model without an `nn.Linear` classifier (or a LoRA
  one), the other personal schedules and fine-tuning (`pollen.task.fedrod`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..catalog import LORA_SHARING
from ..extensions import PART_KEYS, model_info, part

if TYPE_CHECKING:
    from ..settings import Settings


def personal_problem(s: Settings) -> str | None:
    """Why `s`'s sharing, or what its clients keep or adapt of their own,
    cannot run, or None."""
    if s.sharing != "all" and s.bn_policy != "shared":
        return (
            f"bn-policy={s.bn_policy!r} with sharing={s.sharing!r}: a sharing "
            "other than all decides every entry itself (BatchNorm included); "
            "leave bn-policy at shared"
        )
    if problem := _local_problem(s):
        return problem
    if s.head_epochs and s.sharing != "fedper":
        return (
            f"head-epochs={s.head_epochs} with sharing={s.sharing!r}: FedRep "
            "trains the client's own classifier first, so the classifier must "
            "stay local; set sharing='fedper' (or strategy='fedrep')"
        )
    if s.ditto_lambda and (s.dp or s.sharing in LORA_SHARING):
        return (
            f"ditto-lambda with {'dp=true' if s.dp else 'a LoRA sharing'}: "
            "Ditto's personal model trains the whole model without DP-SGD on the "
            "client's data; allowed with ditto: dp=false and sharing all or fedper"
        )
    if s.head_epochs and s.dp:
        return (
            "head-epochs with dp=true: DP-SGD's budget is planned for one "
            "training pass per round; set head-epochs=0"
        )
    return (
        _fedbabu_problem(s)
        or _apfl_problem(s)
        or _per_fedavg_problem(s)
        or _fedala_problem(s)
        or _fedrod_problem(s)
        or _proto_inference_problem(s)
    )


def _fedbabu_problem(s: Settings) -> str | None:
    """Why `s`'s frozen head or fine-tuning cannot run, or None."""
    if s.freeze_head and not model_info(s.model, s.data_set).body:
        return (
            f"freeze-head with model={s.model!r}: its classifier is all it "
            "trains, so nothing would train; allowed: a model with layers below "
            "its classifier"
        )
    if s.fine_tune_epochs and not s.personal_eval_every:
        return (
            f"fine-tune-epochs={s.fine_tune_epochs} with personal-eval-every=0: "
            "fine-tuning runs before a personal evaluation, and none is asked "
            "for; set personal-eval-every to 1 or more (auto: 1)"
        )
    if s.freeze_head and s.sharing != "fedper":
        return (
            f"freeze-head with sharing={s.sharing!r}: the frozen classifier "
            "never changes, so it stays on each client; set sharing='fedper' "
            "(or strategy='fedbabu')"
        )
    if s.freeze_head and (s.head_epochs or s.dp):
        given = f"head-epochs={s.head_epochs}" if s.head_epochs else "dp=true"
        return (
            f"freeze-head with {given}: FedRep's head phase would train the "
            "frozen classifier, and DP-SGD's plan trains the whole model; allowed "
            "with freeze-head: head-epochs=0 and dp=false"
        )
    if s.fine_tune_epochs and (s.dp or s.ditto_lambda):
        given = "dp=true" if s.dp else "ditto-lambda"
        return (
            f"fine-tune-epochs with {given}: fine-tuning trains the whole model "
            "on the client's data without DP-SGD, and Ditto's personal model is "
            "already the model a client tests; allowed with fine-tune-epochs: "
            "dp=false and ditto-lambda=0"
        )
    return None


def _local_problem(s: Settings) -> str | None:
    """Why `s`'s `sharing = "local"` cannot run, or None: nothing of the model
    travels, so every part that acts on the shared entries or on the
    updates would silently do nothing."""
    if s.sharing != "local":
        return None
    return _first_refusal(
        "sharing='local'",
        "nothing of the model travels, so it would silently do nothing",
        "sharing local",
        [
            (s.secure_aggregation != "off", "secure-aggregation",
             "secure-aggregation='off'"),
            (s.mode == "async", "mode='async' (FedBuff's server steps by the "
             "updates)", "mode='sync'"),
            (s.central_dp != "off", "central-dp", "central-dp='off'"),
            (s.server_update != "fedavg", f"server-update={s.server_update!r}",
             "server-update='fedavg'"),
            (s.aggregator != "mean", f"aggregator={s.aggregator!r}",
             "aggregator='mean'"),
            (s.update_norm_bound > 0, "update-norm-bound", "update-norm-bound=0"),
            (part("local-objective", s.local_objective).load().reads_the_server,
             f"local-objective={s.local_objective!r} (its term reads what the "
             "server sends)", _objectives_reading_nothing_sent()),
            (s.attack != "none", f"attack={s.attack!r}", "attack='none'"),
            (s.dp, "dp=true (no update leaves the client to protect)", "dp=false"),
            (s.ditto_lambda > 0 or s.apfl_alpha > 0 or s.per_fedavg_beta > 0,
             "a personal model beside the global one (ditto-lambda, apfl-alpha, "
             "per-fedavg-beta: the global one would be local too)",
             "ditto-lambda=0, apfl-alpha=0 and per-fedavg-beta=0"),
            (not s.personal_eval_every, "personal-eval-every=0 (the clients' "
             "models are all there is to test)", "personal-eval-every=1 or more"),
        ],
    )  # fmt: skip


def _objectives_reading_nothing_sent() -> str:
    """The catalogue's local objectives whose terms read nothing the server
    sends, as a refusal lists them."""
    objectives, _ = PART_KEYS["local-objective"]
    return ", ".join(
        name for name, p in objectives.items() if not p.load().reads_the_server
    )


def _first_refusal(
    key: str, why: str, preset: str, given: list[tuple[bool, str, str]]
) -> str | None:
    """The refusal of `key` for the first of `given` (on, what is set, what
    is allowed) that is on, or None: "key with what: why; allowed with
    preset: allowed"."""
    for on, what, allowed in given:
        if on:
            return f"{key} with {what}: {why}; allowed with {preset}: {allowed}"
    return None


def _apfl_problem(s: Settings) -> str | None:
    """Why `s`'s APFL cannot run, or None: its personal model trains the
    whole model without DP-SGD beside each batch of the global model's
    training, and is what the client tests."""
    if not s.apfl_alpha:
        return None
    return _first_refusal(
        "apfl-alpha",
        "APFL's personal model trains the whole model without DP-SGD beside "
        "each batch of one training pass, and is itself the model a client tests",
        "apfl",
        [
            (s.dp, "dp=true", "dp=false"),
            (s.sharing in LORA_SHARING, f"sharing={s.sharing!r}",
             "sharing all or fedper"),
            (s.ditto_lambda > 0, "ditto-lambda", "ditto-lambda=0"),
            (s.head_epochs > 0, "head-epochs", "head-epochs=0"),
            (s.freeze_head, "freeze-head", "freeze-head=false"),
            (s.fine_tune_epochs > 0, "fine-tune-epochs", "fine-tune-epochs=0"),
        ],
    )  # fmt: skip


def _per_fedavg_problem(s: Settings) -> str | None:
    """Why `s`'s Per-FedAvg cannot run, or None: its steps are its own loop
    of the plain loss, and its one-step personalisation is the model a
    client tests."""
    if not s.per_fedavg_beta:
        return None
    return _first_refusal(
        "per-fedavg-beta",
        "Per-FedAvg's steps are its own two-batch loop of the plain loss "
        "without DP-SGD, and its one-step personalisation is what a client tests",
        "per-fedavg",
        [
            (s.dp, "dp=true", "dp=false"),
            (s.local_objective != "plain", f"local-objective={s.local_objective!r}",
             "local-objective='plain'"),
            (s.head_epochs > 0, "head-epochs", "head-epochs=0"),
            (s.freeze_head, "freeze-head", "freeze-head=false"),
            (s.personal_model, "a personal model (ditto-lambda, apfl-alpha, "
             "ala-layers, personal-head)",
             "ditto-lambda=0, apfl-alpha=0, ala-layers=0 and personal-head=false"),
            (s.fine_tune_epochs > 0, "fine-tune-epochs", "fine-tune-epochs=0"),
        ],
    )  # fmt: skip


def _fedala_problem(s: Settings) -> str | None:
    """Why `s`'s FedALA cannot run, or None: its mix is of whole models the
    client trains without DP-SGD and is what a client tests, and a term
    anchored at the received model, or FedNova's step count, would read the
    mix's jump as training."""
    if not s.ala_layers:
        return None
    return _first_refusal(
        "ala-layers",
        "FedALA starts training from a learned mix of the whole received model "
        "with the client's previous one, without DP-SGD, and that mix is what a "
        "client tests",
        "fedala",
        [
            (s.dp, "dp=true", "dp=false"),
            (s.sharing != "all", f"sharing={s.sharing!r}", "sharing='all'"),
            (s.local_objective != "plain", f"local-objective={s.local_objective!r}",
             "local-objective='plain' (a term anchored at the received model "
             "would count the mix as training)"),
            (s.aggregator == "fednova", "aggregator='fednova'",
             "another aggregator (FedNova would count the mix as steps)"),
            (s.ditto_lambda > 0 or s.apfl_alpha > 0,
             "another personal model (ditto-lambda, apfl-alpha)",
             "ditto-lambda=0 and apfl-alpha=0"),
            (s.per_fedavg_beta > 0, "per-fedavg-beta", "per-fedavg-beta=0"),
            (s.freeze_head, "freeze-head", "freeze-head=false"),
            (s.fine_tune_epochs > 0, "fine-tune-epochs", "fine-tune-epochs=0"),
        ],
    )  # fmt: skip


def _fedrod_problem(s: Settings) -> str | None:
    """Why `s`'s FedRoD cannot run, or None: its personal head sits beside a
    shared `nn.Linear` classifier, its losses are not DP-SGD's, and the
    two heads summed are what a client tests."""
    if not s.personal_head:
        return None
    info = model_info(s.model, s.data_set)
    return _first_refusal(
        "personal-head",
        "FedRoD trains the shared model on the balanced softmax without DP-SGD "
        "and a personal head beside its shared nn.Linear classifier, and the "
        "two heads summed are what a client tests",
        "fedrod",
        [
            (s.dp, "dp=true", "dp=false"),
            (not info.linear or info.lora, f"model={s.model!r}",
             "a model whose classifier is an nn.Linear (not a LoRA head)"),
            (s.sharing != "all", f"sharing={s.sharing!r}", "sharing='all'"),
            (s.head_epochs > 0, "head-epochs", "head-epochs=0"),
            (s.freeze_head, "freeze-head", "freeze-head=false"),
            (s.ditto_lambda > 0 or s.apfl_alpha > 0 or s.ala_layers > 0,
             "another personal model (ditto-lambda, apfl-alpha, ala-layers)",
             "ditto-lambda=0, apfl-alpha=0 and ala-layers=0"),
            (s.per_fedavg_beta > 0, "per-fedavg-beta", "per-fedavg-beta=0"),
            (s.fine_tune_epochs > 0, "fine-tune-epochs", "fine-tune-epochs=0"),
        ],
    )  # fmt: skip


def _proto_inference_problem(s: Settings) -> str | None:
    """Why `s`'s nearest-prototype inference cannot run, or None: the global
    prototypes are FedProto's, and what a client tests is its own model's
    representation against them, read in a personal evaluation."""
    if s.proto_inference != "prototypes":
        return None
    return _first_refusal(
        "proto-inference='prototypes'",
        "a client predicts by the global prototype nearest its own model's "
        "representation, in a personal evaluation",
        "fedproto",
        [
            (not part("local-objective", s.local_objective).load().prototypes,
             f"local-objective={s.local_objective!r} (its server keeps no "
             "prototypes)", "local-objective='fedproto'"),
            (s.personal_model or s.adapts,
             "a personal model or an adaptation before the test (ditto-lambda, "
             "apfl-alpha, ala-layers, personal-head, fine-tune-epochs, "
             "per-fedavg-beta)", "none of them"),
            (not s.personal_eval_every, "personal-eval-every=0",
             "personal-eval-every 1 or more"),
        ],
    )  # fmt: skip

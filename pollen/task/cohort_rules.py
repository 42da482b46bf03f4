"""What `client-execution = "cohort"` refuses, asked by `Settings` before
anything starts (torch-free: it reads the settings and the catalogue only).

A cohort trains a node's clients of one round as one vectorised computation
(`pollen.task.cohort`): the same batches, the same optimiser and objective
arithmetic on parameters stacked over clients. It refuses what that
computation cannot reproduce exactly:

- dropout (a model's own, as MobileNetV2's classifier, or LoRA's
  `lora-dropout`): `vmap` draws one mask tensor for the cohort, so no client
  would see the masks its sequential training draws;
- DP-SGD, FedRep's two phases, Ditto's and APFL's personal models,
  Per-FedAvg's steps, FedALA's mix and FedRoD's heads: trainings built
  around one client's model; FedBABU's frozen head, which the cohort's
  plain epochs would train;
- a local objective's term on each batch (MOON's, FedProto's), which its part refuses
  with cohorts (`pollen.task.objective_parts`);
- asynchronous FedBuff: clients start one at a time as the buffer asks, so
  a round has no cohort to train together.

BatchNorm models train in cohorts, each client's running statistics its
own (`pollen.task.cohort_norm`). A user's local objective is asked at run
time whether its term has the affine gradient the cohort trainer applies,
and a user's BatchNorm whether its momentum is set (`pollen.task.cohort`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..extensions import model_info

if TYPE_CHECKING:
    from ..settings import Settings

ALLOWED = "client-execution='sequential'"


def cohort_problem(s: Settings) -> str | None:
    """Why `s` cannot train its clients as cohorts, or None."""
    info = model_info(s.model, s.data_set)
    if info.dropout:
        return (
            f"client-execution='cohort' with model={s.model!r}: its dropout "
            "masks would be drawn once for the whole vectorised cohort, not per "
            f"client; allowed: a model without dropout, or {ALLOWED}"
        )
    if info.lora and s.lora_dropout > 0:
        return (
            f"client-execution='cohort' with lora-dropout={s.lora_dropout:g}: a "
            "vectorised cohort cannot draw each client's own dropout masks; "
            f"allowed: lora-dropout=0, or {ALLOWED}"
        )
    trainings = [  # what is set, and the value that turns it off
        ("dp=true", s.dp, "dp=false"),
        (f"head-epochs={s.head_epochs}", s.head_epochs, "head-epochs=0"),
        (f"ditto-lambda={s.ditto_lambda:g}", s.ditto_lambda, "ditto-lambda=0"),
        ("freeze-head=true", s.freeze_head, "freeze-head=false"),
        (f"apfl-alpha={s.apfl_alpha:g}", s.apfl_alpha, "apfl-alpha=0"),
        (f"per-fedavg-beta={s.per_fedavg_beta:g}", s.per_fedavg_beta,
         "per-fedavg-beta=0"),
        (f"ala-layers={s.ala_layers}", s.ala_layers, "ala-layers=0"),
        ("personal-head=true", s.personal_head, "personal-head=false"),
    ]  # fmt: skip
    for given, on, off in trainings:
        if on:
            return (
                f"client-execution='cohort' with {given}: that training works on "
                "one client's model at a time (DP-SGD's per-sample clipping, "
                "FedRep's phases, Ditto's and APFL's personal models, FedBABU's "
                "frozen head, Per-FedAvg's two-batch steps, FedALA's mix, "
                "FedRoD's balanced loss and personal head), "
                "and a cohort trains its clients' models together in plain local "
                "epochs; allowed: "
                f"{off}, or {ALLOWED}"
            )
    if s.mode == "async":
        return (
            "client-execution='cohort' with mode='async': FedBuff starts clients "
            "one at a time as its buffer asks, so no round has a cohort to train "
            f"together; allowed: mode='sync', or {ALLOWED}"
        )
    return None

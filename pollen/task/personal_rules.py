"""What clients that keep something of their own refuse, asked by
`Settings` before anything starts (torch-free: it reads the settings only).

- `bn-policy` decides BatchNorm's entries only under `sharing = "all"`;
  every other sharing policy decides each entry itself (`pollen.task.sharing`).
- FedRep (Collins et al. 2021, https://arxiv.org/abs/2102.07078) trains the
  client's own classifier first, so the classifier must stay local
  (`sharing = "fedper"`), and its two passes a round do not fit DP-SGD's
  budget, planned for one (`pollen.task.fedrep`).
- Ditto's personal model (Li et al. 2021, https://arxiv.org/abs/2012.04221)
  trains the whole model beside the global one, without DP-SGD, so it cannot
  run under DP-SGD or a LoRA sharing that trains only adapters
  (`pollen.task.ditto`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..catalog import LORA_SHARING

if TYPE_CHECKING:
    from ..settings import Settings


def personal_problem(s: Settings) -> str | None:
    """Why `s`'s sharing, FedRep schedule or Ditto model cannot run, or None."""
    if s.sharing != "all" and s.bn_policy != "shared":
        return (
            f"bn-policy={s.bn_policy!r} with sharing={s.sharing!r}: a sharing "
            "other than all decides every entry itself (BatchNorm included); "
            "leave bn-policy at shared"
        )
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
    return None

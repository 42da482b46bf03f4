"""FedNova's normalised averaging (Wang et al. 2020, "Tackling the objective
inconsistency problem in heterogeneous federated optimization",
https://arxiv.org/abs/2007.07481).

Clients that take different numbers of local steps pull the plain mean
towards the objectives of those that take more. FedNova divides each update
by the client's effective number of steps a_k and rescales the mean by
their weighted mean tau_eff (the paper's eq. 6, with p_k = n_k / n):

    x_bar = x + tau_eff sum_k p_k (y_k - x) / a_k,    tau_eff = sum_k p_k a_k.

a_k is the l1 norm of the weights with which the client's local gradients
enter its update y_k - x, in units of the learning rate: tau_k for plain
SGD, [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) with momentum rho
(the paper's Section 5), [1 - (1 - eta mu)^tau] / (eta mu) with a proximal
term mu. `pollen.common.steps.effective_steps` computes it for any mix of momentum and a pull
towards the received model (FedProx's mu, FedDyn's alpha) by running that
linear recursion with unit gradients; the ClientApp reports it as metric
`effective-steps` beside `local-steps`. Entries that no gradient trains
(BatchNorm statistics, counters) are averaged as the mean does. With equal
a_k the rule is the weighted mean.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ..protocol import EFFECTIVE_STEPS
from .aggregation import Aggregate, Arrays, ClientUpdate, Rule, mean64, normalized


class FedNova(Rule):
    """x + tau_eff sum_k p_k (y_k - x) / a_k on the trained entries; the
    weighted mean on the others."""

    required_metrics = (EFFECTIVE_STEPS,)

    @classmethod
    def problem(cls, settings: Any) -> str | None:
        """a_k is defined for SGD's steps (with momentum), not Adam's."""
        if problem := super().problem(settings):
            return problem
        if settings.client_optimizer != "sgd":
            return (
                f"aggregator='fednova' with client-optimizer="
                f"{settings.client_optimizer!r}: FedNova's effective steps a_k are "
                "defined for SGD (with momentum); allowed: client-optimizer='sgd'"
            )
        return None

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        current: Arrays,
        trained: Collection[str] = (),
    ) -> Aggregate:
        p = normalized([u.num_examples for u in updates], len(updates))
        a = np.array([float(u.metrics[EFFECTIVE_STEPS]) for u in updates])
        tau_eff = float(p @ a)
        records = [u.arrays for u in updates]
        arrays = {}
        for key in current:
            if key not in trained:
                arrays[key] = mean64(records, p, key)
                continue
            x = current[key].astype(np.float64)
            direction = sum(
                (pk / ak) * (r[key].astype(np.float64) - x)
                for pk, ak, r in zip(p, a, records, strict=True)
            )
            arrays[key] = x + tau_eff * direction
        return Aggregate(arrays, tuple(updates))

"""Central (user-level) differential privacy: DP-FedAvg's aggregation step.

McMahan et al. 2018 ("Learning differentially private recurrent language
models", https://arxiv.org/abs/1710.06963), with the adaptive clipping of
Andrew et al. 2021 ("Differentially private learning with adaptive
clipping", https://arxiv.org/abs/1905.03871). With x the current model, m the
round's planned sample size, C the clipping norm and z the noise multiplier:

    Delta_k = (y_k - x) min(1, C / ||y_k - x||)              (clipping)
    x_bar   = x + (sum_k Delta_k + N(0, (z_Delta C)^2 I)) / m   (fixed denominator)

One client changes sum_k Delta_k by at most C, so each round is a Gaussian
mechanism of noise multiplier z on the clients' data, whatever the server
update does afterwards (FedAvg takes x_bar, FedOpt steps on x_bar - x: both
post-processing). Clients that fail only shrink the sum: the denominator is
m, the planned sample (McMahan et al.'s fixed-denominator estimator).

Clipping happens on the server (`central-clip-on = "server"`), or first on
the client (`"client"`: the update never leaves it unclipped); the server
clips again either way, so a client that does not clip cannot break the
bound. Adaptive clipping moves C towards the gamma-quantile of the update
norms: with b_k = 1 when ||y_k - x|| <= C (the client reports its norm when
it clips itself),

    b_bar = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2,
    C <- C exp(-eta (b_bar - gamma)).

Centring the bits makes one client change the noised sum by at most 1/2,
so the update's noise can be z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) and
the two releases together cost what one Gaussian mechanism of multiplier z
costs (Andrew et al., Theorem 1; TensorFlow Privacy's quantile estimator
centres the same way). With fixed clipping z_Delta = z.

The privacy spent is counted per release (a round that aggregated) by the
run's `accountant` (`pollen.common.accountants`: RDP, PRV or PLD) at
`dp-delta`, with no amplification by sampling: pollen samples a fixed number
of clients without replacement, and the accountants at hand assume Poisson
sampling, so none is claimed. `tests/test_accountants.py` checks each
against its library and the exact epsilon of composed Gaussian mechanisms.

Covered: the model's floating entries that travel (`problem` refuses
BatchNorm statistics that would travel: noise would make a variance
negative). Not covered: integer entries (averaged, unweighted), the metrics
a reply carries (example count, training time), and personal evaluations
of what stays on the clients (FedBN/FedPer entries, Ditto's models), whose
metrics reach the history without noise.
The noise comes from the operating system's entropy, never from `seed`: a
run with central DP is not bit-reproducible, by design.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ..common import accountants
from ..common.clipping import clipped
from ..extensions import model_info, part
from ..protocol import CLIP_NORM, UPDATE_NORM
from .aggregation import Aggregate, Arrays, ClientUpdate, Rule, mean64, normalized


def update_noise_multiplier(z: float, count_noise: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the update's share of a budget
    of multiplier z when the clipped count is released with noise sigma_b
    (Andrew et al. 2021, Theorem 1); z itself without a count."""
    if not count_noise:
        return z
    rest = z**-2 - (2 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(
            f"central-count-noise={count_noise:g} too small for "
            f"central-noise-multiplier={z:g}: needs 2 x count noise > z"
        )
    return rest**-0.5


def epsilon_spent(
    z: float, releases: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon after `releases` Gaussian mechanisms of multiplier z at
    `delta` under `accountant` (no sampling amplification)."""
    return accountants.epsilon(
        accountant, noise_multiplier=z, sample_rate=1.0, steps=releases, delta=delta
    )


def planned_noise(settings: Any) -> float:
    """z: `central-noise-multiplier`, or the smallest that keeps the run's
    `rounds` releases within `central-epsilon` under its `accountant`."""
    if settings.central_epsilon:
        return accountants.noise_multiplier(
            settings.accountant, epsilon=settings.central_epsilon,
            delta=settings.dp_delta, sample_rate=1.0, steps=settings.rounds,
        )  # fmt: skip
    return settings.central_noise_multiplier


class CentralDP(Rule):
    """Clip each update, sum, add Gaussian noise, divide by the planned sample."""

    def __init__(
        self,
        *,
        clip_norm: float,
        noise_multiplier: float,
        sample_size: int,
        delta: float,
        adaptive: bool = False,
        quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_noise: float = 0.0,
        client_clips: bool = False,
        accountant: str = "rdp",
        rng: np.random.Generator | None = None,
    ) -> None:
        self.clip_norm = clip_norm
        self.z = noise_multiplier
        self.sample_size = sample_size
        self.delta = delta
        self.adaptive = adaptive
        self.quantile = quantile
        self.clip_lr = clip_lr
        self.count_noise = count_noise if adaptive else 0.0
        self.client_clips = client_clips
        self.accountant = accountant
        self.z_update = update_noise_multiplier(noise_multiplier, self.count_noise)
        self.rng = rng or np.random.default_rng()  # OS entropy: never the run's seed
        self.releases = 0

    @classmethod
    def from_settings(cls, settings: Any, uniform: bool = False) -> CentralDP:
        adaptive = settings.central_dp == "adaptive"
        n = settings.sample_size
        return cls(
            clip_norm=settings.central_clip_norm,
            noise_multiplier=planned_noise(settings),
            sample_size=n,
            delta=settings.dp_delta,
            adaptive=adaptive,
            quantile=settings.central_clip_quantile,
            clip_lr=settings.central_clip_lr,
            count_noise=settings.central_count_noise or n / 20,
            client_clips=settings.central_clip_on == "client",
            accountant=settings.accountant,
        )

    @classmethod
    def problem(cls, settings: Any) -> str | None:
        """Why user-level DP cannot be kept or accounted for with `settings`,
        or None (what `pollen.settings` asks where `central-dp` is on)."""
        mode = settings.central_dp
        objective = part("local-objective", settings.local_objective).load()
        reasons = {
            "aggregator": (settings.aggregator != "mean", "central DP is the "
                           "aggregation step itself (a clipped, noised sum); leave "
                           "aggregator at mean"),
            "mode": (settings.mode == "async", "FedBuff's buffer changes the sum's "
                     "sensitivity; use mode='sync'"),
            "local-objective": (bool(objective.server_state),
                                "the records its server state reads (SCAFFOLD's "
                                "Delta c_k, FedProto's prototypes) would leave "
                                "the clients without noise; use another local "
                                "objective"),
            "dp": (settings.dp, "choose example-level DP-SGD (dp=true) or "
                   "user-level central DP, not both"),
            "update-norm-bound": (bool(settings.update_norm_bound), "a bound "
                                  "relative to the round's median norm lets one "
                                  "client change the others' contributions; set "
                                  "update-norm-bound=0 (central DP clips every "
                                  "update to C)"),
            "resume": (bool(settings.resume), "the rounds after the checkpoint "
                       "were released once already, and a resumed accountant "
                       "would not count them; start a new run instead"),
            "model": (
                model_info(settings.model, settings.data_set).batchnorm
                and settings.sharing in ("all", "fedper")
                and settings.bn_policy == "shared",
                "BatchNorm's running statistics would be released with noise (a "
                "negative variance breaks the model); set bn-policy='silobn' or "
                "'fedbn', or use a model without BatchNorm (mlp, cnn-gn, "
                "simple-cnn)",
            ),
        }  # fmt: skip
        for key, (refused, why) in reasons.items():
            if refused:
                value = getattr(settings, key.replace("-", "_"))
                return f"central-dp={mode!r} with {key}={value!r}: {why}"
        z = planned_noise(settings)
        count = settings.central_count_noise or settings.sample_size / 20
        if mode == "adaptive" and 2 * count <= z:
            return (
                f"central-dp='adaptive': the count noise {count:g} must exceed "
                f"central-noise-multiplier / 2 = {z / 2:g} (Andrew et al. 2021, "
                "Theorem 1); raise central-count-noise or sample more clients"
            )
        return None

    @property
    def required_metrics(self) -> tuple[str, ...]:  # type: ignore[override]
        return (UPDATE_NORM,) if self.client_clips and self.adaptive else ()

    def train_config(self) -> dict[str, float]:
        """What clients that clip themselves need: this round's C."""
        return {CLIP_NORM: self.clip_norm} if self.client_clips else {}

    @property
    def epsilon(self) -> float:
        """The privacy spent so far (every release, at `delta`)."""
        return epsilon_spent(self.z, self.releases, self.delta, self.accountant)

    def __call__(
        self,
        updates: Sequence[ClientUpdate],
        current: Arrays,
        trained: Collection[str] = (),
    ) -> Aggregate:
        floating = [
            k for k, v in current.items() if np.issubdtype(v.dtype, np.floating)
        ]
        deltas, unclipped = [], 0
        for u in updates:
            delta = {k: u.arrays[k].astype(np.float64) - current[k] for k in floating}
            scaled, norm = clipped(delta, self.clip_norm)
            reported = (
                float(u.metrics.get(UPDATE_NORM, norm)) if self.client_clips else norm
            )
            unclipped += int(0 <= reported <= self.clip_norm)
            deltas.append(scaled)
        std = self.z_update * self.clip_norm
        arrays = {}
        for key in floating:
            total = sum((d[key] for d in deltas), start=np.zeros(current[key].shape))
            noise = self.rng.normal(0.0, std, size=current[key].shape)
            arrays[key] = (
                current[key].astype(np.float64) + (total + noise) / self.sample_size
            )
        others = [k for k in current if k not in floating]
        if others:
            w = normalized([1.0] * len(updates), len(updates))
            records = [u.arrays for u in updates]
            arrays.update({k: mean64(records, w, k) for k in others})
        clip_norm = self.clip_norm
        report = {"clip-norm": clip_norm}
        if self.adaptive:
            centred = unclipped - len(updates) / 2
            noisy = (
                centred + self.rng.normal(0.0, self.count_noise)
            ) / self.sample_size
            self.clip_norm *= math.exp(-self.clip_lr * (noisy + 0.5 - self.quantile))
            report["unclipped"] = noisy + 0.5  # noised: the exact share is private
        self.releases += 1
        # what the summary needs to give every accountant's epsilon
        report["releases"] = self.releases
        report["noise-multiplier"] = self.z
        report["epsilon"] = self.epsilon
        return Aggregate(arrays, tuple(updates), report)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {
            "central-dp/clip-norm": np.array(self.clip_norm),
            "central-dp/releases": np.array(self.releases),
        }

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        if "central-dp/releases" not in state:
            raise ValueError(
                "the checkpoint holds no central-DP state (clip norm, releases): "
                "it was written by a run without central-dp"
            )
        self.clip_norm = float(state["central-dp/clip-norm"])
        self.releases = int(state["central-dp/releases"])

"""Local objectives: what a client minimises in a round, and what it keeps for it.

A client k that receives the global model theta^t minimises, from theta^t,

    F_k(theta) + R_k(theta)

with F_k its empirical loss (cross-entropy on its shard) and R_k a
regulariser around the received model, its anchor:

- `plain`: R_k = 0 (FedAvg).
- `prox` (FedProx, Li et al. 2020, eq. 2): R_k(theta) = mu/2 ||theta - theta^t||^2,
  so each step adds mu (theta - theta^t) to the data gradient.
- `feddyn` (FedDyn, Acar et al. 2021, Algorithm 1):
  R_k(theta) = alpha/2 ||theta - theta^t||^2 - <h_k, theta>, where h_k (the
  paper's grad L_k(theta_k^{t-1})) is the client's own state: zero at the
  start and, after each round it trains, h_k <- h_k - alpha (theta_k^t - theta^t).
- `scaffold` (SCAFFOLD, Karimireddy et al. 2020, Algorithm 1, option II):
  R_k(theta) = <c - c_k, theta>, so each local gradient is corrected by the
  server's control variate c (sent with the model) minus the client's own
  c_k (its state, zero at the start). After the round's K steps of rate eta,
  c_k^+ = c_k - c + (theta^t - theta_k) / (eta K); the client keeps c_k^+
  and replies with Delta c_k = c_k^+ - c_k (record `control`), from which
  the server moves c (`pollen.strategies.scaffold`). The paper's local
  optimiser is plain SGD, the part's default; with a momentum rho set, K is
  FedNova's effective steps a(K, rho), so (theta^t - theta_k) / (eta a)
  stays the mean gradient of the round (with rho = 0, a = K).
- `moon` (MOON, Li et al. 2021, eq. 3-4): a term of the batch, mu l_con,
  the model-contrastive loss of the representations by the trained, the
  received and the client's previous model (`pollen.task.moon`); unlike the
  regularisers it depends on the examples, so it is added to the batch's
  loss before the backward pass (`BatchTerm`).
- `-sam` (FedSAM, Qu et al. 2022, Caldarola et al. 2022): the data gradient
  is taken at the worst point of a rho-ball, theta + eps with
  eps = rho g / ||g||, g = grad F_k(theta) (Foret et al. 2021); `sam` alone
  has no regulariser, `prox-sam` and `feddyn-sam` add theirs at theta.

The anchor is the received model's trained shared entries (a sharing
policy's local entries are not the server's; BatchNorm statistics are not
parameters); with `feddyn-exclude-bn` FedDyn also leaves BatchNorm's scale
and shift out, as the server's correction does. Which of these a
`local-objective` name combines, and what it refuses, its part says
(`pollen.task.objective_parts`, reached through the catalogue);
`pollen.task.train` calls `LocalObjective`'s two hooks once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import extensions
from ..catalog import load
from ..common.steps import effective_steps
from ..protocol import CONFIG, CONTROL, LR, feddyn_state_key, scaffold_state_key

if TYPE_CHECKING:
    from ..settings import Settings
    from .sharing import Sharing

Parameters = dict[str, nn.Parameter]


class Regularizer(Protocol):
    """R_k around the received model: its gradient, and the state it keeps."""

    exclude_bn: bool  # leave BatchNorm's scale and shift out of the anchor

    @property
    def pull(self) -> float:
        """The coefficient of (theta - theta^t) in grad R_k (FedNova's a_k)."""

    def load(
        self, context: Context, client: int, anchor: Parameters, content: RecordDict
    ) -> None:
        """Anchor the term at the received model; read the client's state and
        what the training message (`content`) carries for it."""

    def add_gradients(self, named: Parameters) -> None:
        """Add grad R_k(theta) to the parameters' gradients."""

    def save(self, context: Context, client: int, named: Parameters) -> None:
        """Keep the client's state for its next round (after training)."""

    def reply_records(self) -> dict[str, ArrayRecord]:
        """Array records the reply carries for the server (after `save`)."""


class BatchTerm(Protocol):
    """A term of the loss on each batch (MOON's contrastive loss, FedProto's
    prototype distance), added to the data loss before the backward pass, so
    that its gradient flows through the trained model's same forward pass."""

    @classmethod
    def from_settings(cls, settings: Settings) -> BatchTerm:
        """The term with the run's settings (its keys)."""

    def load(
        self,
        context: Context,
        client: int,
        model: nn.Module,
        new_model: Callable[[], nn.Module],
        content: RecordDict,
    ) -> None:
        """Before training: the received `model` (to be trained), the
        client's state, `new_model` (the run's initial model) and what the
        training message's `content` carries for the term."""

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The term on the batch (`inputs`, `targets`) the model has just seen."""

    def save(self, context: Context, client: int, model: nn.Module) -> None:
        """After training: keep the client's state."""

    def reply_records(self) -> dict[str, ArrayRecord]:
        """Array records the reply carries for the server (after `save`)."""

    def close(self) -> None:
        """Let go of what `load` attached to the model (after training)."""


@dataclass(frozen=True)
class AffineGradient:
    """A regulariser's gradient as the cohort trainer applies it to
    parameters stacked over clients (`pollen.task.cohort`), entry by entry:

        grad R_k(theta) = pull (theta - anchor) + offset

    over the anchored entries (`offset` empty: 0). Every built-in term has
    this form; a user's term that offers it (`affine`, and `count_steps`
    for what it counts per step) trains in a cohort too."""

    pull: float
    anchor: dict[str, torch.Tensor]
    offset: dict[str, torch.Tensor]


def _add_gradient(param: nn.Parameter, term: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = term.clone()
    else:
        param.grad.add_(term)


def _anchor_of(named: Parameters) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in named.items()}


@dataclass
class ProxTerm:
    """FedProx's proximal term mu/2 ||theta - theta^t||^2 (Li et al. 2020, eq. 2).

    Its gradient mu (theta - theta^t) pulls a client's steps back towards the
    received model theta^t (`anchor`); it keeps no state between rounds.
    """

    mu: float
    anchor: dict[str, torch.Tensor] = field(default_factory=dict)
    exclude_bn: ClassVar[bool] = False  # BatchNorm's scale and shift are anchored

    @classmethod
    def from_settings(cls, settings: Settings) -> ProxTerm:
        return cls(settings.prox_mu)

    @property
    def pull(self) -> float:
        return self.mu

    def load(
        self, context: Context, client: int, anchor: Parameters, content: RecordDict
    ) -> None:
        self.anchor = _anchor_of(anchor)

    @torch.no_grad()
    def add_gradients(self, named: Parameters) -> None:
        for name, anchor in self.anchor.items():
            param = named[name]
            _add_gradient(param, (param - anchor).mul_(self.mu))

    def affine(self) -> AffineGradient:
        return AffineGradient(self.mu, self.anchor, {})

    def count_steps(self, steps: int) -> None:
        """Nothing counted."""

    def save(self, context: Context, client: int, named: Parameters) -> None:
        """Nothing to keep."""

    def reply_records(self) -> dict[str, ArrayRecord]:
        return {}


@dataclass
class DynTerm:
    """FedDyn's dynamic regulariser (Acar et al. 2021, Algorithm 1):

        R_k(theta) = alpha/2 ||theta - theta^t||^2 - <h_k, theta>,
        grad R_k(theta) = alpha (theta - theta^t) - h_k,

    and, once the round's theta_k^t is trained, h_k <- h_k - alpha (theta_k^t -
    theta^t). h_k is the client's state: zero before its first round, kept in
    `context.state` under `pollen.protocol.feddyn_state_key(client)`.
    """

    alpha: float
    anchor: dict[str, torch.Tensor] = field(default_factory=dict)
    h: dict[str, torch.Tensor] = field(default_factory=dict)
    exclude_bn: bool = True  # anchor no BatchNorm entries (`feddyn-exclude-bn`)

    @classmethod
    def from_settings(cls, settings: Settings) -> DynTerm:
        return cls(settings.dyn_alpha, exclude_bn=settings.feddyn_exclude_bn)

    @property
    def pull(self) -> float:
        return self.alpha

    def load(
        self, context: Context, client: int, anchor: Parameters, content: RecordDict
    ) -> None:
        self.anchor = _anchor_of(anchor)
        stored = context.state.get(feddyn_state_key(client))
        if isinstance(stored, ArrayRecord):
            stored_h = stored.to_torch_state_dict().items()
            self.h = {k: v.to(self.anchor[k].device) for k, v in stored_h}
        else:
            self.h = {name: torch.zeros_like(a) for name, a in self.anchor.items()}

    @torch.no_grad()
    def add_gradients(self, named: Parameters) -> None:
        for name, anchor in self.anchor.items():
            param = named[name]
            _add_gradient(param, (param - anchor).mul_(self.alpha).sub_(self.h[name]))

    def affine(self) -> AffineGradient:
        return AffineGradient(
            self.alpha, self.anchor, {name: -h for name, h in self.h.items()}
        )

    def count_steps(self, steps: int) -> None:
        """Nothing counted."""

    @torch.no_grad()
    def next_h(self, named: Parameters) -> dict[str, torch.Tensor]:
        """h_k - alpha (theta_k - theta^t), on the CPU."""
        return {
            name: (self.h[name] - self.alpha * (named[name] - anchor)).cpu()
            for name, anchor in self.anchor.items()
        }

    def save(self, context: Context, client: int, named: Parameters) -> None:
        context.state[feddyn_state_key(client)] = ArrayRecord(self.next_h(named))

    def reply_records(self) -> dict[str, ArrayRecord]:
        return {}


@dataclass
class ControlTerm:
    """SCAFFOLD's correction (Karimireddy et al. 2020, Algorithm 1, option II,
    https://arxiv.org/abs/1910.06378):

        R_k(theta) = <c - c_k, theta>,   grad R_k = c - c_k,

    so each of the K steps of rate eta is theta <- theta - eta (g_k(theta) +
    c - c_k), plain SGD as the paper runs it (the part's `momentum` default
    is 0); after the round

        c_k^+ = c_k - c + (theta^t - theta_k) / (eta a),

    a = K. With a momentum rho set explicitly the corrected gradient goes
    through SGD's buffer (m <- rho m + g + c - c_k, theta <- theta - eta m)
    and a is FedNova's effective steps a(K, rho), so c_k^+ stays the mean
    data gradient (docs/algorithms.md, "SCAFFOLD and momentum", measured
    against applying the correction outside the buffer). c comes with the
    training message (record `control`), c_k is the client's state under
    `pollen.protocol.scaffold_state_key(client)`; the reply carries Delta
    c_k = c_k^+ - c_k.
    """

    momentum: float
    anchor: dict[str, torch.Tensor] = field(default_factory=dict)
    server: dict[str, torch.Tensor] = field(default_factory=dict)  # c
    own: dict[str, torch.Tensor] = field(default_factory=dict)  # c_k
    correction: dict[str, torch.Tensor] = field(default_factory=dict)  # c - c_k
    lr: float = 0.0
    steps: int = 0
    delta: dict[str, torch.Tensor] = field(default_factory=dict)
    exclude_bn: ClassVar[bool] = False
    pull: ClassVar[float] = 0.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ControlTerm:
        return cls(settings.momentum)

    def load(
        self, context: Context, client: int, anchor: Parameters, content: RecordDict
    ) -> None:
        self.anchor = _anchor_of(anchor)
        control = content.get(CONTROL)
        if not isinstance(control, ArrayRecord) or set(control) != set(self.anchor):
            raise ValueError(
                "local-objective scaffold: the training message lacks the server's "
                f"control variate over {len(self.anchor)} entries (record "
                f"{CONTROL!r}; same settings on both sides?)"
            )
        device = next(iter(self.anchor.values())).device
        self.server = {
            k: v.to(device) for k, v in control.to_torch_state_dict().items()
        }
        stored = context.state.get(scaffold_state_key(client))
        if isinstance(stored, ArrayRecord):
            self.own = {
                k: v.to(device) for k, v in stored.to_torch_state_dict().items()
            }
        else:
            self.own = {k: torch.zeros_like(v) for k, v in self.anchor.items()}
        self.correction = {k: self.server[k] - self.own[k] for k in self.anchor}
        self.lr, self.steps = float(content[CONFIG][LR]), 0

    @torch.no_grad()
    def add_gradients(self, named: Parameters) -> None:
        self.steps += 1
        for name, correction in self.correction.items():
            _add_gradient(named[name], correction)

    def affine(self) -> AffineGradient:
        return AffineGradient(0.0, self.anchor, self.correction)

    def count_steps(self, steps: int) -> None:
        """The steps a cohort took with the correction (`add_gradients`
        counts them one by one)."""
        self.steps += steps

    @torch.no_grad()
    def save(self, context: Context, client: int, named: Parameters) -> None:
        """c_k^+ = c_k - c + (theta^t - theta_k) / (eta a); keep it, and Delta c_k."""
        a = effective_steps(self.steps, self.lr, self.momentum, 0.0)
        mean_gradient = {
            name: (anchor - named[name]) / (self.lr * a)
            if a
            else torch.zeros_like(anchor)
            for name, anchor in self.anchor.items()
        }
        self.delta = {
            name: (mean_gradient[name] - self.server[name]).cpu()
            for name in self.anchor
        }
        own = {name: self.own[name].cpu() + self.delta[name] for name in self.anchor}
        context.state[scaffold_state_key(client)] = ArrayRecord(own)

    def reply_records(self) -> dict[str, ArrayRecord]:
        return {CONTROL: ArrayRecord(self.delta)}


def diverged(model: nn.Module) -> bool:
    """Whether training left a floating entry of `model` (a parameter or a
    running statistic) NaN or infinite."""
    return not all(
        torch.isfinite(value).all()
        for value in model.state_dict().values()
        if value.is_floating_point()
    )


@contextmanager
def frozen_bn_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm normalises with batch statistics but updates no running ones.

    Used for SAM's perturbed pass, so only the clean pass moves the running
    mean, variance and counter.
    """
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    tracking = [m.track_running_stats for m in norms]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m, was in zip(norms, tracking, strict=True):
            m.track_running_stats = was


def sam_perturb(params: list[nn.Parameter], rho: float) -> list[torch.Tensor]:
    """Move to theta + rho g / (||g|| + 1e-12) (g: the current gradients); return eps."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    scale = rho / (norm + 1e-12)
    eps = [g * scale for g in grads]
    with torch.no_grad():
        torch._foreach_add_(params, eps)
    return eps


@dataclass
class LocalObjective:
    """One client's objective for one round: SAM's radius (0: no SAM) and
    its regulariser, anchored at the received model by `load`.

    The training loop calls three hooks per step: `batch_loss`, added to
    the data loss of the forward pass (MOON's and FedProto's terms; None for the others),
    `data_gradient` after the clean backward pass (SAM takes the gradient
    again at theta + eps) and `add_regularizer_gradient` just before the
    step (after DP-SGD's clipping and noise: the term touches no example, so
    it costs no privacy).
    """

    sam_rho: float = 0.0
    regularizer: Regularizer | None = None
    batch_term: BatchTerm | None = None
    # log n_c per class: the data loss is the balanced softmax (FedRoD's)
    log_label_counts: torch.Tensor | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalObjective:
        """The objective `local-objective` names: its part says whether SAM
        takes the data gradient and which terms (if any) it adds."""
        part = extensions.part("local-objective", settings.local_objective).load()
        term = load(part.term).from_settings(settings) if part.term else None
        batch_term = getattr(part, "batch_term", "")
        on_batch = load(batch_term).from_settings(settings) if batch_term else None
        return cls(settings.sam_rho if part.sam else 0.0, term, on_batch)

    def load(
        self,
        context: Context,
        client: int,
        model: nn.Module,
        sharing: Sharing,
        content: RecordDict,
        new_model: Callable[[], nn.Module] | None = None,
    ) -> None:
        """Anchor the regulariser at `model` as received (before training)
        and read the state the client kept for it and what the training
        message's `content` carries for it; a batch term also gets the
        run's initial model from `new_model`."""
        if self.batch_term is not None:
            if new_model is None:
                raise ValueError("a batch term needs the run's initial model")
            self.batch_term.load(context, client, model, new_model, content)
        if self.regularizer is None:
            return
        names = sharing.trained_shared(exclude_bn=self.regularizer.exclude_bn)
        params = dict(model.named_parameters())
        anchor = {name: params[name] for name in names}
        self.regularizer.load(context, client, anchor, content)

    def reply_records(self) -> dict[str, ArrayRecord]:
        """What the reply carries for the server beside the model (after `save`)."""
        return {
            **(self.regularizer.reply_records() if self.regularizer else {}),
            **(self.batch_term.reply_records() if self.batch_term else {}),
        }

    def save(self, context: Context, client: int, model: nn.Module) -> None:
        """Keep the regulariser's state for the client's next round (after
        training); not after a training that `diverged`: the server drops
        that reply, and state computed from it (FedDyn's h_k, SCAFFOLD's c_k)
        would make every later round of the client non-finite too."""
        if self.batch_term is not None:
            if not diverged(model):
                self.batch_term.save(context, client, model)
            self.batch_term.close()
        if self.regularizer is not None and not diverged(model):
            self.regularizer.save(context, client, dict(model.named_parameters()))

    def data_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean data loss: the cross-entropy, or with
        `log_label_counts` the balanced softmax (Ren et al. 2020,
        https://arxiv.org/abs/2007.10740), the cross-entropy of
        logits + log n_c, whose minimiser under the client's label shift is
        the class-balanced one."""
        if self.log_label_counts is not None:
            logits = logits + self.log_label_counts
        return F.cross_entropy(logits, targets)

    def batch_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        """The batch term on (`inputs`, `targets`), just after the model's
        forward pass of them; None without one."""
        if self.batch_term is None:
            return None
        return self.batch_term.loss(inputs, targets)

    def data_gradient(
        self, model: nn.Module, params: list[nn.Parameter], regrade: Callable[[], None]
    ) -> None:
        """After the clean pass: with SAM, replace the gradients by those at
        theta + eps (`regrade` zeroes them and backpropagates the same batch
        again), with BatchNorm statistics frozen, and restore theta."""
        if self.sam_rho <= 0:
            return
        eps = sam_perturb(params, self.sam_rho)
        with frozen_bn_statistics(model):
            regrade()
        with torch.no_grad():
            torch._foreach_sub_(params, eps)

    @property
    def pull(self) -> float:
        """The regulariser's pull towards the received model (0 without one)."""
        return self.regularizer.pull if self.regularizer is not None else 0.0

    def add_regularizer_gradient(self, named: Parameters) -> None:
        """Add grad R_k(theta) (nothing for `plain` and `sam`)."""
        if self.regularizer is not None:
            self.regularizer.add_gradients(named)

"""`pollen audit`: what a curious server can rebuild of a client's examples.

The server's view of one round (`server_view`) is attacked (`inversion`)
and each reconstruction is scored against the example it rebuilt, in pixel
space (`images`: PSNR and SSIM). The audit writes `audit.json` (the
configuration, what the server saw, each image's scores, the time) and
`audit.png` (the originals above their reconstructions) to its output
folder, and prints one line per image.

Where the server sees a sum over k clients (SecAgg+), the attack rebuilds
k x `examples` images from it and each of the audited client's examples is
scored against its best-matching reconstruction (`images.pair_up`): the
most favourable reading for the attacker, said so in the output.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..deployment.run_config import config_string, resolve_settings
from ..files import write_json
from ..runs.checkpoints import load_checkpoint
from ..settings import Settings
from . import AuditError
from .images import pair_up, psnr, ssim, write_picture
from .inversion import ATTACKS, reconstruct
from .server_view import ServerView, server_view

# Optimiser iterations by default: L-BFGS's for DLG and iDLG (each up to 1.25
# evaluations), Adam's for Inverting Gradients (Geiping et al. ran 4,800
# for CIFAR-10; a few thousand suffice on MNIST-size models).
ITERATIONS = {"dlg": 300, "idlg": 300, "ig": 2000}


@dataclass(frozen=True)
class AuditRequest:
    """What `pollen audit` was asked (its flags)."""

    attack: str = "ig"
    client: int | None = None
    examples: int = 1
    iterations: int | None = None
    restarts: int = 1
    seed: int = 0
    start: Path | None = None  # a run directory: audit the round after its checkpoint
    out: Path | None = None

    def check(self) -> None:
        """Refuse bad flags before any data is read."""
        if self.attack not in ATTACKS:
            raise AuditError(
                f"--attack {self.attack!r} is not one of {', '.join(ATTACKS)}"
            )
        for flag, value, least in (
            ("--examples", self.examples, 1), ("--restarts", self.restarts, 1),
            ("--iterations", self.iterations or 1, 1), ("--client", self.client or 0, 0),
        ):  # fmt: skip
            if value < least:
                raise AuditError(f"{flag} must be at least {least}, not {value}")
        if self.out is not None:
            _check_out(self.out)


def run_audit(app: Path, overrides: Sequence[str], request: AuditRequest) -> Path:
    """`pollen audit`: validate, attack, score, write; the output folder,
    created only once there is something to write in it."""
    request.check()
    checkpoint = None
    if request.start is not None:  # the run as it was, then any -c on top
        checkpoint = load_checkpoint(request.start)
        recorded = Settings.from_run_config(checkpoint.extra["settings"])
        overrides = [config_string(recorded), *overrides]
    settings = resolve_settings(app, overrides)
    out = request.out or Path(settings.output_dir) / _default_name(settings, request)
    _check_out(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model's steps: 50x faster than two threads here
    try:
        with tempfile.TemporaryDirectory(prefix="pollen-audit-") as workdir:
            view = server_view(
                settings, client=request.client, examples=request.examples,
                workdir=Path(workdir), checkpoint=checkpoint,
                client_app=client_app_reference(app),
            )  # fmt: skip
        print(f"pollen audit: round {view.round}, the server sees {view.sees}",
              flush=True)  # fmt: skip
        report, picture = audit(view, request)
    finally:  # a Python caller's process keeps its own
        torch.set_num_threads(threads)
    report["settings"] = settings.to_run_config()
    out.mkdir(parents=True, exist_ok=True)
    picture(out / "audit.png")
    write_json(out / "audit.json", report)
    for line in _lines(report):
        print(line, flush=True)
    print(f"pollen audit: picture and numbers in {out}", flush=True)
    return out


def client_app_reference(app: Path) -> str:
    """The ClientApp the app names (`[tool.flwr.app.components] clientapp`
    in its pyproject.toml), as Flower loads it."""
    from flwr.common.config import get_project_config

    try:
        return str(get_project_config(app)["tool"]["flwr"]["app"]["components"]
                   ["clientapp"])  # fmt: skip
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise AuditError(
            f"{app} names no ClientApp ([tool.flwr.app.components] clientapp "
            f"in its pyproject.toml): {err}"
        ) from err


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise AuditError(f"--out {out} is a file; name a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise AuditError(f"{out} is not empty; name a new folder with --out")


def audit(
    view: ServerView, request: AuditRequest
) -> tuple[dict[str, Any], Callable[[Path], None]]:
    """Attack `view` and score each of the client's examples: the numbers
    (what `audit.json` holds but the settings) and what draws them."""
    mean = torch.tensor(view.mean).view(1, -1, 1, 1)
    std = torch.tensor(view.std).view(1, -1, 1, 1)
    box = (float((-mean / std).min()), float(((1 - mean) / std).max()))
    count = len(view.originals) * len(view.clients)
    if all(not update.any() for update in view.observed.values()):
        raise AuditError(
            f"the server receives an update of zeros ({view.sees}): nothing to "
            "rebuild (FedSA's A matrices do not move in a client's first step, "
            "while B is zero: audit more local steps or a later round)"
        )
    started = time.perf_counter()
    try:
        found = reconstruct(
            request.attack, view.model, view.observed, count=count,
            input_shape=tuple(view.originals.shape[1:]), training=view.training,
            box=box, iterations=request.iterations or ITERATIONS[request.attack],
            seed=request.seed, restarts=request.restarts,
        )  # fmt: skip
    except ValueError as err:  # what this view does not allow, e.g. no output layer
        raise AuditError(f"--attack {request.attack}: {err}") from err
    seconds = time.perf_counter() - started
    originals = view.originals.float() / 255
    rebuilt = (found.images * std + mean).clamp(0, 1)
    match = pair_up(originals, rebuilt)
    images = [
        {
            "label": int(view.labels[i]),
            "reconstructed-label": int(found.labels[j]),
            "psnr": psnr(originals[i], rebuilt[j]),
            "ssim": ssim(originals[i], rebuilt[j]),
        }
        for i, j in enumerate(match)
    ]
    captions = [f"PSNR {m['psnr']:.1f} / SSIM {m['ssim']:.2f}" for m in images]
    picture = partial(
        write_picture, originals=originals, reconstructions=rebuilt[match],
        captions=captions,
    )  # fmt: skip
    return {
        "attack": request.attack,
        "round": view.round,
        "clients": list(view.clients),
        "sees": view.sees,
        "local-steps": view.training.steps,
        "lr": view.training.lr,
        "batch-size": view.training.batch_size,
        "reconstructed": count,
        "paired": "best match among the reconstructions" if count > len(match) else
                  "in order",
        "images": images,
        "seconds": round(seconds, 2),
        "seconds-per-image": round(seconds / count, 2),
        "loss": found.loss,
        "iterations": found.iterations,
    }, picture  # fmt: skip


def _default_name(settings: Settings, request: AuditRequest) -> str:
    who = "first" if request.client is None else str(request.client)
    return f"audit-{settings.data_set}-{settings.model}-{request.attack}-client-{who}"


def _lines(report: dict[str, Any]) -> list[str]:
    return [
        f"  image {i}: label {m['label']} (attack's {m['reconstructed-label']}), "
        f"PSNR {m['psnr']:.2f} dB, SSIM {m['ssim']:.3f}"
        for i, m in enumerate(report["images"])
    ] + [f"pollen audit: {report['seconds']:.1f} s ({report['seconds-per-image']:.1f} "
         f"s per image reconstructed)"]  # fmt: skip

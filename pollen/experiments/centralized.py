"""The centralised baseline: the run's model, data and client optimiser
trained on the whole training set in one process, without federation.

`pollen centralized [APP] -c ...` reads the same run config as `pollen run`,
so a preset gives the federated runs' data set, model, optimiser, learning
rate, batch size, preprocessing and seed. It trains for `--epochs` (default
`rounds` x `local-epochs`: as many passes over the data as each client makes
over its shard), with one optimiser throughout and a constant learning rate,
evaluates on the test set after every epoch, and writes a run directory like
`pollen run`'s: `settings.json` (strategy `centralized`, plus the epochs),
`history.json`/`.csv` (a row per epoch, no bytes), `summary.json`,
`curves.png` and `model.pt`. `pollen report` puts it beside federated runs.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..deployment.run_config import (
    RunConfigError,
    check_local_device,
    pin_paths,
    resolve_settings,
)
from ..extensions import data_set_info
from ..files import write_atomic, write_json
from ..runs.results import (
    RoundRecord,
    check_run_dir_is_new,
    create_run_dir,
    default_run_name,
    plot_curves,
    summarize,
    write_history,
)
from ..settings import Settings
from ..task.data import load_dataset
from ..task.inputs import placed_model, settings_model
from ..task.train import ClientOptimizer, Preprocess, evaluate, pick_device, train_local

STRATEGY = "centralized"


def run_centralized(app: Path, overrides: Sequence[str], epochs: int | None) -> None:
    """`pollen centralized`: validate the run config as `pollen run` does,
    train for `epochs` (default `rounds` x `local-epochs`) and say where the
    results are."""
    settings = resolve_settings(app, overrides)
    if settings.resume:
        raise RunConfigError("a centralised run cannot resume; leave out resume")
    if epochs is not None and epochs < 1:
        raise RunConfigError(f"--epochs must be at least 1, got {epochs}")
    check_local_device(settings.device)
    settings = pin_paths(settings, STRATEGY)
    check_run_dir_is_new(settings.output_dir, settings.run_name)
    epochs = epochs or settings.rounds * settings.local_epochs
    run_dir, summary = train_centrally(settings, epochs)
    print(f"pollen: centralised {epochs} epochs: final accuracy "
          f"{100 * summary['final-accuracy']:.2f}%, {summary['total-seconds']:.1f} s")  # fmt: skip
    print(f"pollen: results in {run_dir}")


def train_centrally(
    settings: Settings, epochs: int, echo: Callable[[str], None] = print
) -> tuple[Path, dict[str, object]]:
    """Train and write the run directory; its path and summary."""
    _check_poolable(settings.data_set)
    started = time.monotonic()
    dataset = load_dataset(settings.data_set, settings.data_root, settings.download)
    device = pick_device(settings.device)
    model = placed_model(settings, settings_model(settings, dataset), device)
    x_train, y_train = dataset.x_train.to(device), dataset.y_train.to(device)
    x_test, y_test = dataset.x_test.to(device), dataset.y_test.to(device)
    train_inputs = Preprocess(dataset.mean, dataset.std, settings.normalize,
                              settings.augment and dataset.augmentable, device=device)  # fmt: skip
    test_inputs = Preprocess(
        dataset.mean, dataset.std, settings.normalize, device=device
    )
    run_dir = _new_run_dir(settings, epochs)
    echo(f"pollen: {dataset.name}: {len(y_train)} train / {len(y_test)} test, "
         f"{settings.model}, {epochs} epochs, results in {run_dir}")  # fmt: skip
    history: list[RoundRecord] = []
    epoch_started = time.monotonic()

    def after_epoch(epoch: int) -> None:
        nonlocal epoch_started
        loss, accuracy = evaluate(model, x_test, y_test,
                                  batch_size=settings.test_batch_size,
                                  preprocess=test_inputs)  # fmt: skip
        seconds = time.monotonic() - epoch_started
        history.append(RoundRecord(epoch, accuracy, loss, settings.lr, seconds, 0, 0))
        write_history(run_dir, history)
        echo(
            f"[{epoch:02d}] acc={100 * accuracy:.2f}%, loss={loss:.6f}, {seconds:.2f} s"
        )
        epoch_started = time.monotonic()

    optimizer = ClientOptimizer(settings.client_optimizer, settings.lr, settings.momentum,
                                settings.weight_decay, settings.client_betas)  # fmt: skip
    train_local(
        model, x_train, y_train, epochs=epochs, batch_size=settings.batch_size,
        optimizer=optimizer, preprocess=train_inputs, seed=settings.seed,
        max_grad_norm=settings.max_grad_norm, after_epoch=after_epoch,
    )  # fmt: skip
    summary = summarize(history, "completed", time.monotonic() - started)
    write_json(run_dir / "summary.json", summary)
    _save_model(model, run_dir / "model.pt")
    title = f"centralised {settings.model} on {dataset.name}"
    plot_curves(history, run_dir / "curves.png", title, xlabel="epoch")
    return run_dir, summary


def _check_poolable(data_set: str) -> None:
    """Refuse a data set whose examples are generated where each client
    trains: there is no whole training set to train on."""
    if data_set_info(data_set).generated:
        raise RunConfigError(
            f"data-set={data_set!r} has no centralised baseline: its "
            "examples are generated per client where the client trains, never "
            "pooled; use an image data set"
        )


def _new_run_dir(settings: Settings, epochs: int) -> Path:
    """The run directory, made, with its `settings.json`: the run config as
    `pollen run` records it, strategy `centralized`, and the epochs."""
    run_name = settings.run_name or default_run_name(STRATEGY, settings.data_set)
    run_dir = create_run_dir(settings.output_dir, run_name)
    write_json(run_dir / "settings.json", {
        **settings.to_run_config(), "strategy": STRATEGY, "run-name": run_name,
        "centralized-epochs": epochs,
    })  # fmt: skip
    return run_dir


def _save_model(model: torch.nn.Module, path: Path) -> None:
    """The trained weights (`state_dict`) at `path`, written atomically."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    write_atomic(path, buffer.getvalue())

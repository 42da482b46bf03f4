"""What the server loads before its first round, and what the console says.

The data set (decoded once, cached on disk) with its partition, described
on the console and, for an image data set, as the clients' label counts
(labels.png); the model, described by its parameter counts (and refused
early where DP-SGD cannot train it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..settings import Settings
from ..task.data import Dataset
from ..task.inputs import settings_model
from ..task.lora import FrozenBackboneClassifier
from ..task.partition import format_label_counts
from ..task.privacy import check_private_model
from ..task.shards import ServerData, server_data
from ..task.sharing import count_parameters
from .results import plot_label_heatmap


def load_data(settings: Settings, run_dir: Path) -> ServerData:
    """The run's data set, partition and shard sizes, described."""
    data = server_data(settings)
    _describe_data(settings, data, run_dir)
    return data


def _describe_data(settings: Settings, data: ServerData, run_dir: Path) -> None:
    """The console's data line and, for an image data set, the clients'
    label counts (labels.png; printed with print-labels)."""
    dataset, counts = data.dataset, data.label_counts
    if counts is None:  # generated: the examples exist only where clients train
        print(
            f"pollen: {dataset.name}: {dataset.source}, {settings.num_clients} "
            f"clients ({settings.partition}), {sum(data.sizes)} training samples, "
            f"{len(dataset.y_test)} test samples of the first clients",
            flush=True,
        )
        return
    print(
        f"pollen: {dataset.name} from {dataset.source}: {len(dataset.y_train)} train / "
        f"{len(dataset.y_test)} test, {settings.num_clients} clients "
        f"({settings.partition}), {int(counts.sum())} training samples used",
        flush=True,
    )
    if settings.print_labels:
        print(format_label_counts(counts), flush=True)
    plot_label_heatmap(
        counts,
        run_dir / "labels.png",
        f"{dataset.name}: {settings.partition} partition",
    )


def load_model(settings: Settings, dataset: Dataset) -> torch.nn.Module:
    """The run's model, described on the console (and checked for DP-SGD)."""
    model = settings_model(settings, dataset)
    print(_model_line(settings, model), flush=True)
    if settings.sharing != "all":
        kept = "every" if settings.sharing == "local" else "every other"
        print(
            f"pollen: sharing {settings.sharing} keeps {kept} trained entry on "
            "the clients; the global model's accuracy below uses their initial "
            "values, the personal-model lines are the ones to read",
            flush=True,
        )
    if settings.dp:
        check_private_model(model, settings.model)
    return model


def _model_line(settings: Settings, model: torch.nn.Module) -> str:
    """The console's model line: parameter counts (LoRA's, a frozen backbone's source)."""
    counts = count_parameters(model)
    line = (
        f"pollen: model {settings.model}: {counts['total']:,} parameters, "
        f"{counts['trainable']:,} trainable"
    )
    if counts["lora-a"]:
        line += f", LoRA A {counts['lora-a']:,}, LoRA B {counts['lora-b']:,}"
    if isinstance(model, FrozenBackboneClassifier):
        line += f"; backbone weights: {model.source}"
    return line

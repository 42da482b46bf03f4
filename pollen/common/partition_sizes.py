"""What a partition of N training examples can give: arithmetic on known numbers.

`Settings` refuses an impossible split (`split_problem`: too many clients,
an impossible `min-size`, more classes per client than the data set has)
before any data is read or any process starts; `task/partition.py` raises
the same error when a partition it draws cannot be made.
"""

from __future__ import annotations

from ..catalog import DataSetInfo


class PartitionError(ValueError):
    """A partition the data cannot give; the message names the key to change."""


def check_min_size(scheme: str, num_clients: int, min_size: int, examples: int) -> None:
    """Refuse a `min-size` that `examples` training samples cannot give every
    client, by arithmetic alone (before any data is read): `niid` redraws
    until each of `num_clients` clients has `min_size` samples, which never
    ends when num_clients x min_size exceeds the split; `niid-client` deals
    equal shards of examples // num_clients samples."""
    if scheme == "niid" and num_clients * min_size > examples:
        raise PartitionError(
            f"invalid value for 'min-size': {min_size}; partition 'niid' needs "
            f"num-clients x min-size = {num_clients:,} x {min_size} = "
            f"{num_clients * min_size:,} samples, the training split has "
            f"{examples:,}; allowed: min-size at most {examples // num_clients}, "
            "or fewer clients"
        )
    size = examples // num_clients
    if scheme == "niid-client" and size < max(min_size, 1):
        raise PartitionError(
            f"invalid value for 'min-size': {min_size}; partition 'niid-client' "
            f"gives each of {num_clients:,} clients {size} samples; lower min-size "
            "or use fewer clients"
        )


def split_problem(
    data_set: DataSetInfo,
    scheme: str,
    num_clients: int,
    min_size: int,
    classes_per_client: int,
) -> str | None:
    """Why `data_set` cannot be split by `scheme` among `num_clients`, or None."""
    name = data_set.name
    if data_set.generated != (scheme == "natural"):
        return (
            f"partition={scheme!r} with data-set={name!r}: a generated data set "
            "(synthetic) is split by its generator, each client its own task, "
            "and only it; allowed: partition='natural' (or 'auto') with "
            "synthetic, any other with an image data set"
        )
    examples = data_set.train_examples
    if data_set.generated and num_clients > examples:
        return (
            f"num-clients={num_clients} with data-set={name!r}; allowed: 1 to "
            f"{examples:,}"
        )
    if num_clients > examples:
        return (
            f"num-clients={num_clients} with data-set={name!r}, whose training "
            f"split has {examples:,} examples: every client needs at least one; "
            f"allowed: 1 to {examples}"
        )
    try:
        check_min_size(scheme, num_clients, min_size, examples)
    except PartitionError as err:
        return f"{err} (data-set={name!r})"
    if scheme == "silos" and num_clients > data_set.classes:
        return (
            f"num-clients={num_clients} with partition='silos' and data-set={name!r}: "
            f"silos give each client whole classes, so at most {data_set.classes} "
            "clients"
        )
    if scheme == "pathological" and classes_per_client > data_set.classes:
        return (
            f"classes-per-client={classes_per_client} with data-set={name!r}, "
            f"which has {data_set.classes} classes; allowed: 1 to {data_set.classes}"
        )
    return None

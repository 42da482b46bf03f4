"""What a partition of N training examples can give: arithmetic on known numbers.

`Settings` refuses an impossible `min-size` before any data is read or any
process starts; `task/partition.py` raises the same error when a partition
it draws cannot be made.
"""

from __future__ import annotations


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

"""`pollen supernode`: Flower's SuperNode with its idle waits shortened and
its wait for a reply that no task will write ended (`pollen.flower_waits`);
every flag `flower-supernode` takes is passed on."""

from __future__ import annotations

from collections.abc import Sequence

from ..flower_waits import (
    add_poll_interval,
    end_reply_waits_without_task,
    shorten_supernode_waits,
)
from .flower import hand_over, wrapper_parser


def main(argv: Sequence[str]) -> int:
    parser = wrapper_parser(
        "supernode", "Flower's SuperNode with its idle waits at the poll interval"
    )
    add_poll_interval(parser)
    args, flower_args = parser.parse_known_args(argv)
    end_reply_waits_without_task()
    if args.poll_interval:
        shorten_supernode_waits(args.poll_interval)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    return hand_over("supernode", flower_args, flower_supernode)

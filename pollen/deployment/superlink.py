"""`pollen superlink`: Flower's SuperLink whose Fleet API holds a node's pull
until a message for it exists (`pollen.deployment.long_poll`); every flag
`flower-superlink` takes is passed on."""

from __future__ import annotations

from collections.abc import Sequence

from .flower import hand_over, wrapper_parser
from .long_poll import add_pull_hold, hold_fleet_pulls


def main(argv: Sequence[str]) -> int:
    parser = wrapper_parser(
        "superlink", "Flower's SuperLink with a held (long-poll) Fleet pull"
    )
    add_pull_hold(parser)
    args, flower_args = parser.parse_known_args(argv)
    if args.pull_hold:
        hold_fleet_pulls(args.pull_hold)
    from flwr.superlink.cli.flower_superlink import flower_superlink

    return hand_over("superlink", flower_args, flower_superlink)

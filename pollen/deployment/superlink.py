"""`pollen superlink`: Flower's SuperLink whose Fleet API holds a node's pull
until a message for it exists (`pollen.deployment.long_poll`); every flag
`flower-superlink` takes is passed on."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .long_poll import add_pull_hold, hold_fleet_pulls


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pollen superlink",
        description="Flower's SuperLink with a held (long-poll) Fleet pull; every "
        "flag `flower-superlink` takes is passed on.",
        allow_abbrev=False,  # `--port` and the like are flower-superlink's
    )
    add_pull_hold(parser)
    args, flower_args = parser.parse_known_args(argv)
    if args.pull_hold:
        hold_fleet_pulls(args.pull_hold)
    from flwr.superlink.cli.flower_superlink import flower_superlink

    sys.argv = ["flower-superlink", *flower_args]
    flower_superlink()
    return 0

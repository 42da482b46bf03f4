"""`flower-superexec` as pollen starts it: Flower's own entry point with every
flag unchanged, its task poll on a `PollClock`
(`pollen.flower_waits.shorten_superexec_polls`).

A SuperExec asks its SuperNode (for ClientApps) or its SuperLink (for
ServerApps and simulations) for a task at a fixed interval. Flower's 1 s is
added to every message a node receives; the fixed 0.1 s pollen used before
cost an idle SuperLink 10 % of a core and each SuperNode 5 %, all through a
run (each poll is an HTTP request that the asked process spends milliseconds
of CPU on; docs/lab-notes/deployment.md). On the clock a SuperExec polls 0.1 s just
after it launched a task, then every 5 % of the time since, never slower
than Flower's interval (or FLWR_SUPEREXEC_TASK_POLL_INTERVAL, when set).

The SuperExecs that a SuperLink and a SuperNode start themselves are found
on PATH by the name `flower-superexec`: pollen puts a shim by that name
first on the PATH of the Flower processes it starts (`entry_shims`);
`pollen superexec` runs this module directly. Where the installed Flower is
not a release this was tested with, Flower's code runs unchanged at a fixed
0.1 s, with one warning line.
"""

from __future__ import annotations

import os
import sys

from ..flower_waits import POLL_SECONDS, shorten_superexec_polls

COMMAND = "flower-superexec"
FLOWER_ENTRY = "flwr.supercore.cli.flower_superexec:flower_superexec"
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"


def main() -> None:
    if not shorten_superexec_polls():
        os.environ.setdefault(TASK_POLL_ENV, str(POLL_SECONDS))
    from flwr.supercore.cli.flower_superexec import flower_superexec

    flower_superexec()


def command() -> list[str]:
    """The command line that runs `main` with this Python."""
    return [sys.executable, "-m", __name__]


if __name__ == "__main__":
    main()

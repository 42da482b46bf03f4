"""Rounds of one tiny message per SuperNode, for benchmarks/superlink_load.py.

The ServerApp waits until `nodes` SuperNodes are online, then plays `rounds`
rounds: it pushes one message with an empty RecordDict to every node
(`grid.push_messages`) and pulls replies every 0.05 s (`grid.pull_messages`;
not `send_and_receive`, which waits 3 s between its pulls) until every node
has answered. Per round it records its start and end (Unix seconds), its
wall seconds and its own CPU seconds (`time.process_time`), and writes the
list as JSON to the run config's `out`. The benchmark's emulated nodes
answer without a ClientApp; the echo below is there because a Flower app
must name one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

PULL_SECONDS = 0.05

client = ClientApp()
server = ServerApp()


@client.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict(), reply_to=msg)


def quick_object_pulls() -> None:
    """A reply is listed before its node has pushed its objects; Flower's
    grid then waits 1 s before pulling them again. pollen's ServerApp retries
    after its poll interval (here 0.05 s); without pollen, Flower's waits."""
    try:
        from pollen.flower_waits import shorten_serverapp_pulls
    except ImportError:
        return
    shorten_serverapp_pulls(PULL_SECONDS)


def wait_for_nodes(grid: Grid, count: int) -> list[int]:
    while len(nodes := sorted(grid.get_node_ids())) < count:
        time.sleep(0.2)
    return nodes


def play_round(grid: Grid, nodes: list[int]) -> dict[str, float]:
    started, cpu = time.time(), time.process_time()
    messages = [
        Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes
    ]
    waiting = {i for i in grid.push_messages(messages) if i}
    pushed = time.time()
    replies = failed = 0
    while waiting:
        time.sleep(PULL_SECONDS)
        for reply in grid.pull_messages(list(waiting)):
            waiting.discard(reply.metadata.reply_to_message_id)
            replies += 1
            failed += reply.has_error()
    ended = time.time()
    return {
        "start": started, "end": ended, "seconds": ended - started,
        "push": pushed - started, "cpu": time.process_time() - cpu, "replies": replies, "errors": failed,
    }  # fmt: skip


@server.main()
def main(grid: Grid, context: Context) -> None:
    quick_object_pulls()
    nodes = wait_for_nodes(grid, int(context.run_config["nodes"]))
    rounds = [play_round(grid, nodes) for _ in range(int(context.run_config["rounds"]))]
    out = Path(str(context.run_config["out"]))
    out.with_suffix(".tmp").write_text(json.dumps(rounds))
    out.with_suffix(".tmp").replace(out)

"""A Flower round with no work, for Flower's maintainers: each round sends
every connected SuperNode one message carrying `megabytes` of float32
zeros; the ClientApp sends it straight back. The ServerApp prints each
round's seconds. Nothing here is pollen's; see run.sh for the commands.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    nodes: list[int] = []
    while len(nodes) < 2:
        nodes = list(grid.get_node_ids())
        time.sleep(0.5)
    size = int(float(context.run_config["megabytes"]) * 2**20 / 4)
    arrays = ArrayRecord([np.zeros(size, np.float32)])
    for round_ in range(1, int(context.run_config["rounds"]) + 1):
        started = time.monotonic()
        messages = [
            Message(
                RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train"
            )
            for node in nodes
        ]
        replies = list(grid.send_and_receive(messages))
        ok = sum(reply.has_content() for reply in replies)
        print(f"round {round_}: {time.monotonic() - started:.2f} s, "
              f"{ok} of {len(nodes)} replies", flush=True)  # fmt: skip

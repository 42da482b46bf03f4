"""The ClientApp Flower loads (`pollen.client_app:app`): a handler per
message type, each doing its work in `pollen.client`, imported with torch
when the first message arrives.

Why not on import: a simulation loads the ClientApp in its own process, only
to check that it loads, before it starts Ray; importing torch there held
Ray's start back by the length of that import (docs/performance.md). A
ClientApp actor or SuperNode imports `pollen.client` on its first message
either way.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which partition this node holds: `pollen.client.query`."""
    from . import client

    return client.query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The local objective on this client's shard: `pollen.client.train`."""
    from . import client

    return client.train(msg, context)


@app.evaluate()
def evaluate_personal(msg: Message, context: Context) -> Message:
    """This client's own model on its test data:
    `pollen.client.evaluate_personal`."""
    from . import client

    return client.evaluate_personal(msg, context)

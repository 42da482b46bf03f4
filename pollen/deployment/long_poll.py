"""A long-poll for Flower's Fleet API: the SuperLink holds a node's pull until
a message for it exists, instead of the node asking again and again.

Flower 1.42's SuperNode asks its SuperLink for a message, and sleeps 3 s
when there is none; `pollen supernode` asks again sooner after a message
(`pollen.flower_waits.PollClock`) so a round's next message is picked up
at once. Every ask costs the SuperLink about 9 ms of CPU here (FastAPI
middleware, TLS, the node's signature check), so fast asking trades the
SuperLink's load for pickup speed, and at a few dozen nodes the load wins.

`pollen superlink` (`hold_fleet_pulls`) keeps both: a pull that finds no
message for a node whose previous pull found none either, and for which
nothing was pushed since, is held (without a thread) until the ServerApp
pushes a message for that node or `--pull-hold` seconds pass; then it
runs as Flower's handler. The node's next message therefore reaches it
as soon as it is pushed, and an idle node costs one request per hold
(20 s) instead of one per 3 s. A node whose last pull found something,
one the SuperLink has not seen yet (a restarted SuperLink), and one asking
for given messages are answered at once, so nothing is ever held that
might be there already:

    news[node]     pushes of the ServerApp that named the node (counted when
                   the push's handler returned: the messages are stored)
    quiet_at[node] news[node] as read before the node's last pull that
                   found nothing
    hold a pull    while news[node] == quiet_at[node]

A push that is stored while a pull reads the state makes `news` differ
from the count that pull records, so the node's next pull is not held.

The wait is a middleware inside Flower's own (after the protobuf
translation and the node's authentication), so the request it holds is
one Flower has parsed and authenticated, and the answer is Flower's
handler's. A SuperLink told to stop (SIGTERM, SIGINT) lets every held
pull go at once, so it stops as quickly as Flower's own. Flower's own
SuperNode works with it unchanged: its HTTP client waits 30 s for an
answer, more than the hold.

The upstream change it stands for: a held pull in the Fleet API's
`pull-messages` (Flower has no push, streaming or long-poll mode for
SuperNodes in 1.42 or the 1.43 nightly).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from typing import Any

from ..flower_patches import SUPERLINK_LONG_POLL, guard

PULL_HOLD_SECONDS = 20.0
# Flower's SuperNode gives up on an answer after 30 s (its HTTP client's
# timeout) and retries: a hold must end well before.
MAX_PULL_HOLD_SECONDS = 25.0
FLEET_PULL = "/v1/fleet/pull-messages"
RUNTIME_PUSH = "/v1/runtime/push-messages"
RUNTIME_PUSH_OBJECT = "/v1/runtime/push-object"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class NodeBoard:
    """What the SuperLink knows, per node, about whether a pull would find
    anything: the ServerApp's pushes that named it, and the count at its
    last pull that found nothing; and the pulls held for it. Used only on
    the server's event loop (no locks)."""

    def __init__(self) -> None:
        self.news: dict[int, int] = {}
        self.quiet_at: dict[int, int] = {}
        self.held: dict[int, set[asyncio.Event]] = {}
        # node -> objects of its stored messages that are not pushed yet
        self.missing: dict[int, set[str]] = {}
        self.closing = False

    def count(self, node: int) -> int:
        return self.news.get(node, 0)

    def found_nothing(self, node: int, count: int) -> None:
        """A pull by `node`, which began when `count` pushes had named it,
        found no message."""
        self.quiet_at[node] = count

    def is_quiet(self, node: int) -> bool:
        """Whether a pull by `node` now would find nothing: its last one
        found nothing, and nothing was pushed for it since."""
        return not self.closing and self.quiet_at.get(node) == self.count(node)

    async def hold(self, node: int, seconds: float) -> None:
        """Wait until a message is pushed for `node`, `seconds` pass, or the
        server stops."""
        news = asyncio.Event()
        self.held.setdefault(node, set()).add(news)
        try:
            await asyncio.wait_for(news.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            waiting = self.held.get(node)
            if waiting is not None:
                waiting.discard(news)
                if not waiting:
                    del self.held[node]

    def announce(self, nodes: Iterable[int]) -> None:
        """Messages for `nodes` were stored: their held pulls go on."""
        for node in set(nodes):
            self.news[node] = self.count(node) + 1
            for news in self.held.pop(node, ()):
                news.set()

    def stored(self, node: int, missing: set[str]) -> None:
        """A message for `node` was stored, and its objects `missing` are
        still to be pushed: the node hears of it once they are (a node
        woken earlier would find the message but not its objects, and
        retry their pulls)."""
        if missing:
            self.missing.setdefault(node, set()).update(missing)
        else:
            self.announce([node])

    def object_pushed(self, object_id: str) -> None:
        """The ServerApp pushed `object_id`: the nodes whose messages now
        have all their objects hear of them."""
        complete = []
        for node, missing in self.missing.items():
            missing.discard(object_id)
            if not missing:
                complete.append(node)
        for node in complete:
            del self.missing[node]
        self.announce(complete)

    def release_all(self) -> None:
        """The server stops: no pull is held any more."""
        self.closing = True
        for waiting in self.held.values():
            for news in waiting:
                news.set()
        self.held.clear()


class LongPollMiddleware:
    """ASGI middleware, innermost in Flower's SuperLink app: holds a Fleet
    pull while its node is quiet (`NodeBoard`), and tells the board which
    nodes each of the ServerApp's pushes named."""

    def __init__(
        self, app: ASGIApp, board: NodeBoard, hold_seconds: float = PULL_HOLD_SECONDS
    ) -> None:
        self.app, self.board, self.hold_seconds = app, board, hold_seconds

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path == FLEET_PULL:
            await self._pull(scope, receive, send)
        elif path == RUNTIME_PUSH:
            await self.app(scope, receive, send)
            self._pushed(*exchange(scope))
        elif path == RUNTIME_PUSH_OBJECT:
            await self.app(scope, receive, send)
            request, response = exchange(scope)
            if request is not None and response is not None:
                self.board.object_pushed(request.object_id)
        else:
            await self.app(scope, receive, send)

    async def _pull(self, scope: Scope, receive: Any, send: Any) -> None:
        request, _ = exchange(scope)
        if request is None or list(request.message_ids):
            await self.app(scope, receive, send)
            return
        node = request.node.node_id
        if self.board.is_quiet(node):
            await self.board.hold(node, self.hold_seconds)
        count = self.board.count(node)
        await self.app(scope, receive, send)
        _, response = exchange(scope)
        if response is not None and not list(response.messages_list):
            self.board.found_nothing(node, count)

    def _pushed(self, request: Any, response: Any) -> None:
        if request is None or response is None:  # the push failed: nothing stored
            return
        to_push = set(response.objects_to_push)
        stored = zip(
            request.messages_list, request.message_object_trees, response.message_ids,
            strict=True,  # Flower answers each message in order
        )  # fmt: skip
        for message, tree, message_id in stored:
            if message_id:  # "" where Flower did not store it
                missing = to_push.intersection(object_ids(tree))
                self.board.stored(message.metadata.dst_node_id, missing)


def exchange(scope: Scope) -> tuple[Any, Any]:
    """The request Flower parsed and its handler's response (None for a
    request that failed)."""
    state = scope.get("state", {})
    return state.get("protobuf_request"), state.get("protobuf_response")


def object_ids(tree: Any) -> Iterator[str]:
    """Every object ID in a message's object tree (Flower's `ObjectTree`)."""
    yield tree.object_id
    for child in tree.children:
        yield from object_ids(child)


def hold_fleet_pulls(hold_seconds: float = PULL_HOLD_SECONDS) -> bool:
    """In this process, Flower's SuperLink app gets a `LongPollMiddleware`
    (innermost), and a SuperLink told to stop lets its held pulls go.
    Returns whether it is applied (`guard`: on a Flower release it was not
    verified on, the SuperLink stays as Flower ships it)."""
    if not guard(SUPERLINK_LONG_POLL):
        return False
    import uvicorn
    from flwr.superlink import main as superlink_app
    from starlette.middleware import Middleware

    board = NodeBoard()
    flower_middleware = superlink_app._get_middleware

    @functools.wraps(flower_middleware)
    def with_long_poll() -> list[Middleware]:
        return [
            *flower_middleware(),
            Middleware(LongPollMiddleware, board=board, hold_seconds=hold_seconds),
        ]

    superlink_app._get_middleware = with_long_poll
    _release_on_exit(uvicorn.Server, board)
    return True


def _release_on_exit(server: type, board: NodeBoard) -> None:
    """uvicorn's `Server.handle_exit` (its SIGTERM/SIGINT handler, which
    then waits for every request in progress) first lets `board`'s held
    pulls go, through the event loop (it runs as a signal handler)."""
    handle_exit = server.handle_exit

    @functools.wraps(handle_exit)
    def releasing(self: Any, sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):  # no loop runs: nothing is held
            asyncio.get_running_loop().call_soon_threadsafe(board.release_all)
        handle_exit(self, sig, frame)

    server.handle_exit = releasing  # type: ignore[attr-defined]


def pull_hold(text: str) -> float:
    """An argparse type: seconds, 0 (Flower's own pulls) or 1 to
    `MAX_PULL_HOLD_SECONDS`."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds != 0 and not 1 <= seconds <= MAX_PULL_HOLD_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected seconds from 1 to {MAX_PULL_HOLD_SECONDS:g} (Flower's "
            "SuperNode waits 30 s for an answer), or 0 for Flower's own pulls"
        )
    return seconds


def add_pull_hold(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pull-hold", type=pull_hold, default=PULL_HOLD_SECONDS, metavar="SECONDS",
        help="how long the SuperLink holds a node's pull that finds no message, "
        f"until one is pushed for it (default {PULL_HOLD_SECONDS:g}; 0 answers "
        "every pull at once, as Flower does)",
    )  # fmt: skip

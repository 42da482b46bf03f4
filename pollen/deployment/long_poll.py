"""A long-poll for Flower's Fleet API: the SuperLink holds a node's pull until
a message for it exists, instead of the node asking again and again.

Flower 1.42's SuperNode asks its SuperLink for a message, and sleeps 3 s
when there is none; `pollen supernode` asks again sooner after a message
(`pollen.flower_waits.PollClock`) so a round's next message is picked up
at once. Every ask costs the SuperLink 4 to 9 ms of CPU here (FastAPI
middleware, TLS, the node's signature check), so fast asking trades the
SuperLink's load for pickup speed, and at a few dozen nodes the load wins.

`pollen superlink` (`hold_fleet_pulls`) keeps both: a pull by a quiet node
is held (without a thread) until the ServerApp has pushed a message for
that node and the message's objects, or `--pull-hold` seconds pass; then
Flower's handler answers it. The node therefore gets its next message as
soon as it can use it, and an idle node costs one request per hold (20 s)
instead of one per 3 s. A node is quiet when its last pull found nothing
and no push named it since; a node the SuperLink has not seen yet (a
restarted SuperLink), one whose last pull found something, and a pull for
given messages are answered at once:

    news[node]     the ServerApp's messages for the node that became
                   complete (stored, and their objects pushed)
    quiet_at[node] news[node] as read before the node's last pull that
                   found nothing (removed when a pull finds something)
    hold a pull    while news[node] == quiet_at[node]

A message completed while a pull reads the state makes `news` differ from
the count that pull records, so the node's next pull is not held. A node
is woken when its message's objects are in, not when the message is: one
woken earlier would find the message but not its objects, and retry their
pulls. A push that fails partway wakes every node it named (some of its
messages may be stored). A node has one held pull at most: a newer one
(the node restarted, or its client gave up and asked again) answers the
older "nothing" without reading the state, so a pull whose client is gone
cannot take a message.

The wait is a middleware inside Flower's own (after the protobuf
translation and the node's authentication), so the request it holds is
one Flower has parsed and authenticated, and the answer is Flower's
handler's (read from the request's state as the route starts its
response). A SuperLink told to stop (SIGTERM, SIGINT) lets every held
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
from dataclasses import dataclass, field
from typing import Any

from ..flower_patches import SUPERLINK_LONG_POLL, guard
from ..flower_waits import seconds_or_flowers

PULL_HOLD_SECONDS = 20.0
# Flower's SuperNode gives up on an answer after 30 s (its HTTP client's
# timeout) and retries: a hold must end well before.
MAX_PULL_HOLD_SECONDS = 25.0
FLEET_PULL = "/v1/fleet/pull-messages"
RUNTIME_PUSH = "/v1/runtime/push-messages"
RUNTIME_PUSH_OBJECT = "/v1/runtime/push-object"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


@dataclass
class Hold:
    """One held pull: set when it may go on; `superseded` when a newer pull
    of the same node took its place."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    superseded: bool = False


class NodeBoard:
    """What the SuperLink knows, per node, about whether a pull would find
    anything, and the pull held for it; per stored message, the objects it
    still waits for. Used only on the server's event loop (no locks)."""

    def __init__(self) -> None:
        self.news: dict[int, int] = {}
        self.quiet_at: dict[int, int] = {}
        self.held: dict[int, Hold] = {}
        # message ID -> (its node, its objects not pushed yet); object ID ->
        # the messages that wait for it
        self.incomplete: dict[str, tuple[int, set[str]]] = {}
        self.awaited: dict[str, set[str]] = {}
        self.closing = False

    def count(self, node: int) -> int:
        return self.news.get(node, 0)

    def found_nothing(self, node: int, count: int) -> None:
        """A pull by `node`, which began when `count` messages for it had
        become complete, found none."""
        self.quiet_at[node] = count

    def found(self, node: int, message_ids: Iterable[str]) -> None:
        """A pull by `node` found `message_ids`: more may wait (its next
        pull is answered at once), and these wait for nothing any more."""
        self.quiet_at.pop(node, None)
        for message_id in message_ids:
            self._forget(message_id)

    def is_quiet(self, node: int) -> bool:
        """Whether a pull by `node` now would find nothing: its last one
        found nothing, and no message for it became complete since."""
        return not self.closing and self.quiet_at.get(node) == self.count(node)

    async def hold(self, node: int, seconds: float) -> bool:
        """Wait until a message for `node` is complete, `seconds` pass, or
        the server stops; False when a newer pull of `node` took over."""
        if (older := self.held.get(node)) is not None:
            older.superseded = True
            older.event.set()
        hold = self.held[node] = Hold()
        try:
            await asyncio.wait_for(hold.event.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            if self.held.get(node) is hold:
                del self.held[node]
        return not hold.superseded

    def announce(self, nodes: Iterable[int]) -> None:
        """Messages for `nodes` are complete: their held pulls go on."""
        for node in set(nodes):
            self.news[node] = self.count(node) + 1
            if (hold := self.held.pop(node, None)) is not None:
                hold.event.set()

    def stored(self, node: int, message_id: str, missing: set[str]) -> None:
        """Message `message_id` for `node` was stored, and its objects
        `missing` are still to be pushed: the node hears of it once they
        are."""
        if not missing:
            self.announce([node])
            return
        self.incomplete[message_id] = (node, set(missing))
        for object_id in missing:
            self.awaited.setdefault(object_id, set()).add(message_id)

    def object_pushed(self, object_id: str) -> None:
        """The ServerApp pushed `object_id`: the nodes whose messages now
        have all their objects hear of them."""
        complete = []
        for message_id in self.awaited.pop(object_id, ()):
            node, missing = self.incomplete[message_id]
            missing.discard(object_id)
            if not missing:
                del self.incomplete[message_id]
                complete.append(node)
        self.announce(complete)

    def _forget(self, message_id: str) -> None:
        """A message that was delivered (with or without its objects) waits
        for nothing any more."""
        _, missing = self.incomplete.pop(message_id, (0, set()))
        for object_id in missing:
            waiting = self.awaited.get(object_id, set())
            waiting.discard(message_id)
            if not waiting:
                self.awaited.pop(object_id, None)

    def release_all(self) -> None:
        """The server stops: no pull is held any more."""
        self.closing = True
        for hold in self.held.values():
            hold.event.set()
        self.held.clear()


class LongPollMiddleware:
    """ASGI middleware, innermost in Flower's SuperLink app: holds a Fleet
    pull while its node is quiet (`NodeBoard`), and tells the board which
    messages the ServerApp stored and which of their objects it pushed."""

    def __init__(
        self, app: ASGIApp, board: NodeBoard, hold_seconds: float = PULL_HOLD_SECONDS
    ) -> None:
        self.app, self.board, self.hold_seconds = app, board, hold_seconds

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path == FLEET_PULL:
            await self._pull(scope, receive, send)
        elif path == RUNTIME_PUSH:
            response = await flowers_answer(self.app, scope, receive, send)
            self._pushed(parsed_request(scope), response)
        elif path == RUNTIME_PUSH_OBJECT:
            response = await flowers_answer(self.app, scope, receive, send)
            if response is not None:
                self.board.object_pushed(parsed_request(scope).object_id)
        else:
            await self.app(scope, receive, send)

    async def _pull(self, scope: Scope, receive: Any, send: Any) -> None:
        request = parsed_request(scope)
        if request is None or list(request.message_ids):
            await self.app(scope, receive, send)
            return
        node = request.node.node_id
        if self.board.is_quiet(node) and not await self.board.hold(
            node, self.hold_seconds
        ):
            await answer_nothing(scope, send)  # a newer pull of the node took over
            return
        count = self.board.count(node)
        response = await flowers_answer(self.app, scope, receive, send)
        if response is None:
            return
        if response.messages_list:
            self.board.found(
                node, (m.metadata.message_id for m in response.messages_list)
            )
        else:
            self.board.found_nothing(node, count)

    def _pushed(self, request: Any, response: Any) -> None:
        if request is None:
            return
        if response is None:  # failed, perhaps after storing some: wake them all
            self.board.announce(m.metadata.dst_node_id for m in request.messages_list)
            return
        to_push = set(response.objects_to_push)
        stored = zip(
            request.messages_list, request.message_object_trees, response.message_ids,
            strict=True,  # Flower answers each message in order
        )  # fmt: skip
        for message, tree, message_id in stored:
            if message_id:  # "" where Flower did not store it
                missing = to_push.intersection(object_ids(tree))
                self.board.stored(message.metadata.dst_node_id, message_id, missing)


def parsed_request(scope: Scope) -> Any:
    """The request Flower's protobuf translation parsed (None for others)."""
    return scope.get("state", {}).get("protobuf_request")


async def flowers_answer(app: ASGIApp, scope: Scope, receive: Any, send: Any) -> Any:
    """Run Flower's route; its handler's response (None for a request that
    failed), as the request's state holds it when the route starts its
    answer (Flower's translation middleware removes it afterwards)."""
    answer: list[Any] = [None]

    async def noting(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer[0] = scope.get("state", {}).get("protobuf_response")
        await send(message)

    await app(scope, receive, noting)
    return answer[0]


async def answer_nothing(scope: Scope, send: Any) -> None:
    """Answer a pull as Flower's route does when it finds no message."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse

    scope.setdefault("state", {})["protobuf_response"] = PullMessagesResponse()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


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
    return seconds_or_flowers(text, 1, MAX_PULL_HOLD_SECONDS, "Flower's own pulls")


def add_pull_hold(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pull-hold", type=pull_hold, default=PULL_HOLD_SECONDS, metavar="SECONDS",
        help="how long the SuperLink holds a node's pull that finds no message, "
        f"until one is pushed for it (default {PULL_HOLD_SECONDS:g}; 0 answers "
        "every pull at once, as Flower does)",
    )  # fmt: skip

"""`pollen superlink`'s held Fleet pull (`pollen.deployment.long_poll`): which
pull is held and what lets it go, on Flower's own protobuf messages; and a
real `pollen superlink` holding a real node's pull and stopping at once."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from flwr.proto.fleet_pb2 import PullMessagesRequest, PullMessagesResponse
from flwr.proto.message_pb2 import Message as MessageProto
from flwr.proto.message_pb2 import ObjectTree, PushObjectRequest, PushObjectResponse
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import PushAppMessagesRequest, PushAppMessagesResponse

from pollen.deployment import processes
from pollen.deployment.flower import flower_env, start_superlink
from pollen.deployment.long_poll import (
    FLEET_PULL,
    RUNTIME_PUSH,
    RUNTIME_PUSH_OBJECT,
    LongPollMiddleware,
    NodeBoard,
    pull_hold,
)

NODE, OTHER = 11, 12


def test_a_node_is_quiet_only_while_nothing_came_for_it_since_its_empty_pull():
    board = NodeBoard()
    assert not board.is_quiet(NODE)  # never seen: its pull may find something
    board.found_nothing(NODE, board.count(NODE))
    assert board.is_quiet(NODE) and not board.is_quiet(OTHER)
    board.announce([NODE])
    assert not board.is_quiet(NODE)
    # a message completed while the pull read the state: the count the pull
    # began with (1) is behind, so the next pull is answered at once
    began = board.count(NODE)
    board.announce([NODE])
    board.found_nothing(NODE, began)
    assert not board.is_quiet(NODE)
    board.found_nothing(NODE, board.count(NODE))
    board.found(NODE, ["some-id"])  # a held pull that ran out found one: more may wait
    assert not board.is_quiet(NODE)
    board.found_nothing(NODE, board.count(NODE))
    board.release_all()
    assert not board.is_quiet(NODE)  # a stopping SuperLink holds nothing


def test_a_held_pull_goes_on_when_its_node_is_named_or_its_time_is_up():
    async def scenario() -> tuple[float, float, float, list[bool]]:
        board = NodeBoard()
        started = time.monotonic()
        named = asyncio.create_task(board.hold(NODE, 5))
        other = asyncio.create_task(board.hold(OTHER, 0.3))
        await asyncio.sleep(0.1)
        board.announce([NODE, NODE])
        went_on = [await named]
        named_after = time.monotonic() - started
        went_on.append(await other)
        other_after = time.monotonic() - started
        stopping = asyncio.create_task(board.hold(NODE, 5))
        await asyncio.sleep(0.05)
        board.release_all()
        went_on.append(await stopping)
        assert not board.held
        return named_after, other_after, time.monotonic() - started, went_on

    named_after, other_after, stopped_after, went_on = asyncio.run(scenario())
    assert 0.1 <= named_after < 1.0
    assert 0.3 <= other_after < 1.2
    assert stopped_after < 2.0
    assert went_on == [True, True, True]


def test_a_newer_pull_of_a_node_takes_over_its_held_one():
    """The older is let go at once, told it was superseded (its client may
    be gone: it must not take the message); the newer goes on holding."""

    async def scenario() -> tuple[bool, bool, bool]:
        board = NodeBoard()
        older = asyncio.create_task(board.hold(NODE, 5))
        await asyncio.sleep(0.05)
        newer = asyncio.create_task(board.hold(NODE, 5))
        older_went_on = await asyncio.wait_for(older, 1)
        await asyncio.sleep(0.05)
        newer_waits = not newer.done()
        board.announce([NODE])
        return older_went_on, newer_waits, await asyncio.wait_for(newer, 1)

    assert asyncio.run(scenario()) == (False, True, True)


def message_for(node: int, message_id: str = "") -> MessageProto:
    message = MessageProto()
    message.metadata.dst_node_id = node
    message.metadata.message_id = message_id
    return message


async def sink(message: dict[str, Any]) -> None:
    """The server's `send`: what the middleware answers goes nowhere here."""


class FlowerStandIn:
    """The app inside the middleware, as Flower's routes leave the request's
    state: the parsed request in, the handler's response out as the route
    starts its answer (none for a request that failed); pulls find
    `waiting` messages per node."""

    def __init__(self) -> None:
        self.waiting: dict[int, list[str]] = {}
        self.pulled: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state = scope["state"]
        request = state["protobuf_request"]
        if scope["path"] == FLEET_PULL:
            node = request.node.node_id
            found = self.waiting.get(node, [])[:1]
            self.waiting[node] = self.waiting.get(node, [])[len(found) :]
            self.pulled.append(node)
            state["protobuf_response"] = PullMessagesResponse(
                messages_list=[message_for(node, m) for m in found]
            )
        elif scope.get("fail"):
            for message in request.messages_list[:1]:  # stored, then it failed
                self.waiting.setdefault(message.metadata.dst_node_id, []).append("x")
            await send({"type": "http.response.start", "status": 500, "headers": []})
            return
        elif scope["path"] == RUNTIME_PUSH_OBJECT:
            state["protobuf_response"] = PushObjectResponse(stored=True)
        else:
            ids = [
                f"id-{m.metadata.dst_node_id}-{len(self.pulled)}"
                for m in request.messages_list
            ]
            for message, message_id in zip(request.messages_list, ids, strict=True):
                self.waiting.setdefault(message.metadata.dst_node_id, []).append(
                    message_id
                )
            state["protobuf_response"] = PushAppMessagesResponse(
                message_ids=ids, objects_to_push=scope["missing"]
            )
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        state.pop("protobuf_response", None)  # as Flower's translation does, after


def request_scope(path: str, request: Any, **extra: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "path": path,
        "state": {"protobuf_request": request},
        **extra,
    }


def pull(node: int, *message_ids: str) -> dict[str, Any]:
    request = PullMessagesRequest(node=Node(node_id=node), message_ids=message_ids)
    return request_scope(FLEET_PULL, request)


def push(
    *nodes: int, fail: bool = False, missing: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The ServerApp's push of one message per node of `nodes`, each with its
    own root object and the objects "array" and "config"; the SuperLink
    lacks `missing` of them."""
    request = PushAppMessagesRequest(
        messages_list=[message_for(n) for n in nodes],
        message_object_trees=[
            ObjectTree(
                object_id=f"msg-{n}",
                children=[ObjectTree(object_id=name) for name in ("array", "config")],
            )
            for n in nodes
        ],
    )
    return request_scope(RUNTIME_PUSH, request, fail=fail, missing=list(missing))


def push_object(object_id: str) -> dict[str, Any]:
    return request_scope(RUNTIME_PUSH_OBJECT, PushObjectRequest(object_id=object_id))


def test_the_middleware_holds_an_empty_pull_until_a_push_names_its_node():
    """Pull 1 finds nothing and is answered at once; pull 2 is held; a push
    for another node leaves it held; a push for its node lets it go, and it
    finds the message; a pull for given messages is never held."""
    flower = FlowerStandIn()
    middleware = LongPollMiddleware(flower, NodeBoard(), hold_seconds=5)

    async def scenario() -> dict[str, float]:
        start = time.monotonic()
        await middleware(pull(NODE), None, sink)
        first = time.monotonic() - start
        held = asyncio.create_task(middleware(pull(NODE), None, sink))
        await asyncio.sleep(0.1)
        await middleware(push(OTHER), None, sink)
        await asyncio.sleep(0.1)
        still_held = not held.done()
        pushed = time.monotonic()
        await middleware(push(NODE, OTHER), None, sink)
        await held
        woken = time.monotonic() - pushed
        await middleware(pull(NODE, "some-message-id"), None, sink)
        return {"first": first, "still_held": still_held, "woken": woken}

    outcome = asyncio.run(scenario())
    assert outcome["first"] < 0.5 and outcome["still_held"]
    assert outcome["woken"] < 0.5
    assert flower.pulled == [NODE, NODE, NODE]
    assert flower.waiting[NODE] == []  # the held pull took the message


def test_a_push_that_fails_partway_wakes_every_node_it_named():
    """Flower stores a push's messages one by one and may fail after the
    first: the held pull of its node goes on (and finds it)."""
    flower = FlowerStandIn()
    middleware = LongPollMiddleware(flower, NodeBoard(), hold_seconds=5)

    async def scenario() -> float:
        await middleware(pull(NODE), None, sink)
        held = asyncio.create_task(middleware(pull(NODE), None, sink))
        await asyncio.sleep(0.05)
        failed = time.monotonic()
        await middleware(push(NODE, OTHER, fail=True), None, sink)
        await asyncio.wait_for(held, 1)
        return time.monotonic() - failed

    assert asyncio.run(scenario()) < 0.5
    assert flower.waiting[NODE] == []


def test_a_superseded_held_pull_is_answered_empty_without_asking_flower():
    flower = FlowerStandIn()
    middleware = LongPollMiddleware(flower, NodeBoard(), hold_seconds=5)
    answered: list[dict[str, Any]] = []

    async def recording(message: dict[str, Any]) -> None:
        answered.append(message)

    async def scenario() -> None:
        await middleware(pull(NODE), None, sink)
        older = asyncio.create_task(middleware(pull(NODE), None, recording))
        await asyncio.sleep(0.05)
        newer = asyncio.create_task(middleware(pull(NODE), None, sink))
        await asyncio.wait_for(older, 1)
        await middleware(push(NODE), None, sink)
        await asyncio.wait_for(newer, 1)

    asyncio.run(scenario())
    assert flower.pulled == [NODE, NODE]  # the first pull and the newer one
    assert answered[0]["status"] == 200 and flower.waiting[NODE] == []


def test_a_held_pull_goes_on_once_its_messages_objects_are_pushed():
    """Its message is stored with two objects missing: the pull stays held
    through the first object's push and goes on after the second's (a node
    woken before would retry its object pulls). A message whose objects
    never came does not hold up the node's next one; a node whose message
    lacks nothing is woken by the push itself."""
    flower = FlowerStandIn()
    board = NodeBoard()
    middleware = LongPollMiddleware(flower, board, hold_seconds=5)

    async def scenario() -> list[bool]:
        for node in (NODE, OTHER):
            await middleware(pull(node), None, sink)
        held = asyncio.create_task(middleware(pull(NODE), None, sink))
        await asyncio.sleep(0.05)
        await middleware(push(NODE, missing=("msg-11", "array")), None, sink)
        await asyncio.sleep(0.05)
        seen = [held.done()]
        await middleware(push_object("array"), None, sink)
        await asyncio.sleep(0.05)
        seen.append(held.done())
        await middleware(push_object("msg-11"), None, sink)
        await asyncio.wait_for(held, 0.5)
        # OTHER: a message whose root object never comes holds its pull; the
        # next message, complete, wakes it (it finds the first, which waits
        # for nothing any more), and the pull after finds the second at once
        await middleware(push(OTHER, missing=("msg-12",)), None, sink)
        other = asyncio.create_task(middleware(pull(OTHER), None, sink))
        await asyncio.sleep(0.05)
        seen.append(other.done())
        await middleware(push(OTHER), None, sink)
        await asyncio.wait_for(other, 0.5)
        await asyncio.wait_for(middleware(pull(OTHER), None, sink), 0.5)
        return seen

    assert asyncio.run(scenario()) == [False, False, False]
    assert not board.incomplete and not board.awaited
    assert flower.waiting == {NODE: [], OTHER: []}


@pytest.mark.parametrize("value", ["-1", "0.5", "26", "ten"])
def test_pull_hold_is_checked(value):
    with pytest.raises(
        argparse.ArgumentTypeError, match="expected seconds from 1 to 25"
    ):
        pull_hold(value)
    assert pull_hold("0") == 0 and pull_hold("20") == 20


@pytest.mark.integration
def test_a_real_superlink_holds_a_quiet_nodes_pull_and_stops_at_once(tmp_path):
    """A real `pollen superlink` (in memory, insecure) and a node speaking
    Flower's own Fleet client: its first empty pull is answered at once,
    the next is held for `--pull-hold` (2 s). Then, with a 20 s hold,
    SIGTERM 1 s into a held pull: the pull is answered and the SuperLink
    has exited within a few seconds (uvicorn waits for every request in
    progress; a held one would keep it 19 s more)."""
    from flwr.supernode.fleet_http_connection import http_request_response

    port = processes.free_port()
    address = f"127.0.0.1:{port}"

    def superlink(hold: float) -> subprocess.Popen[bytes]:
        return start_superlink(
            ["--insecure", "--database", ":flwr-in-memory:"], host="127.0.0.1",
            port=port, address=address, env=flower_env(tmp_path / "home"),
            log=tmp_path / f"superlink-{hold:g}.log", pull_hold=hold,
        )  # fmt: skip

    def timed(receive: Any) -> float:
        began = time.monotonic()
        assert receive() is None
        return time.monotonic() - began

    link = superlink(2)
    try:
        with http_request_response(address, insecure=True) as connection:
            first, second = timed(connection[1]), timed(connection[1])
        assert first < 1.0 and 1.9 <= second < 4, (first, second)
    finally:
        processes.stop(link.pid)

    link = superlink(20)
    try:  # (assertions go after the connection: it swallows errors raised in it)
        with http_request_response(address, insecure=True, max_retries=0) as connection:
            receive = connection[1]
            timed(receive)  # now the node is quiet: its next pull is held
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(timed, receive)
                time.sleep(1)
                link.send_signal(signal.SIGTERM)
                stopping = time.monotonic()
                answered = held.result(timeout=30)
                link.wait(timeout=30)
                stopped = time.monotonic() - stopping
    finally:
        processes.stop(link.pid)
    assert answered < 4 and stopped < 5, (answered, stopped)
    assert "Finished server process" in (tmp_path / "superlink-20.log").read_text()

"""A cohort's messages: one training message per node for all the clients it
serves in a round, one reply carrying an update per client.

Under `client-execution = "cohort"` the server still builds one training
message per sampled client (`pollen.strategies.strategy.addressed`); `pack`
merges those addressed to one node into a single message of type
`train.cohort` (Flower's `MessageType.TRAIN` with the action `cohort`),
whose `CONFIG` names the clients (`CLIENTS`) instead of one client. The
ClientApp splits it back into each member's own training message
(`member_views`), trains them together (`pollen.task.cohort`) and answers
with `packed_reply`: each member's reply records, renamed `<client>/<record>`,
and for a member whose own preparation or reply failed (its state, its
shard) only `<client>/error`, the reason, where `train` would have raised
for that client alone. `unpack` turns that reply into one reply per client,
addressed as if each member's own message had been answered (an error
member's as Flower answers a ClientApp that raised), so every reply check,
byte count and history column downstream is the one a sequential round
uses.

Only training messages travel as cohorts; personal evaluation stays one
message per client. Both sides import this module (it needs Flower's record
types and `pollen.protocol` only).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from ..protocol import CLIENT, CONFIG

COHORT_TRAIN = f"{MessageType.TRAIN}.cohort"  # the packed message's type
CLIENTS = "partition-ids"  # CONFIG key of a packed message: its members, in order
FAILED = "error"  # a member's record when it failed alone: {"reason": ...}


def _member_key(client: int, record: str) -> str:
    return f"{client}/{record}"


def pack(messages: Iterable[Message]) -> list[Message]:
    """One `train.cohort` message per destination node, for the training
    messages addressed to it (in their order); other messages unchanged.

    The members' messages must differ only in the client their `CONFIG`
    names (as `addressed` builds them): the model and any other record are
    sent once per node.
    """
    by_node: dict[int, list[Message]] = {}
    packed: list[Message] = []
    for message in messages:
        if message.metadata.message_type == MessageType.TRAIN:
            by_node.setdefault(message.metadata.dst_node_id, []).append(message)
        else:
            packed.append(message)
    for node, members in by_node.items():
        first = members[0].content
        config = {k: v for k, v in first[CONFIG].items() if k != CLIENT}
        for other in members[1:]:
            _check_same(first, other.content, config)
        clients = [int(m.content[CONFIG][CLIENT]) for m in members]
        content = RecordDict(
            {
                **{name: record for name, record in first.items() if name != CONFIG},
                CONFIG: ConfigRecord({**config, CLIENTS: clients}),
            }
        )
        packed.append(
            Message(content=content, message_type=COHORT_TRAIN, dst_node_id=node)
        )
    return packed


def _check_same(first: RecordDict, other: RecordDict, config: dict) -> None:
    """A member's message carries what the first carries, bar its client."""
    rest = {k: v for k, v in other[CONFIG].items() if k != CLIENT}
    records_differ = any(
        other.get(name) is not record
        for name, record in first.items()
        if name != CONFIG
    )
    if set(first) != set(other) or rest != config or records_differ:
        raise ValueError(
            "a cohort's training messages differ beyond the client they name; "
            "each node's clients must be sent the same model and config"
        )


def unpack(requests: Iterable[Message], replies: Iterable[Message]) -> list[Message]:
    """One reply per member, from the nodes' cohort replies to the members'
    own messages (`requests`, as `pack` was given them): each is a reply to
    its member's message, with the records its node answered for it.

    A node's error reply becomes that error for each of its members, a
    member's own `FAILED` record an error for it alone; a member its node's
    reply says nothing of gets no reply (the round counts it as not
    answered). Replies to other messages pass through.

    The members of a node that replied are given the message ID `<the
    cohort message's ID>/<client>`, as Flower's grids give a message its ID
    when they push it, so a member's reply answers its message by ID as any
    other reply does.
    """
    members: dict[int, list[Message]] = {}
    for request in requests:
        if request.metadata.message_type == MessageType.TRAIN:
            members.setdefault(request.metadata.dst_node_id, []).append(request)
    out: list[Message] = []
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.metadata.message_type != COHORT_TRAIN or node not in members:
            out.append(reply)
            continue
        for request in members[node]:
            client = int(request.content[CONFIG][CLIENT])
            _name_member(
                request, _member_id(reply.metadata.reply_to_message_id, client)
            )
            if reply.has_error():
                out.append(Message(reply.error, reply_to=request))
            elif failed := _member_failure(reply.content, client):
                out.append(Message(failed, reply_to=request))
            elif content := _member_records(reply.content, client):
                out.append(Message(content, reply_to=request))
    return out


def _member_id(cohort_id: str, client: int) -> str:
    """The message ID of `client`'s message in the cohort message `cohort_id`."""
    return f"{cohort_id}/{client}"


def _name_member(request: Message, message_id: str) -> None:
    """Give a member's message (never pushed itself) its ID, where Flower's
    grids write a pushed message's (`Metadata` has no setter for it)."""
    request.metadata.__dict__["_message_id"] = message_id


def _member_failure(content: RecordDict, client: int) -> Error | None:
    """The error of a member that failed alone, or None."""
    record = content.get(_member_key(client, FAILED))
    if not isinstance(record, ConfigRecord):
        return None
    return Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(record.get("reason", "")))


def _member_records(content: RecordDict, client: int) -> RecordDict:
    prefix = _member_key(client, "")
    return RecordDict(
        {
            name.removeprefix(prefix): record
            for name, record in content.items()
            if name.startswith(prefix)
        }
    )


def member_views(message: Message) -> list[Message]:
    """Each member's own training message, as the server built it: the
    cohort's records, a `CONFIG` naming that member, type `train`."""
    config = message.content[CONFIG]
    shared = {k: v for k, v in config.items() if k != CLIENTS}
    views = []
    for client in config[CLIENTS]:
        metadata = copy.copy(message.metadata)
        metadata.message_type = MessageType.TRAIN
        content = RecordDict(
            {
                **{n: r for n, r in message.content.items() if n != CONFIG},
                CONFIG: ConfigRecord({**shared, CLIENT: int(client)}),
            }
        )
        views.append(Message(content, metadata=metadata))
    return views


def packed_reply(
    message: Message,
    answered: Iterable[tuple[Message, Message]],
    failed: Mapping[int, Exception] | None = None,
) -> Message:
    """The node's reply to a cohort message, from (member view, its reply)
    pairs: every member reply's records, named `<client>/<record>` by the
    client its view names; and each `failed` member's exception, as the
    reason Flower gives a ClientApp's (`<class '...'>:<'...'>`)."""
    content = RecordDict()
    for view, reply in answered:
        client = int(view.content[CONFIG][CLIENT])
        for name, record in reply.content.items():
            content[_member_key(client, name)] = record
    for client, err in (failed or {}).items():
        reason = f"{type(err)}:<'{err}'>"
        content[_member_key(client, FAILED)] = ConfigRecord({"reason": reason})
    return Message(content, reply_to=message)

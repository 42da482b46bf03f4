"""Shared fixtures: paths to the project and to the real benchmark data."""

from __future__ import annotations

from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist.npz").exists():
        pytest.skip(f"real MNIST not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def task_identity():
    """Messages built outside a running Flower app need a run and node identity."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def reply_from(node: int, content, message_type: str = "train"):
    """A reply as node `node` sends it to the server (needs `task_identity`)."""
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    server = TaskIdentity.node_id
    TaskIdentity.node_id = node
    try:
        return Message(content, dst_node_id=server, message_type=message_type)
    finally:
        TaskIdentity.node_id = server

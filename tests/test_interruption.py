"""`InterruptibleGrid`: every exchange with the clients checks the stop
signal first, and Flower's Grid methods keep their signatures through it
(1.42's `pull_messages(message_ids)` and 1.43's `pull_messages(
reply_to_message_ids=None, *, message_ids=None)` alike)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from flwr.server import Grid

from pollen.runs.interruption import InterruptibleGrid, RunInterrupted, StopSignal

# pull_messages as each Flower release calls it: by position, by either
# keyword, and (1.43's own code) with no argument
CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((["m1", "m2"],), {}),
    ((), {"message_ids": ["m1"]}),
    ((), {"reply_to_message_ids": ["m1"]}),
    ((), {}),
]


class RecordingGrid:
    """Stands in for Flower's grid: records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def pull_messages(self, *args: Any, **kwargs: Any) -> list[str]:
        self.calls.append((args, kwargs))
        return ["reply"]


def accepted_by_installed_flower(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(Grid.pull_messages).bind(None, *args, **kwargs)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_pull_messages_passes_on_either_releases_form_as_given(args, kwargs):
    inner = RecordingGrid()
    grid = InterruptibleGrid(inner, StopSignal())
    assert grid.pull_messages(*args, **kwargs) == ["reply"]
    assert inner.calls == [(args, kwargs)]


def test_the_installed_flower_takes_the_positional_form_pollen_uses():
    """pollen's own calls (sampling, the asynchronous loop) pass the IDs by
    position: the form both releases take."""
    assert accepted_by_installed_flower(*CALLS[0])


def test_a_stopped_run_exchanges_nothing_more():
    inner, stop = RecordingGrid(), StopSignal()
    grid = InterruptibleGrid(inner, stop)
    stop.ask()  # from the loop's own thread: no wait
    with pytest.raises(RunInterrupted):
        grid.pull_messages()
    assert inner.calls == []

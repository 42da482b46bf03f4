"""The production values of the clocks that set how long a deployment takes
to notice a lost node or a new task, as docs/deployment.md ("Flower's
clocks") states them: each row's value against the constant it names, so an
upgrade of Flower that changes one fails here instead of leaving the docs
(and the waits of the tests that kill processes) wrong."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
from flwr.supernode import start_client_internal

from tests.conftest import PROJECT

ROW = re.compile(r"^\| ([^|]+) \| ([0-9.]+)( s)? \| `([\w.]+)` \|", re.MULTILINE)


def documented() -> list[tuple[str, float, str]]:
    """(clock, value, dotted name) for each row of the table."""
    text = (PROJECT / "docs" / "deployment.md").read_text()
    section = text[text.index("### Flower's clocks") : text.index("## Security")]
    return [(m[1], float(m[2]), m[4]) for m in ROW.finditer(section)]


def test_the_table_names_every_clock() -> None:
    assert len(documented()) == 12


@pytest.mark.parametrize(("clock", "value", "name"), documented())
def test_each_clock_is_what_the_docs_say(clock: str, value: float, name: str) -> None:
    module, attribute = name.rsplit(".", 1)
    actual = getattr(importlib.import_module(module), attribute)
    assert float(actual) == value, f"{clock}: {name} is {actual}, the docs say {value}"


def test_an_idle_supernode_sleeps_three_seconds_between_polls() -> None:
    """No constant names it: the sleep after a poll that found no message."""
    source = inspect.getsource(start_client_internal)
    assert source.count("time.sleep(3)") == 1

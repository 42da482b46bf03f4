"""The tests' own helpers, where a wrong one would let a test pass or fail
for the wrong reason."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import read_through_line

PRINTS_AT_ONCE = "import sys; sys.stdout.write('start\\n     round 2/300: x\\n     round 3/300: y\\n')"


def test_read_through_line_leaves_the_lines_after_it_to_communicate() -> None:
    """Lines written together with the wanted one (a loaded machine's run
    printing rounds 2-7 before the test reads) reach `communicate`."""
    child = subprocess.Popen(
        [sys.executable, "-c", PRINTS_AT_ONCE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    child.wait(timeout=30)  # all of it is in the pipe before anything is read
    assert read_through_line(child, "round 2/300") == "start\n     round 2/300: x\n"
    assert child.communicate(timeout=30)[0] == "     round 3/300: y\n"

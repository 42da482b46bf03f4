"""A few names of a long list, and how many more: what one-line errors show
of the entries they are about."""

from __future__ import annotations

from collections.abc import Sequence

SHOWN = 3  # names a line shows before "and N more"


def few(names: Sequence[str], shown: int = SHOWN) -> str:
    """The first `shown` of `names`, joined, then how many more
    ("'a', 'b', 'c' and 4 more")."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")

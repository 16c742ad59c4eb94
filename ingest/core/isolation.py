"""Poison-row isolation: find exactly the rows of a batch that fail on their own.

``write_isolating`` tries the whole batch; when it fails with a
:class:`~ingest.errors.PermanentError` it splits it in halves and tries each
half, recursively, down to single rows. Good halves are written in their own
transactions, so one poison row in a batch of ``n`` costs ``1 + 2*ceil(log2 n)``
write calls, not ``n``. Only a single row that fails alone is poison.

The ``write`` callable decides what "transient" means: it is expected to
retry transient errors itself and to raise when it gives up; anything other
than a PermanentError propagates unchanged, leaving no row half-classified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ingest.errors import PermanentError

T = TypeVar("T")


def write_isolating(
    rows: Sequence[T], write: Callable[[Sequence[T]], None]
) -> list[tuple[T, PermanentError]]:
    """Write ``rows`` through ``write``; return the poison rows with the error each failed with.

    Rows not returned were written (in left-to-right order of the pieces).
    Raises whatever ``write`` raises other than PermanentError.
    """
    poison: list[tuple[T, PermanentError]] = []
    if not rows:
        return poison
    # Explicit stack of pieces, processed left to right; depth is log2(n).
    stack: list[Sequence[T]] = [rows]
    while stack:
        piece = stack.pop()
        try:
            write(piece)
        except PermanentError as exc:
            if len(piece) == 1:
                poison.append((piece[0], exc))
                continue
            mid = len(piece) // 2
            stack.append(piece[mid:])
            stack.append(piece[:mid])
    return poison

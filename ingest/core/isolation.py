"""Poison-row isolation: find exactly the rows of a batch that fail on their own.

``write_isolating`` tries the whole batch; when it fails with a
:class:`~ingest.errors.PermanentError` it splits it in halves and tries each
half, recursively, down to single rows. Good halves are written in their own
transactions, so one poison row in a batch of ``n`` costs ``1 + 2*ceil(log2 n)``
write calls, not ``n``. Only a single row that fails alone is poison.

When rows were collapsed by key before writing (only the latest record of a
key is written), :func:`write_groups_isolating` keeps the fallback honest: if
the chosen record of a key fails alone, it is poison, and the key's next
candidate (the previous record) is written instead, and so on -- so a poison
record never takes the good records of its key down with it.

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


def write_groups_isolating(
    groups: Sequence[Sequence[T]], write: Callable[[Sequence[T]], None]
) -> tuple[list[T], list[tuple[T, PermanentError]]]:
    """Write one candidate per group, falling back to the group's next candidate when one is poison.

    ``groups[g]`` lists the candidates of group ``g`` in order of preference
    (e.g. the records of one key, latest first). Round one writes every
    group's first candidate with :func:`write_isolating`; a candidate that
    fails alone is poison, and the next round writes those groups' next
    candidates, until every group has a written candidate or none left.

    Returns ``(written, poison)``: the candidates written (one per group that
    had a good one) and every poison candidate with its error. Candidates after
    a written one are never tried (superseded). Raises whatever ``write``
    raises other than PermanentError.
    """
    written: list[T] = []
    poison: list[tuple[T, PermanentError]] = []
    cursor = [0] * len(groups)
    pending = [g for g in range(len(groups)) if groups[g]]
    while pending:
        current = [groups[g][cursor[g]] for g in pending]
        failed = write_isolating(range(len(current)), lambda piece: write([current[i] for i in piece]))
        failed_at = {i for i, _ in failed}
        written.extend(c for i, c in enumerate(current) if i not in failed_at)
        retry: list[int] = []
        for i, exc in failed:
            poison.append((current[i], exc))
            g = pending[i]
            cursor[g] += 1
            if cursor[g] < len(groups[g]):
                retry.append(g)
        pending = sorted(retry)
    return written, poison

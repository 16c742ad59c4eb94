"""The sink port: what the lane writer needs from a database backend."""

from __future__ import annotations

import hashlib
import itertools
import operator
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ingest.types import Item


class Sink(Protocol):
    """A table that accepts batches of rows.

    Rows are tuples in the pipeline's column order. Implementations are used
    by one lane thread at a time per connection and must be safe to share
    between lanes (each call takes its own connection).
    """

    def write(self, rows: Sequence[tuple[Any, ...]], *, token: str | None = None) -> None:
        """Write ``rows`` in one transaction: all or nothing.

        ``token`` (optional keyword, see :func:`dedup_token`) identifies exactly
        which records the rows come from; the same rows from the same records
        always carry the same token, so a sink that can deduplicate inserts
        (ClickHouse's ``insert_deduplication_token``) makes a retried write a
        no-op. Sinks that do not need it accept and ignore it. The batch writer
        passes it only to ``write`` callables that have a ``token`` parameter.

        Blocks until the transaction is committed. Raises
        :class:`~ingest.errors.TransientError` when retrying may help (the
        transaction was rolled back) and :class:`~ingest.errors.PermanentError`
        when the data is at fault (also rolled back). Never raises anything else.
        """
        ...

    def check(self) -> None:
        """Connect once and run a trivial query. Raises ServiceUnreachable."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


_tp_of = operator.attrgetter("record.topic", "record.partition")
_offset_of = operator.attrgetter("record.offset")


def dedup_token(pipeline: str, items: Iterable[Item]) -> str:
    """A deterministic insert token for the rows coming from ``items``.

    Derived from the pipeline name and the exact set of (topic, partition,
    offset) of the records: the same set gives the same token whatever the
    order, any other set another token. ``<pipeline>-<32 hex digits>``
    (BLAKE2b-128 over the sorted offsets per partition).
    """
    by_tp: dict[tuple[str, int], list[int]] = {}
    for tp, run in itertools.groupby(items, _tp_of):  # items come in runs of one partition
        offsets = by_tp.get(tp)
        if offsets is None:
            by_tp[tp] = list(map(_offset_of, run))
        else:
            offsets.extend(map(_offset_of, run))
    h = hashlib.blake2b(pipeline.encode(), digest_size=16)
    for (topic, partition) in sorted(by_tp):
        offsets = by_tp[(topic, partition)]
        offsets.sort()  # already ascending within a lane batch: linear
        # Topic names cannot contain NUL; the fixed-width offsets make the encoding unambiguous.
        h.update(b"\0%s\0%d\0%d\0" % (topic.encode(), partition, len(offsets)))
        h.update(array("q", offsets).tobytes())
    return f"{pipeline}-{h.hexdigest()}"

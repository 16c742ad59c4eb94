"""The sink port: what the lane writer needs from a database backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Sink(Protocol):
    """A table that accepts batches of rows.

    Rows are tuples in the pipeline's column order. Implementations are used
    by one lane thread at a time per connection and must be safe to share
    between lanes (each call takes its own connection).
    """

    def write(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Write ``rows`` in one transaction: all or nothing.

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

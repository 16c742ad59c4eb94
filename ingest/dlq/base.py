"""The DLQ port and the entry it stores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ingest.types import Failure, Record


@dataclass(slots=True, frozen=True)
class DlqEntry:
    """A poison record with its provenance: the original bytes, unchanged, and why it failed."""

    pipeline: str
    record: Record
    failure: Failure


class DeadLetterQueue(Protocol):
    def put(self, entries: Sequence[DlqEntry]) -> None:
        """Store ``entries`` durably; return only once they are durable.

        Idempotent per (pipeline, topic, partition, offset). Blocks. Raises
        :class:`~ingest.errors.TransientError` if the backend is unreachable
        (the caller retries and must not count the records as done).
        """
        ...

    def close(self) -> None:
        """Release resources. Idempotent."""
        ...

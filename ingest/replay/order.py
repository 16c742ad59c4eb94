"""Replay's order guard: may a dead-lettered record be written over its row? Pure logic.

A row knows which record it was last written from (its *source*: the stream --
topic and partition -- and the offset; PostgreSQL tables that update rows keep
it in two hidden columns). Offsets order the records of one stream only, so:

- no row yet → **apply** (nothing to make older);
- the row's source is the entry's own stream: **apply** when the entry is not
  older than the row (a key whose latest record was poison gets its fixed
  record), else **superseded** (the row holds a newer record: replaying would
  make it older; the entry is resolved without writing);
- another stream, or a row written before ingest kept sources → **unknown**:
  ingest cannot tell which is newer. ``replay-dlq`` leaves such entries pending
  and says so, unless ``--apply-unordered``.

With a version column the version orders the records and the sink's upsert
guard decides; without source columns (ClickHouse: ReplacingMergeTree keeps the
highest version, which is the original offset by default) the sink decides too:
both **apply**.
"""

from __future__ import annotations

import enum

from ingest.core.routing import stream_id
from ingest.sinks.base import RowSource
from ingest.types import Record


class Verdict(str, enum.Enum):
    APPLY = "apply"
    SUPERSEDED = "superseded"
    UNKNOWN = "unknown"


def judge(row: RowSource | None, record: Record) -> Verdict:
    """The verdict for replaying ``record`` over a row last written from ``row`` (None: no row)."""
    if row is None:
        return Verdict.APPLY
    topic, partition, offset = record.source_position
    if row.stream is None or row.offset is None or row.stream != stream_id(topic, partition):
        return Verdict.UNKNOWN
    return Verdict.APPLY if offset >= row.offset else Verdict.SUPERSEDED

"""Exactly-once into PostgreSQL: offsets stored in the same transaction as the rows.

With idempotent upserts a keyed table is effectively-once anyway; an
append-only table (``on_conflict: none``) is not: a crash between the database
commit and the Kafka offset commit inserts the batch again. With
``sink.delivery: exactly_once`` every batch transaction also records which
offsets it covers, and the consumer restarts from what the database says.

Design
------
Lanes complete out of order, so no single "next offset" can be written by a
lane transaction. But *within one lane* the records of a partition are
written in offset order (a lane is FIFO and receives each partition's records
in consumption order). So each lane transaction keeps, per (partition, lane),
``next_offset`` = one past the highest offset of that partition the lane has
written, in table ``ingest_lane_offsets`` keyed by (pipeline, topic, partition,
lanes, lane). The invariant: *every record of partition p routed to lane L with
offset < next_offset[p, L] is in the table or the DLQ.*

A lane transaction, in order:

1. ``SELECT … FOR UPDATE`` the (p, L) rows of the partitions in the batch
   (serialising it against a zombie writer of the same lane);
2. drop the batch's records below the stored ``next_offset`` -- already
   written by an earlier incarnation -- and count them as done;
3. write the rows; a permanent error is isolated with SAVEPOINTs (halves,
   down to single rows) *inside* the transaction, so the good rows, the DLQ
   rows of the poison ones and the new offsets commit together or not at all.
   A batch the columnar tier planned (``ingest.runner.columnar``: its records
   unmapped, its rows one encoded payload) is written by one columnar write in
   a SAVEPOINT when step 2 kept every record; otherwise (records already
   written, a record read twice), or when that write fails on anything but a
   transient error (rolled back to the savepoint), the fresh records are
   mapped by the row mapper and written as above -- the row path decides;
4. insert the DLQ entries (DLQ table in the same database, same transaction);
5. upsert ``next_offset[p, L]`` to one past the batch's highest offset of p.

The pipeline thread additionally stores the contiguous watermark per
partition in ``ingest_offsets`` on every commit tick (before the advisory
Kafka commit). On assignment the consumer seeks to that watermark: everything
below it is handled, and everything above it is either below its lane's
``next_offset`` (skipped by step 2) or not yet written. Routing must be
deterministic for step 2 to be right: keyed records use the stable key hash;
unkeyed records go to lane ``offset % lanes``.

The lane offsets are only valid for the lane mapping that wrote them, so they
are kept per ``lanes`` and per routing scheme (``routing``: ``kafka-key`` -- the
record's key, the scheme of append-only tables and of every table before
version 0.2 -- or ``row-key``, the sink's own key, which tables with a conflict
key route by since 0.2; see :mod:`ingest.core.routing`). A run with another
mapping starts fresh lane offsets from the stored watermark: everything below
it is handled, and records above it are written again, which upserts absorb
(only tables with a key change scheme). Changing ``lanes`` of an append-only
table is therefore safe only after a clean stop (which stores the watermark at
the end): after a crash, records between the watermark and the old lanes'
offsets would be inserted a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ingest.core.collapse import collapse
from ingest.core.isolation import write_groups_isolating
from ingest.dlq.base import DlqEntry
from ingest.dlq.postgres import PostgresDlq, entry_row
from ingest.config.base import PgNetworkSettings
from ingest.drivers.postgres import STALE_SESSION_CODES, classify, connect, translate
from ingest.errors import PermanentError, TransientError
from ingest.sinks.base import ColumnarBatch, ExactlyOnceResult
from ingest.types import DeleteRow, Failure, Item, Partition

if TYPE_CHECKING:
    from ingest.config import PipelineSettings
    from ingest.sinks.postgres.sink import PostgresSink

log = logging.getLogger(__name__)

LANE_OFFSETS_TABLE = "ingest_lane_offsets"
OFFSETS_TABLE = "ingest_offsets"
#: Routing schemes (see the module docstring): what a lane's offsets were written under.
ROUTING_RECORD_KEY = "kafka-key"
ROUTING_ROW_KEY = "row-key"


class LaneOffsets:
    """SQL for the per-(partition, lane) offsets of one pipeline under one lane mapping."""

    def __init__(self, schema: str, pipeline: str, lanes: int, routing: str = ROUTING_RECORD_KEY) -> None:
        self.pipeline = pipeline
        self.lanes = lanes
        self.routing = routing
        t = sql.Identifier(schema, LANE_OFFSETS_TABLE)
        self._ensure = sql.SQL(
            'INSERT INTO {t} (pipeline, topic, "partition", lanes, routing, lane, next_offset) '
            "VALUES (%s, %s, %s, %s, %s, %s, 0) ON CONFLICT DO NOTHING"
        ).format(t=t)
        self._lock = sql.SQL(
            'SELECT topic, "partition", next_offset FROM {t} WHERE pipeline = %s AND lanes = %s AND routing = %s '
            'AND lane = %s AND (topic, "partition") IN (SELECT * FROM unnest(%s::text[], %s::int[])) '
            'ORDER BY topic, "partition" FOR UPDATE'
        ).format(t=t)
        self._advance = sql.SQL(
            'UPDATE {t} SET next_offset = GREATEST(next_offset, %s), updated_at = now() '
            'WHERE pipeline = %s AND topic = %s AND "partition" = %s AND lanes = %s AND routing = %s AND lane = %s'
        ).format(t=t)

    def lock(self, conn: psycopg.Connection[Any], lane: int, tps: Sequence[Partition]) -> dict[Partition, int]:
        """Create missing rows, lock them, return the stored next offsets."""
        with conn.cursor() as cur:
            cur.executemany(self._ensure, [(self.pipeline, tp.topic, tp.partition, self.lanes, self.routing, lane)
                                           for tp in tps])
            cur.execute(self._lock, (self.pipeline, self.lanes, self.routing, lane, [tp.topic for tp in tps],
                                     [tp.partition for tp in tps]))
            return {Partition(topic, part): off for topic, part, off in cur.fetchall()}

    def advance(self, conn: psycopg.Connection[Any], lane: int, next_offsets: dict[Partition, int]) -> None:
        with conn.cursor() as cur:
            cur.executemany(
                self._advance,
                [(off, self.pipeline, tp.topic, tp.partition, self.lanes, self.routing, lane)
                 for tp, off in next_offsets.items()],
            )


class StoredOffsets:
    """The contiguous watermark per partition in ``ingest_offsets`` (read on assign, written per commit tick)."""

    def __init__(self, dsn: str, schema: str, pipeline: str, network: PgNetworkSettings | None = None,
                 statement_timeout_ms: int = 60_000) -> None:
        self._dsn = dsn
        self._network = network or PgNetworkSettings()
        self._statement_timeout_ms = statement_timeout_ms
        self._pipeline = pipeline
        self._conn: psycopg.Connection[Any] | None = None
        t = sql.Identifier(schema, OFFSETS_TABLE)
        self._table = t
        self._select = sql.SQL(
            'SELECT topic, "partition", next_offset FROM {t} WHERE pipeline = %s '
            'AND (topic, "partition") IN (SELECT * FROM unnest(%s::text[], %s::int[]))'
        ).format(t=t)
        self._upsert = sql.SQL(
            'INSERT INTO {t} (pipeline, topic, "partition", next_offset) VALUES (%s, %s, %s, %s) '
            'ON CONFLICT (pipeline, topic, "partition") DO UPDATE '
            "SET next_offset = GREATEST({t}.next_offset, EXCLUDED.next_offset), updated_at = now()"
        ).format(t=t)

    def _connection(self) -> psycopg.Connection[Any]:
        """One long-lived autocommit connection (the pipeline thread stores offsets every commit tick)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = connect(self._dsn, self._network, statement_timeout_ms=self._statement_timeout_ms,
                                 autocommit=True)
        return self._conn

    def _run(self, fn: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        try:
            return fn(self._connection())
        except psycopg.Error as exc:
            if self._conn is not None and getattr(exc, "sqlstate", None) in STALE_SESSION_CODES:
                self._conn.close()  # a read-only session stays read-only: the retry needs a new one
            if self._conn is not None and (self._conn.broken or self._conn.closed):
                self._conn = None
            raise classify(exc) from exc

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def load(self, tps: Iterable[Partition]) -> dict[Partition, int]:
        """Raises TransientError when the database is unreachable (the caller retries)."""
        tps = list(tps)
        rows = self._run(lambda conn: conn.execute(
            self._select, (self._pipeline, [t.topic for t in tps], [t.partition for t in tps])).fetchall())
        return {Partition(topic, part): off for topic, part, off in rows}

    def load_all(self) -> dict[Partition, int]:
        """Every stored watermark of the pipeline (for ``ingest lag``)."""
        query = sql.SQL('SELECT topic, "partition", next_offset FROM {t} WHERE pipeline = %s').format(
            t=self._table)
        try:
            with connect(self._dsn, self._network, statement_timeout_ms=self._statement_timeout_ms) as conn:
                rows = conn.execute(query, (self._pipeline,)).fetchall()
        except psycopg.Error as exc:
            raise classify(exc) from exc
        return {Partition(topic, part): off for topic, part, off in rows}

    def save(self, watermarks: dict[Partition, int]) -> None:
        if not watermarks:
            return

        def upsert(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(self._upsert, [(self._pipeline, tp.topic, tp.partition, off)
                                               for tp, off in watermarks.items()])

        self._run(upsert)


def split_fresh(items: Sequence[Item], stored: dict[Partition, int]) -> tuple[list[Item], dict[Partition, int]]:
    """Steps 2 and 5's input, pure: the records of a lane batch not written yet, and the new next offsets.

    ``stored``: the lane's stored next offset per partition (missing: 0). Returns
    ``(fresh, high)``: the records at or above their partition's stored offset, in batch order,
    each offset once (a record read twice -- a partition lost and handed back -- is one record),
    and one past the highest offset of each partition in the batch.
    """
    high: dict[Partition, int] = {}
    seen: set[tuple[Partition, int]] = set()
    fresh: list[Item] = []
    for item in items:
        tp, offset = item.record.tp, item.record.offset
        if offset + 1 > high.get(tp, -1):
            high[tp] = offset + 1
        if offset >= stored.get(tp, 0) and (tp, offset) not in seen:
            seen.add((tp, offset))
            fresh.append(item)
    return fresh, high


class ExactlyOnceWriter:
    """One lane batch as a single transaction: steps 1-5 of the module docstring.

    Built by the backend for a pipeline with ``sink.delivery: exactly_once``; its DLQ must be the
    PostgreSQL table in the sink's database (validated), whose rows join the transaction.
    """

    def __init__(self, sink: PostgresSink, pipeline: PipelineSettings, dlq: PostgresDlq) -> None:
        cfg = pipeline.sink
        self._sink = sink
        self._pipeline = pipeline.name
        self._dlq = dlq
        self._rule = pipeline.collapse_rule()
        routing = ROUTING_ROW_KEY if self._rule.key_index is not None else ROUTING_RECORD_KEY
        self._lane_offsets = LaneOffsets(cfg.db_schema, pipeline.name, pipeline.lanes, routing)  # type: ignore[attr-defined]

    def __call__(self, lane: int, items: Sequence[Item], columnar: ColumnarBatch | None = None) -> ExactlyOnceResult:
        """Steps 1-5 for ``items`` (mapped; or unmapped, with ``columnar``: the tier's plan of exactly
        these items). Raises TransientError (the whole transaction rolled back: retry) or
        UnclassifiedError."""
        try:
            with translate() as t, self._sink.connection() as conn:
                t.conn = conn
                self._sink.before_transaction(conn, [item.row for item in items])
                with conn.transaction():
                    return self._in_transaction(conn, lane, items, columnar)
        except PermanentError as err:
            # Outside the savepoints (offsets, DLQ rows) nothing is the data's fault: retry.
            raise TransientError(str(err), sqlstate=err.sqlstate, error_class="exactly_once_tx") from err

    def _in_transaction(self, conn: psycopg.Connection[Any], lane: int, items: Sequence[Item],
                        columnar: ColumnarBatch | None = None) -> ExactlyOnceResult:
        stored = self._lane_offsets.lock(conn, lane, sorted({it.record.tp for it in items}))
        fresh, high = split_fresh(items, stored)
        already_written = len(items) - len(fresh)
        calls = [0]
        if columnar is not None:
            if not already_written:  # the payload stands for every item: write it, else map the fresh ones
                calls[0] += 1
                if self._columnar_written(conn, columnar.payload):
                    entries = [DlqEntry(self._pipeline, item.record, failure) for item, failure in columnar.poison]
                    return self._finish(conn, lane, high, entries,
                                        ExactlyOnceResult(columnar.rows, entries, calls[0], 0, columnar.deletes,
                                                          columnar=True))
            fresh = columnar.map_rows(fresh)
        failed, groups = collapse(fresh, self._rule)
        entries = [DlqEntry(self._pipeline, item.record, item.failure) for item in failed]  # type: ignore[arg-type]

        def savepoint_write(piece: Sequence[Item]) -> None:
            calls[0] += 1
            with translate(conn), conn.transaction():  # a SAVEPOINT inside the batch transaction
                self._sink.write_rows_in(conn, [item.row for item in piece])  # type: ignore[misc]

        written, poison = write_groups_isolating(groups, savepoint_write)
        entries += [DlqEntry(self._pipeline, item.record, Failure.from_write_error(exc)) for item, exc in poison]
        deleted = sum(1 for item in written if isinstance(item.row, DeleteRow))
        return self._finish(conn, lane, high, entries, ExactlyOnceResult(
            len(written), entries, calls[0], already_written, deleted, written, [item for item, _ in poison]))

    def _finish(self, conn: psycopg.Connection[Any], lane: int, high: dict[Partition, int], entries: list[DlqEntry],
                result: ExactlyOnceResult) -> ExactlyOnceResult:
        """Steps 4 and 5: the DLQ rows and the lane's new offsets, in the batch's transaction."""
        if entries:
            with conn.cursor() as cur:
                self._dlq.put_in(cur, [entry_row(e) for e in entries])
        self._lane_offsets.advance(conn, lane, high)
        return result

    def _columnar_written(self, conn: psycopg.Connection[Any], payload: Any) -> bool:
        """The columnar write of a batch in a SAVEPOINT: True when it applied; False when it failed and
        was rolled back to the savepoint (a value the database refuses, or anything else the row path
        will judge). A transient error propagates: the whole transaction is retried, as by rows."""
        try:
            with translate(conn), conn.transaction():
                self._sink.write_encoded_in(conn, payload)  # type: ignore[attr-defined]
            return True
        except TransientError:
            raise
        except Exception as exc:  # noqa: BLE001 - the row path maps, isolates and classifies the records
            log.info("columnar write failed (%s); writing the batch by rows", type(exc).__name__,
                     extra={"pipeline": self._pipeline, "error_class": getattr(exc, "error_class", None)})
            return False

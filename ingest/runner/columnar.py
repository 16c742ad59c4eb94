"""The columnar tier (the ``columnar`` setting; on wherever it fits): map and write a whole batch at once.

With the tier on, the accept loop does not map records: it tracks, sizes and batches them (items
with neither row nor failure). When a batch is handed to its lane, :meth:`BatchWriter.prepare
<ingest.runner.writer.BatchWriter.prepare>` (on the pipeline thread) passes it to
:meth:`ColumnarTier.build` (:class:`~ingest.core.mapping.columnar.ColumnarPlan`: one C decode,
Arrow columns, collapse) and has the sink encode it (``encode_columns``: PostgreSQL's CSV,
ClickHouse's Arrow types), and the lane only writes it (``write_encoded``: one CSV COPY and one
upsert, or one Arrow insert) while the pipeline thread maps the next batch. A batch the sink
cannot encode (a value its conversion refuses) goes by rows, where that value's record is poison.

The row path stays the authority. Records the plan rejects are mapped by the row mapper: when each
of them is poison, they go to the DLQ beside the columnar write (a poison record has no row, so
the other rows collapse as they would without it); when any of them maps to a row after all, or
the plan declines the batch, or the columnar write raises, the whole batch is mapped record by
record and written by the row path -- retries, poison isolation and all. A columnar write that
failed rolled back, and the row path's upsert is idempotent, so the second attempt is safe.

The tier turns itself off for good when more than ``MAX_DECLINED_SHARE`` of the first
``REVIEW_RECORDS`` records it was offered had to go by rows (a stream it does not fit: fields no
column reads, nested values...); it is logged at ``info``.

:func:`columnar_tier` decides whether a pipeline can have the tier at all (plain JSON values, JSON Schema
values (the JSON after the wire-format prefix: read as plain JSON, wherever plain JSON is), Avro values or
(into PostgreSQL) Protobuf values, or Debezium change events in any of those formats with hard or soft
deletes into one PostgreSQL table, whose plan is :class:`~ingest.cdc.columnar.ChangePlan` (each event
unwrapped by the row mapper's own decoder and envelope code) and whose records the row mapper handles
without a row, a no-op tombstone or an ignored truncate, are done with the batch and counted as skipped
--, a sink that declares the ``columnar`` capability and takes the plan's columns, the last or
highest-version record of a key wins, with more than one lane keys the plan can route by:
:meth:`ColumnarPlan.lane_keys <ingest.core.mapping.columnar.ColumnarPlan.lane_keys>` gives the accept
loop what the row path routes each record by, without mapping it; transforms -- if any -- that the
tier evaluates: :mod:`ingest.core.transforms.columnar`); a pipeline that can has it unless its
configuration says ``columnar: false``. Records a transform's filter drops have no row and are counted
per filter (:attr:`ColumnarPlanned.filtered`), whether the plan or the row mapper dropped them.

Exactly-once pipelines (``sink.delivery: exactly_once``) have the tier too, with one lane or into a
table without a conflict key (then every record routes by its Kafka key, or without one by its
offset, on either tier: a record's lane never depends on the tier, which the lane offsets need).
A batch the tier took is written in the batch's exactly-once transaction
(:class:`~ingest.sinks.postgres.exactly_once.ExactlyOnceWriter`): the columnar write in a savepoint,
its poison records' DLQ rows and the lane's offsets; when records of it were already written by an
earlier run, or the columnar write fails, the transaction maps and writes the fresh records by rows.
"""

from __future__ import annotations

import importlib.util
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ingest.config import PipelineSettings
from ingest.core.mapping import Mapper
from ingest.core.mapping.columnar import ColumnarPlan
from ingest.errors import Filtered, InvalidRecord, NoChange
from ingest.types import Failure, Item, Record

_record_of = operator.attrgetter("record")

log = logging.getLogger(__name__)

#: The tier reviews itself once over this many records ...
REVIEW_RECORDS = 4096
#: ... and turns off when more than this share of them went by rows.
MAX_DECLINED_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class ColumnarPlanned:
    """A batch the tier took: its collapsed rows as the sink encoded them (``encode_columns``), how
    many rows that is, its poison records, each with its failure, for the DLQ, and the records a
    transform's filter dropped (no row; done with the batch), with how many each filter dropped."""

    payload: Any
    rows: int
    poison: list[tuple[Item, Failure]]
    filtered_items: list[Item] = field(default_factory=list)
    filtered: Counter[str] = field(default_factory=Counter)
    #: records the row mapper handles without a row (a no-op tombstone, an ignored truncate: ingest.cdc),
    #: done with the batch and counted as ``skipped``, as the row path counts them
    unchanged: list[Item] = field(default_factory=list)
    #: of ``rows``, the rows that delete their key (change events: ingest.cdc.columnar)
    deletes: int = 0
    #: a pipeline routing to many tables: the rows of each table (the payload holds one part per table)
    rows_by_table: Counter[str] | None = None


class ColumnarTier:
    """A pipeline's columnar tier: its plan, its sink's columnar write and the row mapper.
    Thread-safe (its review counters are locked)."""

    def __init__(self, pipeline: str, plan: ColumnarPlan, encode: Callable[[Any], Any], write: Callable[..., None],
                 map_record: Callable[[Record], tuple[tuple[Any, ...], bytes | None]]) -> None:
        self._pipeline = pipeline
        self._plan = plan
        #: ``encode(table)``: the sink's payload for a plan's table (pure; raises for a value it refuses)
        self._encode = encode
        #: ``write(payload, token=None)``: the sink's columnar write (raises like ``Sink.write``; ``token``
        #: as there: the insert token of the records behind the rows, for sinks that take one)
        self.write = write
        self._map = map_record
        self._lock = threading.Lock()
        self._offered = self._declined = 0
        self.on = True

    def build(self, items: Sequence[Item], records: Sequence[Record] | None = None,
              listed: dict[str, list[Any]] | None = None) -> ColumnarPlanned | None:
        """The batch as a columnar write plus its poison records, or None: map and write it by rows.
        ``records``: the items' records, when the caller has listed them; ``listed``: fields of them
        it has listed too (see :meth:`ColumnarPlan.build`). Never raises for any record content."""
        if not self.on:
            return None
        built = self._plan.build(list(map(_record_of, items)) if records is None else records, listed)
        poison: list[tuple[Item, Failure]] = []
        filtered_items: list[Item] = []
        unchanged: list[Item] = []
        filtered: Counter[str] = Counter()
        if built is not None:
            for label, positions in built.filtered.items():  # dropped by a transform's filter
                filtered[label] += len(positions)
                filtered_items += map(items.__getitem__, positions)
            for i in built.rejected:
                try:
                    failure = self.map_item(items[i]).failure
                except Filtered as exc:  # the row path's transforms drop it: no row, as the plan's filtered
                    filtered[exc.step] += 1
                    filtered_items.append(items[i])
                    continue
                except NoChange:  # handled without a row (a no-op tombstone, an ignored truncate)
                    unchanged.append(items[i])
                    continue
                if failure is None:  # the row mapper takes it: the whole batch goes by rows
                    built = None
                    break
                poison.append((items[i], failure))
        payload = None
        if built is not None:
            try:
                payload = self._encode(built.table)
            except Exception as exc:  # noqa: BLE001 - a value the sink refuses: the row path decides
                log.info("columnar batch not encoded (%s); writing it by rows", type(exc).__name__,
                         extra={"pipeline": self._pipeline, "error_class": getattr(exc, "error_class", None)})
                built = None
        self._review(len(items), built is None)
        if built is None:
            return None
        table = built.table
        rows = table.num_rows if table is not None else 0
        deletes = _deletes(table) if rows else 0
        return ColumnarPlanned(payload, rows, poison, filtered_items, filtered, unchanged, deletes)

    def map_items(self, items: Sequence[Item]) -> tuple[list[Item], Counter[str], int]:
        """``items`` mapped by the row mapper (:meth:`map_item`) but for those a transform's filter drops
        and those handled without a row (:class:`~ingest.errors.NoChange`), how many each filter dropped,
        and how many were handled without a row otherwise."""
        mapped: list[Item] = []
        filtered: Counter[str] = Counter()
        unchanged = 0
        for item in items:
            try:
                mapped.append(self.map_item(item))
            except Filtered as exc:
                filtered[exc.step] += 1
            except NoChange:
                unchanged += 1
        return mapped, filtered, unchanged

    def lane_keys(self, records: Sequence[Record]) -> list[Any]:
        """What each record is routed to a lane by, as the row path routes it, or ``UNROUTED`` where
        only the row mapper can say (:meth:`ColumnarPlan.lane_keys`)."""
        return self._plan.lane_keys(records)

    def map_item(self, item: Item) -> Item:
        """``item`` mapped by the row mapper: with its row, or with its failure (poison). Raises
        :class:`~ingest.errors.Filtered` for a record a transform's filter drops."""
        try:
            row, _ = self._map(item.record)
            return Item(item.record, row, None, item.epoch, item.size_bytes)
        except InvalidRecord as exc:
            return Item(item.record, None, Failure(exc.stage, exc.error_class, exc.message), item.epoch,
                        item.size_bytes)

    def _review(self, records: int, declined: bool) -> None:
        with self._lock:
            self._offered += records
            self._declined += records if declined else 0
            if self._offered < REVIEW_RECORDS:
                return
            if self._declined > MAX_DECLINED_SHARE * self._offered:
                self.on = False
                log.info("columnar batches off: %d of %d records had to be mapped by rows (fields no column "
                         "reads, nested values, values of other types)", self._declined, self._offered,
                         extra={"pipeline": self._pipeline})
            self._offered = self._declined = 0


def _deletes(table: Any) -> int:
    """How many rows of a planned table delete (its ``_ingest_deleted`` flag; 0 without one)."""
    if "_ingest_deleted" not in table.column_names:
        return 0
    import pyarrow.compute as pc

    return int(pc.sum(table.column("_ingest_deleted").cast("int64")).as_py() or 0)


class RoutedColumnarTier(ColumnarTier):
    """The columnar tier of a pipeline routing to many tables by a template that reads the topic only
    (``{topic}``, pattern groups: :mod:`ingest.mirror.router`): a batch is split by table, each part
    planned (collapsed per key within its table) and encoded on its own, and the payload -- one
    ``(table, encoded part)`` per table -- written in one transaction (the sink's ``write_encoded``).
    A record whose table cannot be resolved is poison (stage ``route``, class ``unroutable``), as on
    the row path; a part the plan declines sends the whole batch by rows."""

    def __init__(self, pipeline: str, plan: ColumnarPlan, encode_parts: Callable[[list[tuple[str, Any]]], Any],
                 write: Callable[..., None], map_record: Callable[[Record], tuple[tuple[Any, ...], bytes | None]],
                 *, table_of: Callable[[Record], str]) -> None:
        """``encode_parts([(table, pyarrow.Table), ...])``: the sink's payload of a batch's parts."""
        super().__init__(pipeline, plan, _unencoded, write, map_record)
        self._encode_parts = encode_parts
        self._table_of = table_of

    def build(self, items: Sequence[Item], records: Sequence[Record] | None = None,
              listed: dict[str, list[Any]] | None = None) -> ColumnarPlanned | None:
        if not self.on:
            return None
        records = list(map(_record_of, items)) if records is None else records
        parts: dict[str, list[int]] = {}
        tables: dict[str, str | InvalidRecord] = {}  # topic -> table: the template reads the topic only
        poison: list[tuple[Item, Failure]] = []
        filtered_items: list[Item] = []
        unchanged: list[Item] = []
        filtered: Counter[str] = Counter()
        for i, record in enumerate(records):
            table = tables.get(record.topic)
            if table is None:
                try:
                    table = tables[record.topic] = self._table_of(record)
                except InvalidRecord as exc:  # unroutable: dead-lettered as the row path would
                    table = tables[record.topic] = exc
            if isinstance(table, InvalidRecord):  # the row mapper says why (its own errors come first)
                try:
                    failure = self.map_item(items[i]).failure
                except Filtered as exc:
                    filtered[exc.step] += 1
                    filtered_items.append(items[i])
                    continue
                except NoChange:  # handled without a row
                    unchanged.append(items[i])
                    continue
                poison.append((items[i], failure or Failure(table.stage, table.error_class, table.message)))
            else:
                parts.setdefault(table, []).append(i)
        payload: list[tuple[str, Any]] = []
        rows: Counter[str] = Counter()
        for table, positions in parts.items():
            part_items = [items[i] for i in positions]
            planned = super().build(items, records, listed) if len(positions) == len(items) \
                else super().build(part_items, [records[i] for i in positions])
            if planned is None:  # one part by rows: the whole batch (it is reviewed once, here)
                return None
            payload.append((table, planned.payload))
            poison += planned.poison
            filtered_items += planned.filtered_items
            filtered.update(planned.filtered)
            unchanged += planned.unchanged
            rows[table] = planned.rows
        try:
            encoded = self._encode_parts(payload)
        except Exception as exc:  # noqa: BLE001 - a value the sink refuses: the row path decides
            log.info("columnar batch not encoded (%s); writing it by rows", type(exc).__name__,
                     extra={"pipeline": self._pipeline, "error_class": getattr(exc, "error_class", None)})
            return None
        return ColumnarPlanned(encoded, sum(rows.values()), poison, filtered_items, filtered, unchanged,
                               rows_by_table=rows)


def _unencoded(table: Any) -> Any:
    """A part's plan as it is: :class:`RoutedColumnarTier` encodes the parts together."""
    return table


def _use_system_allocator() -> None:
    """Arrow's buffers from the C library's allocator: the batches are small and short-lived, and
    jemalloc's background purging cost measurably more CPU per record here (own CPU of a 200k-record
    run: 13.2 µs with jemalloc, 10.4-11.6 µs with the system allocator)."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


def columnar_tier(p: PipelineSettings, sink: Any, *, columnar_capable: bool, exactly_once: bool,
                  mapper: Callable[[], Mapper], said: Callable[[str], None] | None = None) -> ColumnarTier | None:
    """The pipeline's columnar tier when the pipeline can have it and ``p.columnar`` is not false, else
    None. Either way the tier is logged at start-up with, for rows, the first reason (a warning when
    the pipeline asked for it, ``columnar: true``, and cannot have it), and ``said`` (when given) hears
    it as :func:`write_tier` words it. ``mapper()`` builds the row mapper the pipeline thread would use."""
    why, plan, row_mapper = _decide(p, sink, columnar_capable=columnar_capable, exactly_once=exactly_once,
                                    mapper=mapper)
    if why is not None or plan is None or row_mapper is None:
        log.log(logging.WARNING if p.columnar else logging.INFO, "pipeline %r: write tier: rows (%s)", p.name, why,
                extra={"pipeline": p.name, "tier": "rows", "why": why})
        if said is not None:
            said(f"rows ({why})")
        return None
    log.info("pipeline %r: write tier: columnar", p.name, extra={"pipeline": p.name, "tier": "columnar"})
    if said is not None:
        said("columnar")
    _use_system_allocator()
    if p.routes_tables:
        return RoutedColumnarTier(p.name, plan, sink.encode_routed, sink.write_encoded, row_mapper.map,
                                  table_of=row_mapper.router.table)  # type: ignore[attr-defined]
    return ColumnarTier(p.name, plan, sink.encode_columns, sink.write_encoded, row_mapper.map)


def write_tier(p: PipelineSettings, sink: Any, *, columnar_capable: bool, exactly_once: bool,
               mapper: Callable[[], Mapper]) -> str:
    """``columnar``, or ``rows (<the first reason>)``: what :func:`columnar_tier` would choose (for
    ``ingest check``; ``sink`` is told the columns as the run would tell it)."""
    why, plan, _ = _decide(p, sink, columnar_capable=columnar_capable, exactly_once=exactly_once, mapper=mapper)
    return "columnar" if why is None and plan is not None else f"rows ({why})"


def _deletes_refusal(p: PipelineSettings) -> str | None:
    """Why a pipeline whose records delete writes by rows, or None: the tier takes Debezium change events
    with hard deletes into one PostgreSQL table (ingest.cdc.columnar)."""
    if p.envelope != "debezium":
        return "deletes by tombstones (envelope: none) are written by rows"
    if p.sink.kind != "postgres":
        return f"a {p.sink.kind} table whose records delete is written by rows"
    if p.routes_tables:
        return "routed tables whose records delete are written by rows"
    if p.transforms:
        return "a change pipeline's transforms run on the row path"
    return None


#: How the reasons name a registry format.
FORMAT_NAMES = {"avro": "Avro", "protobuf": "Protobuf"}


def _decide(p: PipelineSettings, sink: Any, *, columnar_capable: bool, exactly_once: bool,
            mapper: Callable[[], Mapper]) -> tuple[str | None, ColumnarPlan | None, Mapper | None]:
    """``(why not, plan, row mapper)``: why the pipeline writes by rows (the first reason; None when
    it can have the tier), and the plan and row mapper of the tier."""
    if p.columnar is False:
        return "columnar: false", None, None
    rule = p.collapse_rule()
    why = None
    if not columnar_capable:
        why = f"sink kind {p.sink.kind!r} has no columnar write"
    elif exactly_once and p.lanes != 1 and rule.key_index is not None:
        # Lane offsets hold only under one routing: the tier may route a poison record by its key column,
        # the row path by its Kafka key, so a restart on the other tier could skip it as written.
        why = "exactly-once delivery with lanes above 1 into a table with a conflict key writes by rows"
    elif exactly_once and p.routes_tables and (p.has_deletes or p.envelope != "none"):
        why = "exactly-once delivery of change events into many tables writes by rows"
    elif p.format not in ("json", "json_schema", "avro", "protobuf") or p.envelope not in ("none", "debezium"):
        why = "it reads plain JSON, JSON Schema, Avro or Protobuf values only (and their Debezium change events)"
    elif p.format == "json_schema" and p.transforms:
        why = "a JSON Schema pipeline's transforms run on the row path (not tested on the tier yet)"
    elif p.has_deletes and (why := _deletes_refusal(p)) is not None:
        pass
    elif rule.key_index is not None and (rule.keep != "last" or (rule.merge_deletes and not p.has_deletes)):
        why = "its collapse rule is not 'the last (or highest-version) record of a key wins'"
    elif importlib.util.find_spec("pyarrow") is None:
        why = "pyarrow is not installed (pip install 'ingest[columnar]')"
    if why is not None:
        return why, None, None
    row_mapper = mapper()
    plan = row_mapper.columnar_plan(rule.key_index, rule.version_index)
    if plan is None:
        return row_mapper.columnar_refusal(rule.key_index, rule.version_index) or "its columns cannot be staged", \
            None, None
    if p.routes_tables and (exactly_once or p.has_deletes or p.envelope != "none" or p.auto_columns
                            or p.sink.kind != "postgres" or p.format != "json"):
        return ("a pipeline routing to many tables has the tier for plain JSON rows into PostgreSQL at least "
                "once, without deletes and with listed columns"), None, None
    if p.lanes != 1 and plan.route_refusal is not None:
        return f"lanes: {p.lanes} route by the mapped row's key: {plan.route_refusal}", None, None
    try:
        sink.use_columnar(plan.columns)
    except ValueError as exc:  # the sink cannot write these columns (or this table) by columns
        return str(exc), None, None
    return None, plan, row_mapper

"""Records → (table, row) for pipelines whose ``sink.table`` is a template (issue #36).

A routed pipeline's rows carry their table as one more value at the end (after the sink's own
columns, hidden ones included): :func:`with_table` puts it there, :func:`table_of` reads it and
:func:`without_table` gives the row the table gets. Keeping the table *in* the row means everything
that works on rows keeps working across tables unchanged: the collapse key and the lane a row goes
to include the table (:meth:`ingest.config.PipelineSettings.collapse_rule`), a delete stays a
:class:`~ingest.types.DeleteRow`, the isolation of poison rows, replay and exactly-once see rows as
always; only the sink groups a batch's rows by table (:class:`ingest.sinks.postgres.sink.PostgresSink`).

:class:`TableRouter` renders the template for a record (:mod:`.template`), turns the result into
an identifier (:func:`.names.sanitize_table`: dots become ``_``, too long or reserved names are
refused) and refuses a second spelling of a name the database folds to the same one
(:class:`.names.NameGuard`). :class:`RoutingMapper` wraps the pipeline's own mapper (decode,
transforms, columns) and adds the table; a record whose table cannot be resolved raises
:class:`~.errors.Unroutable` (stage ``route``, class ``unroutable``): it is dead-lettered, never
dropped and never written into another table. Offsets stay the source topic-partition's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ingest.core.topics import TopicSelector
from ingest.errors import InvalidRecord, NoChange
from ingest.mirror.errors import Unroutable
from ingest.mirror.names import NameGuard, Reserved, sanitize_table
from ingest.mirror.template import TableTemplate, pattern_groups
from ingest.types import DeleteRow, Record

__all__ = ["RoutingMapper", "TableRouter", "table_of", "with_table", "without_table"]

log = logging.getLogger(__name__)

#: The tombstone table of a routed table with deletes: ``<table><suffix>`` (PostgreSQL).
TOMBSTONE_SUFFIX = "_ingest_deleted"


def with_table(row: tuple[Any, ...], table: str) -> tuple[Any, ...]:
    """``row`` with ``table`` appended, of the same kind (a delete stays a delete)."""
    if isinstance(row, DeleteRow):
        return type(row)((*row, table))
    return (*row, table)


def table_of(row: tuple[Any, ...]) -> str:
    """The table a routed row goes to."""
    return row[-1]


def without_table(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """The row the table gets (its table value removed), of the same kind."""
    if isinstance(row, DeleteRow):
        return type(row)(row[:-1])
    return row[:-1]


class TableRouter:
    """Which table a record goes to. Thread-safe (the guard is locked; the cache is a plain dict whose
    races only recompute a name)."""

    def __init__(self, template: TableTemplate, selector: TopicSelector, dialect: str, *,
                 reserved: Reserved | None = None, deletes: bool = False, database: str = "default") -> None:
        """``deletes``: the tables get a tombstone table (its longer name must fit too)."""
        self.template = template
        self._selector = selector
        self._dialect = dialect
        self._reserved = reserved
        self._suffixes = (TOMBSTONE_SUFFIX,) if deletes and dialect == "postgres" else ()
        self._database = database
        self._guard = NameGuard(dialect)
        #: rendered name → identifier (the guard already passed)
        self._names: dict[str, str] = {}
        #: topic → its pattern groups
        self._groups: dict[str, dict[str, str | None]] = {}
        self._existing: Callable[[], list[str]] | None = None

    def table(self, record: Record, source: Any = None) -> str:
        """The table of ``record`` (``source``: its change event's source block, when the template reads
        one). Raises :class:`Unroutable`."""
        topic = record.source_position[0]
        groups = self._groups.get(topic)
        if groups is None:
            groups = self._groups[topic] = pattern_groups(self._selector, topic)
        rendered = self.template.render(topic, groups=groups, source=source, headers=record.headers)
        name = self._names.get(rendered)
        if name is None:
            if self._existing is not None:
                self._seed()
            name = sanitize_table(rendered, self._dialect, database=self._database, reserved=self._reserved,
                                  suffixes=self._suffixes)
            name = self._guard.claim(name)
            self._names[rendered] = name
        return name

    def seed_from(self, existing: Callable[[], list[str]]) -> None:
        """Where the names already in the database come from (``existing()``, e.g. the sink's catalog
        query): they own their folded spelling (rule 6 of :mod:`.names`). Asked before the first new
        name is claimed, and again for the next one while it fails (the database may be down at start)."""
        self._existing = existing

    def _seed(self) -> None:
        existing, self._existing = self._existing, None
        if existing is None:
            return
        try:
            names = existing()
        except Exception as exc:  # noqa: BLE001 - best effort; asked again for the next new name
            log.warning("could not read the existing tables (case collisions with them go unnoticed until "
                        "it works)", extra={"error": type(exc).__name__})
            self._existing = existing
            return
        for name in names:
            self._guard.claim_existing(name)


def tables_of_topics(p: Any, topics: Sequence[str],
                     existing: Sequence[str] = ()) -> list[tuple[str, str | None, str | None]]:
    """``(topic, table, why not)`` for each of ``topics`` that pipeline ``p`` reads (``p.topic_selector``),
    when its table template reads the topic only (``{topic}`` and pattern groups; else ``[]``): the table
    the topic's records go to, or why they cannot be routed (a second spelling of a name, among the
    topics or beside the ``existing`` tables, included)."""
    template = p.table_template
    if template.uses_source or any(part.kind == "header" for part in template.parts):
        return []
    selector = p.topic_selector
    out: list[tuple[str, str | None, str | None]] = []
    reserved = Reserved(p.dlq.table)
    guard = NameGuard(p.sink.kind, existing)  # two topics whose names fold to one: the first owns it
    for topic in selector.select(topics):
        try:
            rendered = template.render(topic, groups=pattern_groups(selector, topic))
            name = sanitize_table(rendered, p.sink.kind, reserved=reserved,
                                  database=getattr(p.sink, "database", "default"),
                                  suffixes=(TOMBSTONE_SUFFIX,) if p.has_deletes and p.sink.kind == "postgres" else ())
            out.append((topic, guard.claim(name), None))
        except Unroutable as exc:
            out.append((topic, None, exc.message))
    return out


class RoutingMapper:
    """The pipeline's mapper, with each row's table appended (see the module docstring).

    The mapper's contract: ``map(record) -> (row, ordering_key)``, raising InvalidRecord for poison
    (:class:`Unroutable` among them), NoChange / Filtered for records without a row. A template that
    reads the change event's source block gets it from the decoded value (Debezium's ``source``, in
    ``payload`` with the JSON converter's schemas); a tombstone has none, and is handled without a row
    (the delete event just before it deleted the row).
    """

    def __init__(self, mapper: Any, router: TableRouter, decode: Any = None) -> None:
        """``decode(record) -> document``: the value's decoder, for templates reading the source block."""
        self._mapper = mapper
        self.router = router
        self._decode = decode if router.template.uses_source else None
        self.column_names = [*mapper.column_names, "_ingest_table"]
        #: the template reads the records (the source block, a header), not the topic only
        self._reads_records = router.template.uses_source or any(part.kind == "header"
                                                                 for part in router.template.parts)
        self.column_types = getattr(mapper, "column_types", None)

    def __getattr__(self, name: str) -> Any:  # fast_misses, review_typed, skips_tombstones ...
        return getattr(self._mapper, name)

    def columnar_plan(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> Any:
        """The wrapped mapper's plan for the rows without their table (the columnar tier splits a batch by
        table itself: :class:`ingest.runner.columnar.RoutedColumnarTier`), or None when the template
        reads the records (the source block, a header): those rows take the row path."""
        if self._reads_records:
            return None
        return self._mapper.columnar_plan(self._own_key(key_index), version_index)

    def columnar_refusal(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> str | None:
        if self._reads_records:
            return "the table template reads the records (source block or headers): routed rows go by rows"
        return self._mapper.columnar_refusal(self._own_key(key_index), version_index)

    def _own_key(self, key_index: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The wrapped mapper's key positions: ``key_index`` without the table's (the last value)."""
        table_at = len(self._mapper.column_names)
        if key_index is None:
            return None
        return tuple(i for i in key_index if i != table_at) or None

    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        if self._decode is not None and record.value is None:
            raise NoChange("a tombstone: the delete event before it deleted the row")
        row, key = self._mapper.map(record)  # the record's own errors first (it decoded it)
        source = None
        if self._decode is not None:
            try:
                source = _source_block(self._decode(record))
            except Exception as exc:  # noqa: BLE001 - it decoded once already; never crash on a record
                raise InvalidRecord("decode", "undecodable", f"record value could not be decoded: {exc}"[:300]) from None
        return with_table(row, self.router.table(record, source)), key


def _source_block(doc: Any) -> Any:
    """A change event's ``source`` block (``payload.source`` with the JSON converter's schemas), or None."""
    if type(doc) is dict:
        payload = doc.get("payload")
        if type(payload) is dict and "source" in payload:
            return payload.get("source")
        return doc.get("source")
    return None

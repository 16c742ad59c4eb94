"""``tables:`` entries of a ``columns: auto`` sink: what one table (or the tables a glob matches) takes
instead of what its records' schemas say (README "Per-table overrides"), and the sink's ``version:``
(:class:`AutoVersionBase`).

The sink kinds subclass these with their own column types (:class:`ColumnOverrideBase`) and what only
they can do (PostgreSQL: ``deletes``). The mapper (:mod:`ingest.mirror.auto`) and the sinks read them
through :func:`ingest.mirror.auto.override_for`: an entry named exactly as the table wins, else the
first glob (in the order written) that matches it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from ingest.config.base import SOURCE_RE, Frozen, check_identifier

__all__ = ["AutoVersionBase", "ColumnOverrideBase", "TableOverrideBase", "tables_versioned"]

#: Column names starting with this are ingest's own (hidden source columns, carriers, delete marks).
RESERVED_PREFIX = "_ingest_"


class ColumnOverrideBase(Frozen):
    """One column of a ``tables:`` entry: its type instead of the type map's, or where its value comes from.

    ``source`` (with ``type``): the column takes this value instead of the schema field of its name --
    ``$.PATH`` in the row image (a change event's ``after`` / ``before``, or the value), ``@source.PATH``
    of a change event's source block, or record metadata (``@timestamp``, ``@offset``, ``@header.NAME``,
    ...). A column the schema lacks is added (nullable, unless it is in the table's key); a sourced
    value is coerced to ``type`` as a hand-written column's would be, so a bad one is poison naming the
    column."""

    type: str
    source: str | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        if value is not None and (not SOURCE_RE.match(value) or value == "@stream"):
            raise ValueError(f"invalid source {value!r}: use a path of the row image like '$.a.b', "
                             "@source.PATH, or record metadata (@key @topic @partition @offset @timestamp "
                             "@header.NAME)")
        return value


class TableOverrideBase(Frozen):
    """What every sink kind's ``tables:`` entry may set (see the module docstring)."""

    #: the table's key: these value columns instead of the record key's fields
    conflict_key: list[str] | None = None
    #: ``none``: append every record (no key, no upsert) even when the records have a key
    on_conflict: Literal["update", "none"] | None = None
    #: a column of the table (a schema field, or a sourced column) whose value orders its records: an
    #: update applies only when not older (the sink's version guard), the highest of a batch wins, and
    #: a record without one is poison (``missing_field``). Replaces the sink's ``version:`` for this table.
    version_column: str | None = None

    @model_validator(mode="after")
    def _one_key(self) -> TableOverrideBase:
        if self.on_conflict == "none" and self.conflict_key:
            raise ValueError("conflict_key and on_conflict none: an append-only table has no key")
        if self.on_conflict == "none" and self.version_column:
            raise ValueError("version_column and on_conflict none: an append-only table has no version guard")
        if self.conflict_key is not None and (not self.conflict_key or len(set(self.conflict_key)) != len(self.conflict_key)):
            raise ValueError("conflict_key lists at least one column, each once")
        if self.version_column is not None:
            check_identifier(self.version_column)
            if self.conflict_key and self.version_column in self.conflict_key:
                raise ValueError("version_column is a key column: a key's version never changes")
        return self


class AutoVersionBase(Frozen):
    """``version`` of a ``columns: auto`` sink: every keyed table gets column ``column`` holding ``source``
    (``@source.PATH`` of a change event, or record metadata such as ``@timestamp``) -- an update applies
    only when it is not older (PostgreSQL: the upsert's guard; ClickHouse: the table's
    ``ReplacingMergeTree`` version), the highest of a batch wins, and a record without one is poison.
    A table's own ``tables.NAME.version_column`` replaces it. The sink kinds add ``type`` (their types)."""

    column: str
    source: str

    @field_validator("column")
    @classmethod
    def _column(cls, value: str) -> str:
        if value.startswith(RESERVED_PREFIX):
            raise ValueError(f"names starting with {RESERVED_PREFIX!r} are reserved for ingest")
        return check_identifier(value)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if not value.startswith("@"):
            raise ValueError("the version comes from @source.PATH or record metadata (@offset, @timestamp)")
        return value


def tables_versioned(tables: Any) -> bool:
    """Raw ``tables:`` entries of which one names a ``version_column`` (the carriers then have a version)."""
    return isinstance(tables, dict) and any(isinstance(o, dict) and o.get("version_column") is not None
                                            for o in tables.values())

"""Settings of the PostgreSQL sink (``sink.kind: postgres``).

Tables that update rows (``on_conflict: update``) get two hidden columns, added
here like ClickHouse's hidden ``_version``: ``_ingest_stream`` (the topic and
partition of the record a row was last written from, as one 64-bit id) and
``_ingest_offset`` (its offset). Every upsert guards on them -- a record older
than the row *from the same partition* does not overwrite it -- and
``replay-dlq`` reads them to tell whether a dead-lettered record is older than
its row. ``migrate`` adds them to existing tables.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from ingest.config.base import (
    ColumnSpec,
    PgNetworkSettings,
    SinkSettingsBase,
    check_dsn_syntax,
    check_identifier,
)
from ingest.config.cdc import DeleteSettings
from ingest.config.overrides import (
    RESERVED_PREFIX,
    AutoVersionBase,
    ColumnOverrideBase,
    TableOverrideBase,
    tables_versioned,
)
from ingest.core.collapse import CollapseRule
from ingest.core.dialects import pg_base_type

#: Hidden columns of tables that update rows: where each row was last written from.
STREAM_COLUMN, OFFSET_COLUMN = "_ingest_stream", "_ingest_offset"
SOURCE_COLUMNS: dict[str, dict[str, str]] = {
    STREAM_COLUMN: {"type": "bigint", "source": "@stream"},
    OFFSET_COLUMN: {"type": "bigint", "source": "@offset"},
}


class ColumnOverride(ColumnOverrideBase):
    """A column of a ``tables:`` entry: its PostgreSQL type instead of the type map's, and optionally
    where its value comes from (:class:`~ingest.config.overrides.ColumnOverrideBase`)."""

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        """A type PostgreSQL makes: numeric precision 1-1000 (scale within it), varchar length 1-10485760."""
        base, full = pg_base_type(value)
        modifiers = [int(m) for m in re.findall(r"\d+", full[len(base):])] if "(" in full else []
        if base == "numeric" and modifiers and not (1 <= modifiers[0] <= 1000
                                                    and (len(modifiers) < 2 or 0 <= modifiers[1] <= modifiers[0])):
            raise ValueError(f"{value!r}: numeric precision is 1 to 1000, its scale 0 to the precision")
        if base == "varchar" and modifiers and not 1 <= modifiers[0] <= 10_485_760:
            raise ValueError(f"{value!r}: varchar length is 1 to 10485760")
        return value


class TableDeletes(DeleteSettings):
    """``deletes`` of a ``tables:`` entry: how this table's deletes are written (the pipeline's
    ``deletes`` settings, but each routed table has its own ``<table>_ingest_deleted``)."""

    @field_validator("tombstone_table")
    @classmethod
    def _no_tombstone_name(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("each routed table gets its own <table>_ingest_deleted: leave tombstone_table out")
        return value


class TableOverride(TableOverrideBase):
    """A ``tables:`` entry of a PostgreSQL ``columns: auto`` sink (see :mod:`ingest.config.overrides`)."""

    #: column → its type, and optionally its source (a column the schema lacks is added only with a source)
    columns: dict[str, ColumnOverride] = Field(default_factory=dict)
    #: how this table's deletes are written, instead of the pipeline's ``deletes`` (hard or soft)
    deletes: TableDeletes | None = None

    @model_validator(mode="after")
    def _append_only_has_no_deletes(self) -> TableOverride:
        if self.on_conflict == "none" and self.deletes is not None:
            raise ValueError("deletes and on_conflict none: an append-only table has no key to delete by")
        return self


class AutoVersion(AutoVersionBase):
    """``version`` of a PostgreSQL ``columns: auto`` sink (:class:`~ingest.config.overrides.AutoVersionBase`)."""

    type: Literal["bigint", "integer", "timestamptz", "numeric"] = "bigint"


class PostgresSinkSettings(SinkSettingsBase):
    """Write batches into one PostgreSQL table with an idempotent upsert."""

    kind: Literal["postgres"] = "postgres"
    dsn: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/postgres")
    db_schema: str = Field(default="public", alias="schema")
    conflict_key: list[str] = Field(default_factory=list)
    #: update: ``ON CONFLICT DO UPDATE`` (last record wins); nothing: ``DO NOTHING``
    #: (first write wins); none: plain INSERT (append-only tables, no conflict key).
    on_conflict: Literal["update", "nothing", "none"] = "update"
    #: Optional column whose value must not go backwards: an update only applies
    #: when ``EXCLUDED.version >= current.version``, inside a batch too (the
    #: record with the highest version wins). Typically an event time, a source
    #: sequence number, or ``source: '@offset'`` (which orders the records of one
    #: partition only). Required: a record without a version is poison
    #: (``missing_field``), unless the column has a ``default``.
    version_column: str | None = None
    #: Connections in the pool (at least one per lane is used).
    pool_size: int = Field(default=0, ge=0, le=256)
    statement_timeout_ms: int = Field(default=60_000, ge=0)
    #: How a silent connection is noticed: client-side bound, keepalives, tcp_user_timeout.
    network: PgNetworkSettings = PgNetworkSettings()
    #: ``copy``: COPY into a temp stage then INSERT .. SELECT .. ON CONFLICT (fastest);
    #: ``values``: multi-row INSERT .. VALUES (for poolers that forbid temp tables).
    write_method: Literal["copy", "values"] = "copy"
    #: Guard the upsert's update with ``(t.cols) IS DISTINCT FROM (EXCLUDED.cols)`` over every column it
    #: sets (the hidden source columns and a soft-delete column included): a row the update would leave
    #: as it is -- the same record applied again, a replay after a crash -- is not rewritten (no new
    #: row version, no dead tuple, no WAL, no ``UPDATE`` trigger). ``false`` rewrites it, for tables
    #: whose ``ON UPDATE`` triggers must see every upsert.
    skip_unchanged: bool = True
    #: at_least_once: idempotent upserts, Kafka commits; exactly_once: offsets stored in the
    #: same transaction as the rows (see ingest/sinks/postgres/exactly_once.py); needs the DLQ in this database.
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"
    #: ``columns: auto`` (ingest.mirror.auto): each table's columns and key come from the schema its
    #: records were written with; set from ``columns: auto``, never written by hand.
    auto_columns: bool = False
    #: With ``columns: auto``: how a table follows its schema (ingest.mirror.evolve): ``off`` (a
    #: difference is ``schema_incompatible``), ``add_columns`` (new fields become nullable columns),
    #: ``add_and_widen`` (also int → bigint, float → double, varchar(n) → text, decimal precision up).
    evolve: Literal["off", "add_columns", "add_and_widen"] = "add_columns"
    #: With ``columns: auto``: one version column for every table (see :class:`AutoVersion`).
    version: AutoVersion | None = None
    #: With ``columns: auto``: per-table overrides, by resolved table name or glob (see :class:`TableOverride`).
    tables: dict[str, TableOverride] = Field(default_factory=dict)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True)

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, value: SecretStr) -> SecretStr:
        return check_dsn_syntax(value)  # type: ignore[return-value]

    @model_validator(mode="before")
    @classmethod
    def _version_required(cls, data: Any) -> Any:
        """A version column without a default is required: a NULL version could never update its row."""
        return _add_source_columns(_require_version(auto_columns(data)))

    @property
    def tracks_sources(self) -> bool:
        """Rows carry the hidden source columns (tables that update rows)."""
        return STREAM_COLUMN in self.columns

    def collapse_rule(self) -> CollapseRule:
        """How this table collapses a batch's records of one row (see ingest.core.collapse)."""
        if self.on_conflict == "none":
            return CollapseRule(None)
        names = list(self.columns)
        return CollapseRule(tuple(names.index(k) for k in self.conflict_key),
                            "first" if self.on_conflict == "nothing" else "last",
                            names.index(self.version_column) if self.version_column else None)

    def check_deletes(self, deletes: Any) -> None:
        if self.write_method != "copy":
            raise ValueError("deletes need sink.write_method copy (they are staged with the upserts)")
        tombstones = deletes.tombstone_table or f"{self.table}_ingest_deleted"
        if len(tombstones.encode()) > 63:
            raise ValueError(f"the tombstone table name {tombstones!r} is over 63 bytes: set deletes.tombstone_table")
        if deletes.mode == "soft" and deletes.soft_column in self.columns:
            raise ValueError(f"deletes.soft_column {deletes.soft_column!r} is managed by ingest: do not list it "
                             "among the columns")

    def explode_refusal(self) -> str | None:
        if self.on_conflict != "update":
            return "explode needs sink.on_conflict update (children follow their parent row)"
        if self.version_column is not None:
            return "explode does not combine with sink.version_column yet"
        if self.write_method != "copy":
            return "explode needs sink.write_method copy (child rows are staged)"
        return None

    def child_table(self, table: str, columns: dict[str, ColumnSpec], key: list[str]) -> PostgresSinkSettings:
        """See :meth:`SinkSettingsBase.child_table`: updated by key, with the hidden source columns."""
        base = self.model_dump(by_alias=True, exclude={"table", "columns", "conflict_key", "version_column",
                                                       "on_conflict", "delivery"})
        return PostgresSinkSettings.model_validate({
            **base, "dsn": self.dsn, "table": table, "on_conflict": "update", "conflict_key": list(key),
            "columns": {name: spec.model_dump(exclude_none=True) for name, spec in columns.items()}})

    @field_validator("columns")
    @classmethod
    def _pg_types(cls, value: dict[str, ColumnSpec]) -> dict[str, ColumnSpec]:
        for name, spec in value.items():
            try:
                pg_base_type(spec.type)
            except ValueError as exc:
                raise ValueError(f"column {name!r}: {exc}") from None
        return value

    @field_validator("db_schema")
    @classmethod
    def _schema_name(cls, value: str) -> str:
        return check_identifier(value)

    @property
    def exactly_once(self) -> bool:
        return self.delivery == "exactly_once"

    @property
    def postgres_dsn(self) -> SecretStr | None:
        return self.dsn

    @model_validator(mode="after")
    def _keys(self) -> PostgresSinkSettings:
        if self.auto_columns and self.write_method != "copy":
            raise ValueError("columns: auto needs write_method copy (each table's rows are staged)")
        missing = [k for k in self.conflict_key if k not in self.columns]
        if missing:
            raise ValueError(f"conflict_key {missing} not among columns {list(self.columns)}")
        if self.on_conflict != "none" and not self.conflict_key:
            raise ValueError("conflict_key is required unless on_conflict is 'none'")
        if len(set(self.conflict_key)) != len(self.conflict_key):
            raise ValueError("conflict_key lists a column twice")
        if self.version_column is not None and self.version_column not in self.columns:
            raise ValueError(f"version_column {self.version_column!r} not among columns")
        return self




def auto_columns(data: Any) -> Any:
    """Raw sink settings with ``columns: auto`` → the carrier columns of :mod:`ingest.mirror.auto` and
    ``auto_columns: true``; ``conflict_key`` must then be ``auto`` or left out (each table's key is its
    records' key). ``version: {column, source, type}`` names one version column for every table: the
    carrier's last value (:data:`~ingest.mirror.auto.CARRIER_VERSION`), the sink's version column. Other
    settings pass unchanged."""
    if not isinstance(data, dict) or (data.get("auto_columns") is True and data.get("columns") != "auto"):
        return data  # not a sink's settings, or settings made here already (a dump validated again)
    if data.get("columns") != "auto":
        if data.get("conflict_key") == "auto":
            raise ValueError("conflict_key: auto goes with columns: auto (the key of a schema's table)")
        if data.get("version") is not None:
            raise ValueError("version: goes with columns: auto (with a column list, set version_column)")
        if data.get("tables"):
            raise ValueError("tables: per-table overrides go with columns: auto")
        return data
    from ingest.mirror.auto import CARRIER_KEY, CARRIER_VERSION, carrier_columns  # mirror imports no settings

    if data.get("conflict_key", "auto") != "auto":
        raise ValueError("columns: auto takes each table's key from its records' key: set conflict_key: auto "
                         "(or leave it out)")
    if data.get("version_column") is not None:
        raise ValueError("version_column: with columns: auto, name the version of every table with "
                         "version: {column: NAME, source: '@source.lsn'}")
    if data.get("on_conflict", "update") != "update":
        raise ValueError("columns: auto upserts keyed tables and appends to tables without a key: "
                         "leave on_conflict out")
    columns: dict[str, Any] = {**carrier_columns(), **SOURCE_COLUMNS}
    out = {**data, "conflict_key": [CARRIER_KEY], "auto_columns": True}
    version = data.get("version")
    if version is not None:
        spec = AutoVersion.model_validate(version)
        columns[CARRIER_VERSION] = {"type": spec.type, "source": spec.source, "required": True}
        out["version_column"] = CARRIER_VERSION
    elif tables_versioned(data.get("tables")):  # the slot each table fills from its own column (or 0)
        columns[CARRIER_VERSION] = {"type": "bigint", "source": "@offset", "required": True}
        out["version_column"] = CARRIER_VERSION
    out["columns"] = columns
    return out


def _add_source_columns(data: Any) -> Any:
    """Add the hidden source columns to raw settings of a table that updates rows (see the module
    docstring); a user column may not take a reserved name."""
    if not isinstance(data, dict) or data.get("on_conflict", "update") != "update":
        return data
    columns = data.get("columns")
    if not isinstance(columns, dict) or not columns:
        return data
    for name, spec in columns.items():
        if data.get("auto_columns"):
            break  # the carrier columns (ingest.mirror.auto)
        if str(name).startswith(RESERVED_PREFIX) and SOURCE_COLUMNS.get(name) != _plain(spec):
            raise ValueError(f"column {name!r}: names starting with {RESERVED_PREFIX!r} are reserved for ingest")
    if all(name in columns for name in SOURCE_COLUMNS):
        return data
    return {**data, "columns": {**columns, **SOURCE_COLUMNS}}


def _plain(spec: Any) -> Any:
    """A column spec as the dict it was written as (for comparing with the hidden ones)."""
    if isinstance(spec, ColumnSpec):
        spec = spec.model_dump()
    if isinstance(spec, dict):
        return {k: v for k, v in spec.items() if v is not None and v is not False}
    return spec


def _require_version(data: Any) -> Any:
    """``columns[version_column].required = True`` in raw sink settings, unless the column has a default."""
    if not isinstance(data, dict):
        return data
    version, columns = data.get("version_column"), data.get("columns")
    if not isinstance(version, str) or not isinstance(columns, dict) or version not in columns:
        return data
    spec = columns[version]
    if isinstance(spec, dict) and spec.get("default") is None and not spec.get("required"):
        return {**data, "columns": {**columns, version: {**spec, "required": True}}}
    if isinstance(spec, ColumnSpec) and spec.default is None and not spec.required:
        return {**data, "columns": {**columns, version: spec.model_copy(update={"required": True})}}
    return data



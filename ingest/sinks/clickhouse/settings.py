"""Settings of the ClickHouse sink (``sink.kind: clickhouse``)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from ingest.config.base import ColumnSpec, Frozen, SinkSettingsBase, check_identifier
from ingest.config.overrides import AutoVersionBase, ColumnOverrideBase, TableOverrideBase, tables_versioned
from ingest.core.collapse import CollapseRule
from ingest.core.dialects import ChType, ch_type, ch_version_refusal


class ClickHouseColumnSpec(ColumnSpec):
    """A column of a ClickHouse sink: ``type`` is a ClickHouse type (see :func:`ch_type`)."""

    #: Which type system ``type`` belongs to; read by the mapper.
    dialect: ClassVar[str] = "clickhouse"

    @field_validator("type")
    @classmethod
    def _ch_type(cls, value: str) -> str:
        return ch_type(value).name


#: The hidden column of tables with deletes: 1 marks a delete (``ReplacingMergeTree(version, _ingest_deleted)``).
DELETED_COLUMN = "_ingest_deleted"
#: Name of the hidden version column added when ``version_column`` is not set.
CH_DEFAULT_VERSION_COLUMN = "_version"
CH_URL_RE = re.compile(r"^(https?://[^\s/]+/?|chdb://memory(/[^\s/]*)?|chdb://[^\s]+)$")


class ChColumnOverride(ColumnOverrideBase):
    """A column of a ``tables:`` entry: its ClickHouse type instead of the type map's (without
    ``Nullable``: the schema says whether the column may hold NULL), and optionally its source."""

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        t = ch_type(value)
        if t.nullable:
            raise ValueError(f"{value!r}: give the type without Nullable (the schema's field says it)")
        return value


class ChAutoVersion(AutoVersionBase):
    """``version`` of a ClickHouse ``columns: auto`` sink (:class:`~ingest.config.overrides.AutoVersionBase`):
    every keyed table is ``ReplacingMergeTree(column[, _ingest_deleted])``, so ``type`` is one a
    ReplacingMergeTree version may have (:func:`~ingest.core.dialects.ch_version_refusal`)."""

    type: str = "UInt64"

    @field_validator("column")
    @classmethod
    def _not_hidden_version(cls, value: str) -> str:
        if value == CH_DEFAULT_VERSION_COLUMN:
            raise ValueError(f"{value!r} is the hidden version of tables versioned by the Kafka offset: "
                             "name the column otherwise")
        return value

    @field_validator("type")
    @classmethod
    def _version_type(cls, value: str) -> str:
        refusal = ch_version_refusal(value)
        if refusal is not None:
            raise ValueError(f"{value!r}: {refusal}")
        return ch_type(value).name


class ChTableOverride(TableOverrideBase):
    """A ``tables:`` entry of a ClickHouse ``columns: auto`` sink (see :mod:`ingest.config.overrides`)."""

    #: column → its type, and optionally its source (a column the schema lacks is added only with a source)
    columns: dict[str, ChColumnOverride] = Field(default_factory=dict)


class ClickHouseSinkSettings(SinkSettingsBase):
    """Write batches into a ClickHouse ``ReplacingMergeTree`` table (see ``ingest/sinks/clickhouse.py``).

    ``url``: ``http(s)://host:port`` for a server, or ``chdb:///abs/path`` /
    ``chdb://memory`` for clickhouse-connect's in-process chDB engine.
    ``order_by`` is the dedup key (the table's sorting key): rows with equal
    keys collapse to the one with the highest ``version_column`` at merge time
    or with ``SELECT ... FINAL``. Without ``version_column`` a hidden column
    ``_version UInt64`` fed from the Kafka offset (``source: '@offset'``) is
    added, so the record consumed last wins -- which is only meaningful when
    all records of one key come from one partition (keyed by the Kafka key);
    otherwise name a column (an event time or sequence number).
    """

    kind: Literal["clickhouse"]
    columns: dict[str, ClickHouseColumnSpec]  # type: ignore[assignment]
    url: str = "http://127.0.0.1:8123"
    database: str = "default"
    user: str = "default"
    password: SecretStr = SecretStr("")
    order_by: list[str] = Field(default_factory=list)
    version_column: str | None = None
    compression: Literal["lz4", "zstd", "gzip", "none"] = "lz4"
    #: ClickHouse settings sent with every insert (e.g. ``async_insert: 0``).
    settings: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: Create ``Replicated...`` tables ``ON CLUSTER`` this cluster.
    cluster: str | None = None
    #: ``non_replicated_deduplication_window`` of the table: how many recent insert
    #: tokens a non-replicated table remembers (a retried batch older than that is
    #: inserted again; ReplacingMergeTree still collapses it).
    deduplication_window: int = Field(default=1000, ge=1, le=1_000_000)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    send_receive_timeout_s: float = Field(default=300.0, gt=0)
    #: ``auto``: insert ``FORMAT Arrow`` when pyarrow is installed and every column type has an
    #: Arrow counterpart (see ingest/sinks/clickhouse/arrow.py), else Native; ``native``: always Native.
    insert_format: Literal["auto", "native"] = "auto"
    #: ``columns: auto`` (ingest.mirror.auto, ingest.sinks.clickhouse.auto): each table's columns and
    #: sorting key come from the schema its records were written with; set from ``columns: auto``.
    auto_columns: bool = False
    #: With ``columns: auto``: how a table follows its schema (ingest.mirror.evolve): ``off``,
    #: ``add_columns`` (new fields become ``Nullable`` columns) or ``add_and_widen``.
    evolve: Literal["off", "add_columns", "add_and_widen"] = "add_columns"
    #: With ``columns: auto``: per-table overrides, by resolved table name or glob (see
    #: :class:`ChTableOverride`).
    tables: dict[str, ChTableOverride] = Field(default_factory=dict)
    #: With ``columns: auto``: one version column for every keyed table, its ReplacingMergeTree version
    #: (see :class:`ChAutoVersion`); None: each table is versioned by the Kafka offset (``_version``).
    version: ChAutoVersion | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_version(cls, data: Any) -> Any:
        """Without ``version_column``: add the hidden ``_version UInt64`` column fed from ``@offset``.
        ``columns: auto``: the carrier columns instead (:func:`auto_columns`)."""
        data = auto_columns(data)
        if not isinstance(data, dict) or data.get("version_column") is not None:
            return data
        columns = data.get("columns")
        if not isinstance(columns, dict) or not columns or CH_DEFAULT_VERSION_COLUMN in columns:
            return data  # empty columns: reported by the columns validator; a clash: by _keys
        return {
            **data,
            "columns": {**columns, CH_DEFAULT_VERSION_COLUMN: {"type": "UInt64", "source": "@offset"}},
            "version_column": CH_DEFAULT_VERSION_COLUMN,
        }

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not CH_URL_RE.match(value):
            raise ValueError(
                f"invalid ClickHouse url {value!r}: use http(s)://host:port, chdb:///absolute/path or chdb://memory"
            )
        return value

    @field_validator("database")
    @classmethod
    def _database(cls, value: str) -> str:
        return check_identifier(value)

    @model_validator(mode="after")
    def _keys(self) -> ClickHouseSinkSettings:
        missing = [k for k in self.order_by if k not in self.columns]
        if missing:
            raise ValueError(f"order_by {missing} not among columns {list(self.columns)}")
        if not self.order_by:
            raise ValueError("order_by is required")
        if len(set(self.order_by)) != len(self.order_by):
            raise ValueError("order_by lists a column twice")
        for k in self.order_by:
            t = ch_type(self.columns[k].type)
            if t.nullable or t.kind == "array":
                raise ValueError(f"order_by column {k!r} cannot be {t.name}: sorting key columns must not be "
                                 "Nullable or Array")
        if self.version_column is None:
            raise ValueError(f"column {CH_DEFAULT_VERSION_COLUMN!r} is reserved for the default version "
                             "(the Kafka offset); rename it or set version_column")
        if self.version_column not in self.columns:
            raise ValueError(f"version_column {self.version_column!r} not among columns")
        vt = ch_type(self.columns[self.version_column].type)
        if vt.kind not in ("int", "date", "datetime64") or vt.name.startswith("Int"):
            raise ValueError(f"version_column {self.version_column!r} has type {vt.name}; "
                             "ReplacingMergeTree needs UInt8-64, Date or DateTime64 (not Nullable)")
        if self.version_column in self.order_by:
            raise ValueError("version_column cannot be part of order_by")
        return self

    def check_deletes(self, deletes: Any) -> None:
        if deletes.mode != "hard":
            raise ValueError("ClickHouse deletes are hard (rows with _ingest_deleted = 1, hidden by FINAL): "
                             "set deletes.mode hard")
        if DELETED_COLUMN in self.columns:
            raise ValueError(f"column {DELETED_COLUMN!r} is managed by ingest: do not list it among the columns")

    def explode_refusal(self) -> str | None:
        if self.version_column != CH_DEFAULT_VERSION_COLUMN:
            return "explode does not combine with sink.version_column yet (children are versioned by offset)"
        return None

    def check_explode(self, explode: Any) -> None:
        """The values ingest compares with what it reads back from ClickHouse (the parent's sorting key,
        the child's key and its parent link) must come back as the mapper makes them: integer, text,
        decimal and UUID columns (a DateTime64 comes back as a datetime, the mapper's is its ticks)."""
        child = self.child_table(explode.table, dict(explode.columns), list(explode.conflict_key))
        for where, cfg, names in (("sink.order_by", self, self.order_by),
                                  ("explode.conflict_key", child, explode.conflict_key),
                                  ("explode.parent", child, list(explode.parent))):
            for name in names:
                t = cfg.ch_types[name]
                t = t.inner if t.kind in ("nullable", "lowcardinality") and t.inner is not None else t
                if t.kind not in _EXPLODE_COMPARABLE:
                    raise ValueError(f"{where}: column {name!r} is {cfg.ch_types[name].name}; with explode on "
                                     f"ClickHouse these columns must be integer, String, Decimal or UUID columns")

    def child_table(self, table: str, columns: dict[str, Any], key: list[str]) -> ClickHouseSinkSettings:
        """See :meth:`SinkSettingsBase.child_table`: ordered by ``key``, versioned by offset (the
        hidden ``_version``), in this sink's database."""
        base = self.model_dump(by_alias=True, exclude={"table", "columns", "order_by", "version_column"})
        return ClickHouseSinkSettings.model_validate({
            **base, "password": self.password, "table": table, "order_by": list(key),
            "columns": {name: spec.model_dump(exclude_none=True) for name, spec in columns.items()}})

    def delete_filler(self) -> list[Any]:
        """A delete row's other columns: each type's zero value (non-Nullable columns cannot hold NULL;
        FINAL hides the row anyway)."""
        return [_zero(t) for t in self.ch_types.values()]

    def collapse_rule(self) -> CollapseRule:
        """Rows collapse by the sorting key, the highest version winning (as ReplacingMergeTree keeps it)."""
        names = list(self.columns)
        assert self.version_column is not None
        return CollapseRule(tuple(names.index(k) for k in self.order_by), "last", names.index(self.version_column))

    @property
    def ch_types(self) -> dict[str, ChType]:
        """Parsed ClickHouse types by column, in column order."""
        return {name: ch_type(spec.type) for name, spec in self.columns.items()}




def auto_columns(data: Any) -> Any:
    """Raw sink settings with ``columns: auto`` → the carrier columns of :mod:`ingest.mirror.auto` with
    ClickHouse types, ``order_by`` the carrier's key, and ``auto_columns: true``. ``order_by`` /
    ``conflict_key`` may be ``auto`` or left out (each table is ordered by its records' key);
    ``version_column`` and ``cluster`` are refused (not supported with ``columns: auto``).

    The batch collapses each key to the record its table keeps (``version_column``): the highest
    carrier version (:data:`~ingest.mirror.auto.CARRIER_VERSION`) when the carriers have one -- the
    sink's ``version:``, or a table's own ``tables.NAME.version_column`` (tables without one: 0, the
    last record wins) -- else the highest offset, as the hidden ``_version`` keeps it. Other settings
    pass unchanged."""
    if not isinstance(data, dict):
        return data
    if data.get("columns") != "auto":
        for name in ("order_by", "conflict_key"):
            if data.get(name) == "auto":
                raise ValueError(f"{name}: auto goes with columns: auto (the key of a schema's table)")
        if not data.get("auto_columns"):  # not settings made here already (a dump validated again)
            if data.get("tables"):
                raise ValueError("tables: per-table overrides go with columns: auto")
            if data.get("version") is not None:
                raise ValueError("version: goes with columns: auto (with a column list, set version_column)")
        return data
    from ingest.mirror.auto import CARRIER_KEY, CARRIER_SHAPE, CARRIER_VALUES, CARRIER_VERSION  # imports no settings

    out = dict(data)
    for name in ("order_by", "conflict_key"):
        if out.pop(name, "auto") not in ("auto", None):
            raise ValueError(f"columns: auto orders each table by its records' key: set {name}: auto "
                             "(or leave it out)")
    if out.get("version_column") is not None:
        raise ValueError("version_column: with columns: auto, name the version of every table with "
                         "version: {column: NAME, source: '@source.lsn'}, or a table's own with "
                         "tables: {NAME: {version_column: COLUMN}}")
    if out.get("cluster") is not None:
        raise ValueError("cluster: not supported with columns: auto yet")
    columns: dict[str, Any] = {CARRIER_KEY: {"type": "String"}, CARRIER_SHAPE: {"type": "String"},
                               CARRIER_VALUES: {"type": "String"}, AUTO_STREAM_COLUMN: {"type": "Int64"},
                               AUTO_OFFSET_COLUMN: {"type": "UInt64"}}
    version_column = AUTO_OFFSET_COLUMN
    if out.get("version") is not None or tables_versioned(out.get("tables")):
        # the carriers' version slot: its values are the mapper's (ingest.cdc.mapper), not this spec's
        columns[CARRIER_VERSION] = {"type": "UInt64", "source": "@offset", "required": True}
        version_column = CARRIER_VERSION
    out["columns"] = columns
    return {**out, "order_by": [CARRIER_KEY], "version_column": version_column, "auto_columns": True}


#: The carrier's source columns (ingest.mirror.auto: stream and offset); the offset versions each table.
AUTO_STREAM_COLUMN, AUTO_OFFSET_COLUMN = "_ingest_stream", "_ingest_offset"


#: ClickHouse column kinds whose values come back from a query as the mapper makes them (explode compares them)
_EXPLODE_COMPARABLE = frozenset(("int", "string", "decimal", "uuid"))


def _zero(t: ChType) -> Any:
    """The value the mapper produces for ``t`` that stands for "nothing" (a delete row's filler)."""
    from datetime import date
    from decimal import Decimal
    from uuid import UUID

    if t.nullable:
        return None
    kind = t.inner.kind if t.kind == "lowcardinality" and t.inner is not None else t.kind
    return {"int": 0, "float": 0.0, "decimal": Decimal(0), "string": "", "json": "{}", "bool": False,
            "date": date(1970, 1, 1), "datetime64": 0, "uuid": UUID(int=0), "array": []}.get(kind)

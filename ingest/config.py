"""Configuration: frozen pydantic-settings models loaded from one YAML file.

Sources, highest priority first:

1. environment variables ``INGEST_<SECTION>__<KEY>`` (``__`` separates nesting
   levels, e.g. ``INGEST_KAFKA__BOOTSTRAP_SERVERS=host:9092``; a list such as
   ``pipelines`` can only be replaced whole, as JSON),
2. the YAML file given by ``--config`` or ``INGEST_CONFIG``,
3. the defaults below.

Every model forbids unknown keys and is frozen. Secrets (database DSNs and
passwords, librdkafka ``sasl.password`` / ``ssl.key.password``) are
:class:`pydantic.SecretStr` and print as ``**********``.

:func:`load_settings` turns any validation failure into a :class:`ConfigError`
whose message names the file, the field path and the problem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from ingest.core.collapse import CollapseRule
from ingest.errors import ConfigError

#: PostgreSQL column types the mapper can coerce to, by base name. A type may
#: carry a modifier, e.g. ``numeric(12,2)`` or ``varchar(64)``; the database
#: enforces the modifier and rejects violating rows (they become poison rows).
PG_TYPES: frozenset[str] = frozenset(
    {
        "smallint", "integer", "bigint", "numeric", "real", "double precision",
        "text", "varchar", "boolean", "timestamptz", "timestamp", "date",
        "jsonb", "json", "uuid", "bytea",
    }
)
PG_TYPE_ALIASES: dict[str, str] = {
    "int": "integer", "int4": "integer", "int8": "bigint", "int2": "smallint",
    "float8": "double precision", "float4": "real", "decimal": "numeric",
    "bool": "boolean", "character varying": "varchar",
    "timestamp with time zone": "timestamptz", "timestamp without time zone": "timestamp",
}
_TYPE_RE = re.compile(r"^\s*([a-z][a-z0-9 ]*?)\s*(\(\s*\d+\s*(,\s*\d+\s*)?\))?\s*$")

_SOURCE_RE = re.compile(r"^(\$(\.[^.\[\]]+|\[\d+\])*|@(key|topic|partition|offset|timestamp|header\.[^\s]+))$")
_SECRET_CLIENT_KEYS = ("password", "secret", "sasl.oauthbearer.config", "ssl.key.pem")


def pg_base_type(type_name: str) -> tuple[str, str]:
    """Return ``(base, full)`` for a PostgreSQL column type, e.g. ``('numeric', 'numeric(12,2)')``.

    Raises ValueError for a type the mapper does not support.
    """
    match = _TYPE_RE.match(type_name.lower())
    if not match:
        raise ValueError(f"unsupported column type {type_name!r}")
    base = PG_TYPE_ALIASES.get(match.group(1), match.group(1))
    if base not in PG_TYPES:
        raise ValueError(
            f"unsupported column type {type_name!r}; supported: {', '.join(sorted(PG_TYPES))}"
        )
    modifier = (match.group(2) or "").replace(" ", "")
    if modifier and base not in ("numeric", "varchar", "timestamptz", "timestamp"):
        raise ValueError(f"column type {base!r} takes no modifier {modifier!r}")
    return base, base + modifier


#: ClickHouse integer types and their ranges.
CH_INT_RANGES: dict[str, tuple[int, int]] = {
    "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1), "UInt32": (0, 2**32 - 1), "UInt64": (0, 2**64 - 1),
    "Int8": (-(2**7), 2**7 - 1), "Int16": (-(2**15), 2**15 - 1),
    "Int32": (-(2**31), 2**31 - 1), "Int64": (-(2**63), 2**63 - 1),
}
#: ClickHouse types without parameters, by name -> kind. ``JSON`` is JSON stored as ``String``.
_CH_SIMPLE: dict[str, str] = {
    **{name: "int" for name in CH_INT_RANGES},
    "Float32": "float", "Float64": "float", "String": "string", "Bool": "bool", "Date": "date",
    "UUID": "uuid", "JSON": "json",
}
CH_SUPPORTED = (
    "UInt8/16/32/64, Int8/16/32/64, Float32, Float64, Decimal(P,S), String, LowCardinality(String), Bool, "
    "Date, DateTime64(3), UUID, JSON (stored as String), Nullable(T), Array(T)"
)
_CH_TOKEN = re.compile(r"\s*([A-Za-z][A-Za-z0-9]*|\d+|'[^']*'|[(),])")


@dataclass(frozen=True, slots=True)
class ChType:
    """A parsed ClickHouse column type.

    ``name`` is the canonical spelling in the config (``Nullable(JSON)``), ``ddl``
    the ClickHouse type it creates and inserts as (``Nullable(String)``).
    ``kind``: int, float, decimal, string, bool, date, datetime64, uuid, json,
    nullable, array or lowcardinality; ``inner`` is set for the last three.
    """

    kind: str
    name: str
    ddl: str
    inner: ChType | None = None
    precision: int = 0
    scale: int = 0

    @property
    def nullable(self) -> bool:
        return self.kind == "nullable" or (self.kind == "lowcardinality" and self.inner is not None
                                           and self.inner.nullable)


def ch_type(type_name: str) -> ChType:
    """Parse a ClickHouse column type the mapper supports; ValueError (naming the type) otherwise.

    Names are case-sensitive, as in ClickHouse. Supported: see :data:`CH_SUPPORTED`.
    """
    tokens = _CH_TOKEN.findall(type_name)
    if "".join(tokens) != "".join(type_name.split()) or not tokens:
        raise ValueError(f"unsupported column type {type_name!r}; supported: {CH_SUPPORTED}")
    pos = 0

    def bad(why: str = "") -> ValueError:
        return ValueError(f"unsupported column type {type_name!r}{': ' + why if why else ''}; "
                          f"supported: {CH_SUPPORTED}")

    def take(expected: str | None = None) -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise bad()
        tok = tokens[pos]
        if expected is not None and tok != expected:
            raise bad()
        pos += 1
        return tok

    def number(lo: int, hi: int, what: str) -> int:
        tok = take()
        if not tok.isdigit() or not lo <= int(tok) <= hi:
            raise bad(f"{what} must be {lo}..{hi}")
        return int(tok)

    def parse() -> ChType:
        name = take()
        if name in _CH_SIMPLE:
            kind = _CH_SIMPLE[name]
            return ChType(kind, name, "String" if kind == "json" else name)
        if name == "Decimal":
            take("(")
            p = number(1, 76, "Decimal precision")
            s = 0
            if pos < len(tokens) and tokens[pos] == ",":
                take(",")
                s = number(0, p, "Decimal scale")
            take(")")
            return ChType("decimal", f"Decimal({p}, {s})", f"Decimal({p}, {s})", precision=p, scale=s)
        if name == "DateTime64":
            take("(")
            p = number(0, 9, "DateTime64 precision")
            tz = ""
            if pos < len(tokens) and tokens[pos] == ",":
                take(",")
                tz = take()
                if not (tz.startswith("'") and len(tz) > 2):
                    raise bad("DateTime64 time zone must be a quoted name")
                tz = f", {tz}"
            take(")")
            return ChType("datetime64", f"DateTime64({p}{tz})", f"DateTime64({p}{tz})", precision=p)
        if name in ("Nullable", "Array", "LowCardinality"):
            take("(")
            inner = parse()
            take(")")
            if name == "Nullable":
                if inner.kind in ("nullable", "array", "lowcardinality"):
                    raise bad(f"Nullable cannot contain {inner.name}")
                return ChType("nullable", f"Nullable({inner.name})", f"Nullable({inner.ddl})", inner)
            if name == "Array":
                if inner.kind == "lowcardinality":
                    raise bad("Array(LowCardinality(...)) is not supported")
                return ChType("array", f"Array({inner.name})", f"Array({inner.ddl})", inner)
            base = inner.inner if inner.kind == "nullable" else inner
            if base is None or base.kind != "string":
                raise bad("LowCardinality supports String and Nullable(String) only")
            return ChType("lowcardinality", f"LowCardinality({inner.name})", f"LowCardinality({inner.ddl})", inner)
        raise bad()

    result = parse()
    if pos != len(tokens):
        raise bad()
    return result


def check_dsn_syntax(dsn: SecretStr | None) -> SecretStr | None:
    """A PostgreSQL DSN libpq can parse; the error never quotes it (libpq's own message quotes the token
    it could not parse, which can be a piece of the password)."""
    if dsn is None:
        return None
    from psycopg import conninfo

    try:
        conninfo.conninfo_to_dict(dsn.get_secret_value())
    except Exception:  # noqa: BLE001 - psycopg.ProgrammingError carries libpq's text: never shown
        raise ValueError(
            "not a valid PostgreSQL connection string: use a URL (postgresql://user:password@host:port/db, "
            "with reserved characters of the password percent-encoded, e.g. % as %25, @ as %40, "
            "space as %20) or key=value pairs (password='quoted if it holds spaces or quotes')"
        ) from None
    return dsn


def _check_identifier(name: str) -> str:
    """Names reach SQL only through identifier quoting; here we only forbid what can never work."""
    if not name or "\x00" in name or len(name.encode()) > 63:
        raise ValueError(f"invalid SQL identifier {name!r}: must be 1-63 bytes without NUL")
    return name


class Frozen(BaseModel):
    # hide_input_in_errors: a validation error's text never carries the value (it may be a secret).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class KafkaSettings(Frozen):
    """Broker connection shared by every pipeline."""

    bootstrap_servers: str = "127.0.0.1:9092"
    #: Passthrough librdkafka settings (security.protocol, sasl.*, ssl.*, session.timeout.ms, ...).
    #: Values of keys that look secret are masked in every printout.
    client: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: Messages fetched per ``consume()`` call.
    consume_batch_size: int = Field(default=5000, ge=1, le=1_000_000)
    #: How long one ``consume()`` call waits for messages.
    poll_timeout_ms: int = Field(default=100, ge=1, le=60_000)

    def client_config(self) -> dict[str, Any]:
        """The librdkafka settings, secrets included (only for building clients)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.client}

    def redacted_client(self) -> dict[str, Any]:
        return {
            k: ("**********" if any(s in k for s in _SECRET_CLIENT_KEYS) else v) for k, v in self.client.items()
        }

    def __repr_args__(self):  # type: ignore[override]
        for name, value in super().__repr_args__():
            yield name, (self.redacted_client() if name == "client" else value)

    @field_serializer("client")
    def _mask_client(self, value: dict[str, Any]) -> dict[str, Any]:
        """Dumps (model_dump, JSON) never carry secret client values; building clients uses client_config()."""
        return self.redacted_client()


class BatchSettings(Frozen):
    """When a lane's ring buffer is flushed: whichever limit is reached first."""

    max_rows: int = Field(default=5000, ge=1, le=1_000_000)
    max_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_latency_ms: int = Field(default=500, ge=1)


class RetrySettings(Frozen):
    """Backoff for transient failures (exponential with full jitter).

    ``max_attempts: 0`` retries forever. When attempts run out the pipeline
    stops with an error (exit 1) without committing; data is never
    dead-lettered because a service was down.
    """

    max_attempts: int = Field(default=10, ge=0)
    initial_backoff_ms: int = Field(default=100, ge=1)
    max_backoff_ms: int = Field(default=30_000, ge=1)


class ColumnSpec(Frozen):
    """One target column: its database type and where its value comes from.

    ``source`` is a JSON path into the record value (``$.a.b``, ``$.items[0]``)
    or Kafka metadata (``@key``, ``@topic``, ``@partition``, ``@offset``,
    ``@timestamp``, ``@header.NAME``). Default: ``$.<column name>``.
    """

    type: str
    source: str | None = None
    required: bool = False
    default: Any = None

    @field_validator("source")
    @classmethod
    def _source_syntax(cls, value: str | None) -> str | None:
        if value is not None and not _SOURCE_RE.match(value):
            raise ValueError(
                f"invalid source {value!r}: use a JSON path like '$.a.b' or one of "
                "@key @topic @partition @offset @timestamp @header.NAME"
            )
        return value


class _SinkBase(Frozen):
    table: str
    columns: dict[str, ColumnSpec]
    #: Write budget of this database, shared by every pipeline of the process writing to it:
    #: at most this many batch writes at once, granted by priority with aging. None = no limit.
    #: When pipelines sharing a database disagree, the smallest value wins.
    max_concurrent_writes: int | None = Field(default=None, ge=1)

    @field_validator("table")
    @classmethod
    def _table_name(cls, value: str) -> str:
        return _check_identifier(value)

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: dict[str, ColumnSpec]) -> dict[str, ColumnSpec]:
        if not value:
            raise ValueError("at least one column is required")
        for name in value:
            _check_identifier(name)
        return value

    def column_source(self, name: str) -> str:
        return self.columns[name].source or f"$.{name}"


class PostgresSink(_SinkBase):
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
    #: ``copy``: COPY into a temp stage then INSERT .. SELECT .. ON CONFLICT (fastest);
    #: ``values``: multi-row INSERT .. VALUES (for poolers that forbid temp tables).
    write_method: Literal["copy", "values"] = "copy"
    #: at_least_once: idempotent upserts, Kafka commits; exactly_once: offsets stored in the
    #: same transaction as the rows (see ingest/exactly_once.py); needs the DLQ in this database.
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True)

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, value: SecretStr) -> SecretStr:
        return check_dsn_syntax(value)  # type: ignore[return-value]

    @model_validator(mode="before")
    @classmethod
    def _version_required(cls, data: Any) -> Any:
        """A version column without a default is required: a NULL version could never update its row."""
        return _require_version(data)

    def collapse_rule(self) -> CollapseRule:
        """How this table collapses a batch's records of one row (see ingest.core.collapse)."""
        if self.on_conflict == "none":
            return CollapseRule(None)
        names = list(self.columns)
        return CollapseRule(tuple(names.index(k) for k in self.conflict_key),
                            "first" if self.on_conflict == "nothing" else "last",
                            names.index(self.version_column) if self.version_column else None)

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
        return _check_identifier(value)

    @model_validator(mode="after")
    def _keys(self) -> PostgresSink:
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


class ClickHouseColumnSpec(ColumnSpec):
    """A column of a ClickHouse sink: ``type`` is a ClickHouse type (see :func:`ch_type`)."""

    #: Which type system ``type`` belongs to; read by the mapper.
    dialect: ClassVar[str] = "clickhouse"

    @field_validator("type")
    @classmethod
    def _ch_type(cls, value: str) -> str:
        return ch_type(value).name


#: Name of the hidden version column added when ``version_column`` is not set.
CH_DEFAULT_VERSION_COLUMN = "_version"
CH_URL_RE = re.compile(r"^(https?://[^\s/]+/?|chdb://memory(/[^\s/]*)?|chdb://[^\s]+)$")


class ClickHouseSink(_SinkBase):
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
    #: Arrow counterpart (see ingest/sinks/ch_arrow.py), else Native; ``native``: always Native.
    insert_format: Literal["auto", "native"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _default_version(cls, data: Any) -> Any:
        """Without ``version_column``: add the hidden ``_version UInt64`` column fed from ``@offset``."""
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
        return _check_identifier(value)

    @model_validator(mode="after")
    def _keys(self) -> ClickHouseSink:
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

    def collapse_rule(self) -> CollapseRule:
        """Rows collapse by the sorting key, the highest version winning (as ReplacingMergeTree keeps it)."""
        names = list(self.columns)
        assert self.version_column is not None
        return CollapseRule(tuple(names.index(k) for k in self.order_by), "last", names.index(self.version_column))

    @property
    def ch_types(self) -> dict[str, ChType]:
        """Parsed ClickHouse types by column, in column order."""
        return {name: ch_type(spec.type) for name, spec in self.columns.items()}


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


def _sink_kind(value: Any) -> str | None:
    """The union tag of a sink: its ``kind``, ``postgres`` when absent (the PostgresSink default)."""
    kind = value.get("kind", "postgres") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in ("postgres", "clickhouse") else None


SinkSettings = Annotated[
    Annotated[PostgresSink, Tag("postgres")] | Annotated[ClickHouseSink, Tag("clickhouse")],
    Discriminator(_sink_kind, custom_error_type="invalid_sink_kind",
                  custom_error_message="sink.kind must be 'postgres' or 'clickhouse'"),
]


class DlqSettings(Frozen):
    """Where poison records go, and when a pipeline should stop instead.

    The guard: the pipeline stops (exit 1) when more than ``max_consecutive``
    records in a row were dead-lettered, or when the dead-lettered share of the
    last ``window`` records exceeds ``max_ratio``. Both on by default with
    generous limits; set to ``null`` to turn one off.
    """

    kind: Literal["postgres", "kafka"] = "postgres"
    table: str = "ingest_dlq"
    #: DSN of the DLQ database; default: the sink's DSN (PostgreSQL sinks).
    dsn: SecretStr | None = None
    db_schema: str = Field(default="public", alias="schema")
    topic: str | None = None
    max_ratio: float | None = Field(default=0.5, gt=0, le=1)
    max_consecutive: int | None = Field(default=1000, ge=1)
    window: int = Field(default=1000, ge=1)
    #: Loop guard of ``replay-dlq``: an entry that failed this many replays is given up.
    max_replays: int = Field(default=3, ge=1)
    #: Kafka DLQ: the largest message the DLQ topic takes (its ``max.message.bytes``; Kafka's
    #: default is 1 MiB), compressed, with the provenance headers.
    max_message_bytes: int = Field(default=1_048_576, ge=1024, le=1_000_000_000)
    #: Kafka DLQ: how the DLQ producer compresses (a record that fitted the source topic gains headers).
    compression: Literal["zstd", "lz4", "gzip", "snappy", "none"] = "zstd"
    #: Kafka DLQ: a record too large for the DLQ topic even compressed. ``stop``: the pipeline stops
    #: without committing it, naming the record, the limit and the fix; ``postgres``: it is stored whole
    #: in the PostgreSQL DLQ table (``dsn``, ``schema``, ``table``) and the topic gets a reference to it.
    oversized: Literal["stop", "postgres"] = "stop"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True)

    @field_validator("table")
    @classmethod
    def _table_name(cls, value: str) -> str:
        return _check_identifier(value)

    @property
    def uses_postgres_table(self) -> bool:
        """A PostgreSQL DLQ table is written: the DLQ itself, or the Kafka DLQ's place for oversized records."""
        return self.kind == "postgres" or self.oversized == "postgres"

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, value: SecretStr | None) -> SecretStr | None:
        return check_dsn_syntax(value)

    @model_validator(mode="after")
    def _topic(self) -> DlqSettings:
        if self.kind == "kafka" and not self.topic:
            raise ValueError("dlq.topic is required when dlq.kind is 'kafka'")
        if self.kind == "postgres" and self.oversized != "stop":
            raise ValueError("dlq.oversized applies to dlq.kind kafka (a PostgreSQL DLQ takes any record)")
        return self


class PipelineSettings(Frozen):
    """One topic set → one table, with its own consumer group."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    topics: list[str] = Field(min_length=1)
    group_id: str | None = None
    format: Literal["json"] = "json"
    #: Ordering / lane key: a JSON path into the value; default: the Kafka message key.
    key: str | None = None
    priority: int = 0
    lanes: int = Field(default=1, ge=1, le=256)
    #: Records without a key: spread over lanes (round_robin) or keep in order on lane 0.
    unkeyed: Literal["round_robin", "lane0"] = "round_robin"
    #: A record with a null value (tombstone): dead-letter it or skip it (counted as done).
    tombstones: Literal["dlq", "skip"] = "dlq"
    batch: BatchSettings = Field(default_factory=BatchSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    sink: SinkSettings
    dlq: DlqSettings = Field(default_factory=DlqSettings)
    commit_interval_ms: int = Field(default=1000, ge=10)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    #: Backpressure bounds: consumption pauses while more than this is in flight.
    max_buffered_records: int = Field(default=100_000, ge=1)
    max_buffered_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    #: Hot-key warning: one key above this share of a lane's records in an interval.
    hot_key_share: float = Field(default=0.5, gt=0, le=1)
    #: Length of the hot-key / hot-lane observation interval.
    hot_key_interval_s: float = Field(default=10.0, gt=0)

    @property
    def effective_group_id(self) -> str:
        return self.group_id or f"ingest-{self.name}"

    @model_validator(mode="after")
    def _dlq_database(self) -> PipelineSettings:
        if self.dlq.uses_postgres_table and self.dlq.dsn is None and not isinstance(self.sink, PostgresSink):
            raise ValueError("dlq.dsn is required: the DLQ writes a PostgreSQL table and the sink is not PostgreSQL")
        return self

    @model_validator(mode="after")
    def _exactly_once(self) -> PipelineSettings:
        if isinstance(self.sink, PostgresSink) and self.sink.delivery == "exactly_once":
            if self.dlq.kind != "postgres":
                raise ValueError("sink.delivery exactly_once needs dlq.kind postgres (DLQ rows join the transaction)")
            if self.dlq.dsn is not None and self.dlq.dsn.get_secret_value() != self.sink.dsn.get_secret_value():
                raise ValueError("sink.delivery exactly_once needs the DLQ in the sink database (omit dlq.dsn)")
        return self

    @field_validator("key")
    @classmethod
    def _key_path(cls, value: str | None) -> str | None:
        if value is not None and not _SOURCE_RE.match(value):
            raise ValueError(f"invalid key path {value!r}")
        return value


class SchedulerSettings(Frozen):
    """The per-database write scheduler (used when a sink sets max_concurrent_writes)."""

    #: A waiting batch gains one priority level per this many milliseconds of waiting.
    aging_ms_per_level: int = Field(default=1000, ge=1)


class Settings(BaseSettings):
    """The whole configuration file."""

    model_config = SettingsConfigDict(
        env_prefix="INGEST_", env_nested_delimiter="__", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    pipelines: list[PipelineSettings] = Field(min_length=1)

    @field_validator("pipelines")
    @classmethod
    def _unique_names(cls, value: list[PipelineSettings]) -> list[PipelineSettings]:
        seen: set[str] = set()
        for pipeline in value:
            if pipeline.name in seen:
                raise ValueError(f"duplicate pipeline name {pipeline.name!r}")
            seen.add(pipeline.name)
        return value

    def pipeline(self, name: str) -> PipelineSettings:
        for pipeline in self.pipelines:
            if pipeline.name == name:
                return pipeline
        raise ConfigError(f"no pipeline named {name!r}; have {[p.name for p in self.pipelines]}")


def _format_error(path: str, exc: ValidationError, data: Any) -> str:
    lines = [f"invalid config {path}:"]
    for err in exc.errors():
        loc_parts: list[str] = []
        node = data
        for part in err["loc"]:
            if isinstance(part, int) and isinstance(node, list) and part < len(node):
                name = node[part].get("name") if isinstance(node[part], dict) else None
                loc_parts.append(f"{part}" + (f"({name})" if name else ""))
                node = node[part]
            else:
                if part in ("PostgresSink", "ClickHouseSink", "postgres", "clickhouse", "function-after"):
                    continue
                loc_parts.append(str(part))
                node = node.get(part) if isinstance(node, dict) else None
        loc = ".".join(loc_parts) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field missing"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Load and validate the config file (``path`` or ``$INGEST_CONFIG``) plus env overrides.

    Raises :class:`ConfigError` naming the file and every bad field.
    """
    path = path or os.environ.get("INGEST_CONFIG")
    if not path:
        raise ConfigError("no config file: pass --config FILE or set INGEST_CONFIG")
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {file} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {file}: top level must be a mapping")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(yaml_file=str(file))

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))

    try:
        loaded = _FileSettings()
    except ValidationError as exc:
        raise ConfigError(_format_error(str(file), exc, data)) from None
    from ingest.redact import register_settings

    register_settings(loaded)  # every secret of it is masked in output and logs from now on
    return loaded

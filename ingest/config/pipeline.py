"""The settings of the broker connection and of one pipeline (topics → sink, DLQ, batching, retries).

A pipeline's ``sink`` section is validated by the settings class of its
``kind``, found in the settings-side registry (:mod:`ingest.config.kinds`, which
:mod:`ingest.sinks.registry` registers kinds in): a new sink kind brings its own
settings class and needs no change here. Formats are checked against the same
registry; nothing here imports a backend, a decoder or the runner.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SecretStr,
    SerializeAsAny,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from ingest.config import kinds
from ingest.core.topics import DEFAULT_EXCLUDE_TOPICS, TopicSelector, is_pattern
from ingest.mirror.errors import TemplateError
from ingest.mirror.template import TableTemplate
from ingest.config.base import (
    SECRET_CLIENT_KEYS,
    SOURCE_RE,
    Frozen,
    PgNetworkSettings,
    SinkSettingsBase,
    check_dsn_syntax,
    check_identifier,
)
from ingest.config.cdc import DeleteSettings
from ingest.config.transforms import TransformStep
from ingest.core.avro_schema import parse_avro_text
from ingest.core.collapse import CollapseRule


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
    #: How long every broker may stay unreachable (down, or silent), or one offset commit or the
    #: group leave may wait for it, before the pipeline stops with exit 1 instead of waiting; 0
    #: waits for ever. librdkafka's ``socket.timeout.ms`` (passthrough,
    #: default 60 s) decides how soon a silent connection is given up and reopened.
    outage_timeout_s: float = Field(default=300.0, ge=0)

    def client_config(self) -> dict[str, Any]:
        """The librdkafka settings, secrets included (only for building clients)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.client}

    def redacted_client(self) -> dict[str, Any]:
        return {
            k: ("**********" if any(s in k for s in SECRET_CLIENT_KEYS) else v) for k, v in self.client.items()
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
    #: PostgreSQL DLQ table: how a silent connection is noticed (see ``sink.network``).
    network: PgNetworkSettings = PgNetworkSettings()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True)

    @field_validator("table")
    @classmethod
    def _table_name(cls, value: str) -> str:
        return check_identifier(value)

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
    #: Topic names, and patterns: an entry beginning with ``^`` is a regular expression (ingest.core.topics).
    topics: list[str] = Field(min_length=1)
    #: Patterns of topics a ``topics`` pattern must not pick up (never a name listed in ``topics``).
    exclude_topics: list[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE_TOPICS))
    #: How often a pipeline with topic patterns lists the broker's topics for new matches.
    topic_refresh_s: float = Field(default=30.0, gt=0)
    group_id: str | None = None
    #: How record values are encoded: a format of the format registry (ingest.formats.registry,
    #: names in ingest.config.kinds):
    #: ``json``, ``avro``, ``json_schema``, ``protobuf`` (the last three in the Confluent wire format,
    #: schemas from the top-level ``schema_registry``).
    format: str = "json"
    #: How record keys are encoded, for ``@key.$.PATH`` sources: ``raw`` (the default: ``@key`` is
    #: the key's bytes, no paths into it) or a format of the format registry (``json``, ``avro``, ...).
    key_format: str = "raw"
    #: ``format: avro`` without a registry: the writer schema of every record (an ``.avsc`` file);
    #: values are then plain Avro binary, with no wire-format header.
    avro_schema: str | None = None
    #: How ``ingest check`` finds a topic's subject in the registry (decoding needs none: the schema
    #: id is in every record): ``topic_name`` (``<topic>-value``), ``record_name`` (``<record_name>``),
    #: ``topic_record_name`` (``<topic>-<record_name>``).
    subject_strategy: Literal["topic_name", "record_name", "topic_record_name"] = "topic_name"
    #: The fully qualified record name the record-name strategies use.
    record_name: str | None = None
    #: Ordering / lane key: a JSON path into the value; default: the Kafka message key.
    key: str | None = None
    priority: int = 0
    lanes: int = Field(default=1, ge=1, le=256)
    #: Map and write whole batches as Arrow columns (ingest.runner.columnar): one decode call, one CSV
    #: COPY and one upsert per batch instead of Python per record. For at-least-once PostgreSQL
    #: pipelines with one lane reading JSON whose columns each read one top-level key or record
    #: metadata into integer, text, numeric or timestamp columns; records it cannot take exactly go
    #: by rows (which alone decide poison). Unset (the default): on wherever the pipeline can have
    #: it; ``true``: the same, and a pipeline that cannot have it logs why; ``false``: always by rows.
    columnar: bool | None = None
    #: Records without a key: spread over lanes (round_robin) or keep in order on lane 0.
    unkeyed: Literal["round_robin", "lane0"] = "round_robin"
    #: Change data capture (ingest.cdc): ``debezium`` reads Debezium change events -- c/r/u upsert
    #: the ``after`` image, d deletes the ``before`` image's key; column paths read the row image.
    envelope: Literal["none", "debezium"] = "none"
    #: A record with a null value (tombstone): ``delete`` the row its key names (columns read from
    #: the record key), dead-letter it, or skip it (counted as done). Default: ``delete`` with an
    #: envelope, else ``dlq``.
    tombstones: Literal["delete", "dlq", "skip"] | None = None
    #: A Debezium truncate event (op ``t``): ``ignore`` it (counted as done) or dead-letter it.
    truncate: Literal["ignore", "dlq"] = "ignore"
    #: How deletes are written (hard / soft, the tombstone table), when the pipeline has deletes.
    deletes: DeleteSettings = Field(default_factory=DeleteSettings)
    #: Steps applied in order to each decoded record (a change event's row image) before mapping
    #: (ingest.config.transforms; compiled by ingest.core.transforms when the config is loaded).
    transforms: list[TransformStep] = Field(default_factory=list)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    #: Validated by the settings class its ``kind`` names in the settings-side registry (ingest.config.kinds).
    sink: SerializeAsAny[SinkSettingsBase]
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

    @field_validator("topics", "exclude_topics")
    @classmethod
    def _patterns(cls, value: list[str], info: Any) -> list[str]:
        """Every pattern compiles (a ``topics`` entry is one when it begins with ``^``)."""
        for i, entry in enumerate(value):
            if info.field_name == "exclude_topics" or is_pattern(entry):
                try:
                    re.compile(entry)
                except re.error as exc:
                    raise ValueError(f"{info.field_name}[{i}] {entry!r} is not a regular expression: {exc}") from None
            elif not entry:
                raise ValueError(f"{info.field_name}[{i}] is empty")
        return value

    @property
    def topic_selector(self) -> TopicSelector:
        """Which topics this pipeline reads (names and patterns, less the exclusions)."""
        return TopicSelector(self.topics, self.exclude_topics)

    @property
    def literal_topics(self) -> list[str]:
        """The ``topics`` entries that name one topic (not patterns)."""
        return [t for t in self.topics if not is_pattern(t)]

    @property
    def effective_tombstones(self) -> str:
        """What a tombstone does: ``tombstones``, else ``delete`` with an envelope and ``dlq`` without."""
        return self.tombstones or ("delete" if self.envelope != "none" else "dlq")

    @property
    def has_deletes(self) -> bool:
        """Records of this pipeline can delete rows (an envelope, or tombstones that delete)."""
        return self.envelope != "none" or self.effective_tombstones == "delete"

    @model_validator(mode="after")
    def _deletes(self) -> PipelineSettings:
        """Deletes need a sink that can delete, a key to delete by, and (tombstones) a key in the record key."""
        sources = {name: self.sink.column_source(name) for name in self.sink.columns}
        if self.envelope == "none" and any(s.startswith("@source.") for s in sources.values()):
            raise ValueError("@source.PATH sources read a change event's source block: set envelope debezium")
        if not self.has_deletes:
            return self
        if not kinds.sink_deletes(self.sink.kind):
            raise ValueError(f"sink kind {self.sink.kind!r} cannot delete rows: set tombstones dlq or skip "
                             "(and envelope none)")
        self.sink.check_deletes(self.deletes)
        rule = self.sink.collapse_rule()
        if rule.key_index is None or rule.keep != "last":
            raise ValueError("deletes need a table that updates rows by key (on_conflict update)")
        if self.envelope == "none":
            names = list(self.sink.columns)
            for i in rule.key_index:
                if not sources[names[i]].startswith("@key"):
                    raise ValueError(f"tombstones delete: key column {names[i]!r} must be read from the record "
                                     "key (source @key or @key.$.PATH): a tombstone has no value")
            if rule.version_index is not None and sources[names[rule.version_index]].startswith("$"):
                raise ValueError("tombstones delete: the version column must come from the record's metadata "
                                 "(e.g. @offset, @timestamp, @header.NAME): a tombstone has no value")
        return self

    def collapse_rule(self) -> CollapseRule:
        """The sink's collapse rule (ingest.core.collapse), merging soft deletes when the pipeline has them.
        A pipeline that routes to many tables keys its rows by table too (the table is the rows' last
        value: :mod:`ingest.mirror.router`)."""
        rule = self.sink.collapse_rule()
        if self.routes_tables and rule.key_index is not None:
            rule = dataclasses.replace(rule, key_index=(*rule.key_index, len(self.sink.columns)))
        if self.has_deletes and (self.deletes.mode == "soft" or any(
                getattr(o, "deletes", None) is not None and o.deletes.mode == "soft"
                for o in getattr(self.sink, "tables", {}).values())):
            return dataclasses.replace(rule, merge_deletes=True)
        return rule

    @property
    def table_template(self) -> TableTemplate:
        """``sink.table`` parsed as a template (:mod:`ingest.mirror.template`; a plain name is a constant)."""
        return TableTemplate.for_topics(self.sink.table, self.topics)

    @property
    def routes_tables(self) -> bool:
        """``sink.table`` is a template with placeholders (each record's table is resolved from it), or
        the columns are ``auto`` (each table is made from its records' schemas; a plain name is a
        template without placeholders)."""
        return self.auto_columns or ("{" in self.sink.table and not self.table_template.is_constant)

    @property
    def auto_columns(self) -> bool:
        """``sink.columns: auto`` (ingest.mirror.auto)."""
        return bool(getattr(self.sink, "auto_columns", False))

    @model_validator(mode="after")
    def _routing(self) -> PipelineSettings:
        """A ``sink.table`` template must parse, read only what the records have, and go with what
        routing supports (see README "Mirroring a database")."""
        if self.auto_columns:
            self._check_auto_columns()
        if "{" not in self.sink.table and "}" not in self.sink.table:
            return self
        try:
            template = self.table_template
        except TemplateError as exc:
            raise ValueError(f"sink.table: {exc}") from None
        if template.is_constant:
            raise ValueError("sink.table: '{{' and '}}' stand for braces in a template only; a table name "
                             "without placeholders is written as it is (without doubled braces)")
        if template.uses_source and self.envelope == "none":
            raise ValueError("sink.table: {source.FIELD} reads a change event's source block: set envelope debezium")
        if self.sink.kind not in ("postgres", "clickhouse"):
            raise ValueError(f"sink.table: sink kind {self.sink.kind!r} writes one table (no template)")
        if self.explode_steps:
            raise ValueError("sink.table: a table template does not combine with explode steps yet")
        if getattr(self.sink, "write_method", "copy") != "copy":
            raise ValueError("sink.table: a table template needs sink.write_method copy")
        if self.has_deletes and self.deletes.tombstone_table is not None:
            raise ValueError("deletes.tombstone_table: with a table template each table gets its own "
                             "(<table>_ingest_deleted); remove the setting")
        return self

    def _check_auto_columns(self) -> None:
        """``columns: auto`` reads schemas it can have (see README "Mirroring a database")."""
        if self.format not in ("json", "avro", "json_schema", "protobuf") or self.avro_schema is not None:
            raise ValueError("sink.columns: auto reads Kafka Connect JSON with schemas (format json) or the schema "
                             f"registry's schemas (avro, json_schema, protobuf), not format {self.format!r}"
                             + (" with avro_schema" if self.avro_schema is not None else ""))
        if self.format == "avro" and self.envelope == "debezium" and self.key_format != "avro":
            raise ValueError("key_format: a Debezium stream in Avro keys its records by an Avro primary key: "
                             "set key_format avro (sink.columns: auto takes each table's key from it)")
        if self.transforms:
            raise ValueError("transforms: not supported with sink.columns: auto yet")
        if self.key is not None:
            raise ValueError("key: sink.columns: auto orders each table's records by their record key; "
                             "remove the setting")
        for pattern, override in getattr(self.sink, "tables", {}).items():
            if getattr(override, "deletes", None) is not None and not self.has_deletes:
                raise ValueError(f"sink.tables.{pattern}.deletes: this pipeline's records never delete (set "
                                 "envelope debezium or tombstones delete)")

    @model_validator(mode="after")
    def _transform_labels(self) -> PipelineSettings:
        """Step labels name metric series and DLQ messages: one per step."""
        labels = [step.label(i) for i, step in enumerate(self.transforms)]
        if len(set(labels)) != len(labels):
            raise ValueError("transforms: two steps have one name")
        return self

    @property
    def explode_steps(self) -> list[tuple[int, Any]]:
        """``(index in transforms, ExplodeSettings)`` of every ``explode`` step, in order."""
        return [(i, step.explode) for i, step in enumerate(self.transforms) if step.explode is not None]

    def explode_sink(self, explode: Any) -> Any:
        """The sink settings of an explode step's child table (:meth:`SinkSettingsBase.child_table`)."""
        return self.sink.child_table(explode.table, dict(explode.columns), list(explode.conflict_key))

    def explode_columns(self, explode: Any) -> dict[str, Any]:
        """The columns of an explode step's child table, in row order: its own, then the hidden ones
        the sink kind adds (where each row was last written from, or its version)."""
        return dict(self.explode_sink(explode).columns)

    @model_validator(mode="after")
    def _explode(self) -> PipelineSettings:
        """Exploded child rows are written with their parent and replace the parent's children: that
        needs a sink kind that writes child tables (PostgreSQL, ClickHouse) and a parent table updated
        by key, without deletes or a version column (whose guard could skip a parent whose children
        would still be replaced); the child tables' columns must be valid for the sink."""
        steps = self.explode_steps
        if not steps:
            return self
        refusal = self.sink.explode_refusal()
        if refusal is not None:
            raise ValueError(f"transforms: {refusal}")
        if self.has_deletes:
            raise ValueError("transforms: explode does not combine with deletes (envelope, tombstones delete) yet")
        tables = [e.table for _, e in steps]
        for i, e in steps:
            if e.table == self.sink.table:
                raise ValueError(f"transforms[{i}].explode.table: {e.table!r} is the sink's own table")
            if tables.count(e.table) > 1:
                raise ValueError(f"transforms[{i}].explode.table: two explode steps write {e.table!r}")
            try:
                self.explode_sink(e)
                self.sink.check_explode(e)
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                                     for err in exc.errors())
                raise ValueError(f"transforms[{i}].explode: {problems}") from None
            except ValueError as exc:
                raise ValueError(f"transforms[{i}].explode: {exc}") from None
        return self

    @property
    def effective_group_id(self) -> str:
        return self.group_id or f"ingest-{self.name}"

    @field_validator("key_format")
    @classmethod
    def _key_format(cls, value: str) -> str:
        names = kinds.format_names()
        if value != "raw" and value not in names:
            raise ValueError(f"key_format must be 'raw' or one of {', '.join(repr(n) for n in names)}")
        return value

    @model_validator(mode="after")
    def _key_paths(self) -> PipelineSettings:
        """``@key.$.PATH`` sources need a key format to decode the key with."""
        sources = [spec.source or "" for spec in self.sink.columns.values()] + [self.key or ""]
        if self.key_format == "raw" and any(s.startswith("@key.$") for s in sources):
            raise ValueError("@key.$ sources read into a decoded key: set key_format (json, avro, ...)")
        return self

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        names = kinds.format_names()
        if value not in names:
            raise ValueError(f"format must be one of {', '.join(repr(n) for n in names)}")
        return value

    @model_validator(mode="after")
    def _subject_name(self) -> PipelineSettings:
        if self.subject_strategy != "topic_name" and not self.record_name:
            raise ValueError(f"subject_strategy {self.subject_strategy} needs record_name")
        if self.avro_schema is not None and self.format != "avro":
            raise ValueError("avro_schema is only for format avro")
        return self

    def value_subjects(self) -> list[str]:
        """The registry subjects of this pipeline's record values, one per topic named in ``topics`` (by
        ``subject_strategy``; the topics a pattern finds are not known before the broker lists them)."""
        if self.subject_strategy == "record_name":
            return [str(self.record_name)]
        if self.subject_strategy == "topic_record_name":
            return [f"{topic}-{self.record_name}" for topic in self.literal_topics]
        return [f"{topic}-value" for topic in self.literal_topics]

    @field_validator("avro_schema")
    @classmethod
    def _avro_schema_file(cls, value: str | None) -> str | None:
        """A readable file holding a valid Avro schema (a bad one is a config error, not a crash)."""
        if value is None:
            return value
        from pathlib import Path

        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read {value}: {exc.strerror}") from None
        parse_avro_text(text)  # ValueError naming what is wrong
        return value

    @field_validator("sink", mode="before")
    @classmethod
    def _sink(cls, value: Any) -> Any:
        """Dispatch on ``kind`` (default ``postgres``) to the settings class the settings-side registry names."""
        if isinstance(value, SinkSettingsBase):
            return value
        if not isinstance(value, dict):
            raise ValueError("sink must be a mapping")
        kind = value.get("kind", "postgres")
        try:
            settings_class = kinds.sink_settings_class(kind)
        except KeyError:
            raise ValueError(f"sink.kind must be one of {', '.join(repr(k) for k in kinds.sink_kinds())}") from None
        return settings_class.model_validate(value)

    @property
    def dlq_dsn(self) -> SecretStr | None:
        """The DSN of the PostgreSQL DLQ table (``dlq.dsn``, else the sink's own PostgreSQL database)."""
        return self.dlq.dsn or self.sink.postgres_dsn

    @model_validator(mode="after")
    def _dlq_database(self) -> PipelineSettings:
        if self.dlq.uses_postgres_table and self.dlq_dsn is None:
            raise ValueError("dlq.dsn is required: the DLQ writes a PostgreSQL table and the sink is not PostgreSQL")
        return self

    @model_validator(mode="after")
    def _exactly_once(self) -> PipelineSettings:
        if self.sink.exactly_once:
            if self.dlq.kind != "postgres":
                raise ValueError("sink.delivery exactly_once needs dlq.kind postgres (DLQ rows join the transaction)")
            own = self.sink.postgres_dsn
            if self.dlq.dsn is not None and (own is None or self.dlq.dsn.get_secret_value() != own.get_secret_value()):
                raise ValueError("sink.delivery exactly_once needs the DLQ in the sink database (omit dlq.dsn)")
        return self

    @field_validator("key")
    @classmethod
    def _key_path(cls, value: str | None) -> str | None:
        if value is not None and not SOURCE_RE.match(value):
            raise ValueError(f"invalid key path {value!r}")
        return value


class SchedulerSettings(Frozen):
    """The per-database write scheduler (used when a sink sets max_concurrent_writes)."""

    #: A waiting batch gains one priority level per this many milliseconds of waiting.
    aging_ms_per_level: int = Field(default=1000, ge=1)



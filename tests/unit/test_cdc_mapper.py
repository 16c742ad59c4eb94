"""ChangeMapper (ingest/cdc/mapper.py) and the settings of pipelines with deletes: pure logic."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from ingest.cdc.mapper import ChangeMapper, mapper_for
from ingest.config import PipelineSettings
from ingest.core.mapping import Mapper
from ingest.errors import InvalidRecord, NoChange
from ingest.types import DeleteRow, Record

PG_COLUMNS = {"id": {"type": "bigint"}, "name": {"type": "text"}, "lsn": {"type": "bigint", "source": "@source.lsn"}}
PLAIN = {"table": "items", "conflict_key": ["id"], "columns": {"id": {"type": "bigint"}, "name": {"type": "text"}}}


def _settings(**pipeline: Any) -> PipelineSettings:
    sink = pipeline.pop("sink", {"table": "items", "conflict_key": ["id"], "version_column": "lsn",
                                 "columns": PG_COLUMNS})
    return PipelineSettings.model_validate({"name": "p", "topics": ["t"], "sink": sink, **pipeline})


def _event(op: str, before: Any, after: Any, lsn: int = 7) -> bytes:
    return orjson.dumps({"before": before, "after": after, "op": op, "ts_ms": 1, "source": {"lsn": lsn, "ts_ms": 2}})


def _record(value: bytes | None, key: bytes | None = b'{"id": 1}', offset: int = 3) -> Record:
    return Record("t", 0, offset, key, value, None)


def test_upserts_map_the_after_image_and_read_the_source_block() -> None:
    m = mapper_for(_settings(envelope="debezium"))
    assert isinstance(m, ChangeMapper)
    row, _ = m.map(_record(_event("u", {"id": 1, "name": "old"}, {"id": 1, "name": "new"}, lsn=42)))
    assert type(row) is tuple and row[:3] == (1, "new", 42)


def test_a_delete_carries_the_key_version_and_source_columns_only() -> None:
    m = mapper_for(_settings(envelope="debezium"))
    row, _ = m.map(_record(_event("d", {"id": 5, "name": "gone"}, None, lsn=43), offset=9))
    assert type(row) is DeleteRow
    names = m.column_names
    values = dict(zip(names, row))
    assert values["id"] == 5 and values["lsn"] == 43 and values["name"] is None
    assert values["_ingest_offset"] == 9 and values["_ingest_stream"] is not None


def test_a_delete_without_a_before_image_reads_the_record_key() -> None:
    m = mapper_for(_settings(envelope="debezium"))
    key = orjson.dumps({"schema": {"type": "struct", "fields": [{"field": "id", "type": "int64"}]},
                        "payload": {"id": 11}})
    row, _ = m.map(_record(_event("d", None, None), key=key))
    assert type(row) is DeleteRow and row[0] == 11


def test_a_debezium_tombstone_is_a_no_change_when_the_version_comes_from_the_event() -> None:
    m = mapper_for(_settings(envelope="debezium"))
    with pytest.raises(NoChange):
        m.map(_record(None))


def test_a_debezium_tombstone_deletes_when_the_version_is_metadata() -> None:
    cols = {"id": {"type": "bigint"}, "name": {"type": "text"}, "off": {"type": "bigint", "source": "@offset"}}
    m = mapper_for(_settings(envelope="debezium", sink={"table": "x", "conflict_key": ["id"],
                                                        "version_column": "off", "columns": cols}))
    row, _ = m.map(_record(None, key=b'{"id": 4}', offset=12))
    assert type(row) is DeleteRow and row[0] == 4 and row[2] == 12


def test_plain_tombstones_delete_by_the_record_key() -> None:
    cols = {"k": {"type": "bigint", "source": "@key"}, "v": {"type": "text"}}
    settings = _settings(tombstones="delete", sink={"table": "kv", "conflict_key": ["k"], "columns": cols})
    m = mapper_for(settings)
    row, _ = m.map(_record(None, key=b"17"))
    assert type(row) is DeleteRow and row[:2] == (17, None)
    upsert, _ = m.map(_record(b'{"v": "x"}', key=b"17"))
    assert type(upsert) is tuple and upsert[:2] == (17, "x")


def test_truncates_are_ignored_or_poison() -> None:
    with pytest.raises(NoChange):
        mapper_for(_settings(envelope="debezium")).map(_record(_event("t", None, None)))
    with pytest.raises(InvalidRecord) as err:
        mapper_for(_settings(envelope="debezium", truncate="dlq")).map(_record(_event("t", None, None)))
    assert (err.value.stage, err.value.error_class) == ("map", "truncate")


def test_a_delete_without_its_key_is_poison_naming_the_column() -> None:
    m = mapper_for(_settings(envelope="debezium"))
    with pytest.raises(InvalidRecord) as err:
        m.map(_record(_event("d", {"name": "no id"}, None)))
    assert err.value.error_class == "missing_field" and "'id'" in err.value.message


def test_tombstones_dlq_and_skip_keep_their_meaning() -> None:
    with pytest.raises(InvalidRecord) as err:
        mapper_for(_settings(envelope="debezium", tombstones="dlq")).map(_record(None))
    assert err.value.error_class == "tombstone"
    assert isinstance(mapper_for(_settings(sink=PLAIN)), Mapper)  # no deletes: the plain mapper


@pytest.mark.parametrize(("pipeline", "needle"), [
    ({"tombstones": "delete", "sink": PLAIN}, "must be read from the record key"),
    ({"sink": {"table": "x", "on_conflict": "none", "columns": PG_COLUMNS}, "envelope": "debezium"},
     "updates rows by key"),
    ({"envelope": "debezium", "sink": {"table": "x", "conflict_key": ["id"], "write_method": "values",
                                       "columns": PG_COLUMNS}}, "write_method copy"),
    ({}, "set envelope debezium"),
    ({"envelope": "debezium", "deletes": {"mode": "soft", "soft_column": "name"}}, "managed by ingest"),
    ({"envelope": "debezium", "deletes": {"mode": "soft"},
      "sink": {"kind": "clickhouse", "table": "x", "order_by": ["id"], "columns": {"id": {"type": "Int64"}}},
      "dlq": {"dsn": "postgresql://localhost/x"}},
     "ClickHouse deletes are hard"),
])
def test_settings_that_cannot_delete_are_refused_naming_why(pipeline: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        _settings(**pipeline)
    assert needle in str(err.value)


def test_clickhouse_delete_rows_fill_non_nullable_columns_with_zeros() -> None:
    sink = {"kind": "clickhouse", "table": "x", "order_by": ["id"], "version_column": "v",
            "columns": {"id": {"type": "Int64"}, "s": {"type": "String"}, "n": {"type": "Nullable(Int32)"},
                        "v": {"type": "UInt64", "source": "@source.lsn"}}}
    m = mapper_for(_settings(envelope="debezium", sink=sink, dlq={"dsn": "postgresql://localhost/x"}))
    row, _ = m.map(_record(_event("d", {"id": 3}, None, lsn=8)))
    assert type(row) is DeleteRow and tuple(row) == (3, "", None, 8)


class _VersionClient:
    """Answers ``SELECT version()`` like a server of ``version`` (pure logic of the version check)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def command(self, sql: str) -> str:
        assert sql == "SELECT version()"
        return self.version


@pytest.mark.parametrize(("version", "refused"), [("22.8.21.38", True), ("23.1.9", True), ("23.2.1", False),
                                                  ("26.9.2.1", False)])
def test_clickhouse_deletes_need_a_server_with_is_deleted(version: str, refused: bool) -> None:
    from ingest.errors import ConfigError
    from ingest.sinks.clickhouse.schema import _check_deletes_supported

    settings = _settings(envelope="debezium", dlq={"dsn": "postgresql://localhost/x"},
                         sink={"kind": "clickhouse", "table": "x", "order_by": ["id"], "columns": {"id": {"type": "Int64"}}})
    if refused:
        with pytest.raises(ConfigError, match=f"deletes need ClickHouse 23.2 or later .* the server is {version}"):
            _check_deletes_supported(_VersionClient(version), settings)
    else:
        _check_deletes_supported(_VersionClient(version), settings)


def test_clickhouse_tables_with_deletes_have_the_is_deleted_column() -> None:
    from ingest.sinks.clickhouse.schema import create_table_sql

    settings = _settings(envelope="debezium", dlq={"dsn": "postgresql://localhost/x"},
                         sink={"kind": "clickhouse", "table": "x", "order_by": ["id"], "columns": {"id": {"type": "Int64"}}})
    ddl = create_table_sql(settings.sink, deletes=True)[1]
    assert "`_ingest_deleted` UInt8" in ddl and "ReplacingMergeTree(`_version`, `_ingest_deleted`)" in ddl
    assert "_ingest_deleted" not in create_table_sql(settings.sink)[1]


# -- the schema part of JSON events, parsed once (ingest.cdc.debezium.SchemaParts) -----------------

def _schema_events() -> list[bytes]:
    from datetime import datetime, timezone
    from decimal import Decimal

    from harness.debezium import Field, encode_event

    fields = (Field("id", "int64"), Field("payload", "string"), Field("price", "decimal(12,2)"),
              Field("at", "micro_timestamp"))
    rows = [{"id": i, "payload": f',"payload":{{"x":{i}}}', "price": Decimal(f"-{i}.05"),
             "at": datetime(2026, 1, 1, 0, 0, i, 7, tzinfo=timezone.utc)} for i in range(1, 4)]
    return [encode_event("c", None, rows[0], fields=fields, lsn=1, ts_ms=1, schemas=True),
            encode_event("u", rows[0], rows[1], fields=fields, lsn=2, ts_ms=2, schemas=True),
            encode_event("d", rows[1], None, fields=fields, lsn=3, ts_ms=3, schemas=True),
            encode_event("c", None, rows[2], fields=fields, lsn=4, ts_ms=4, schemas=True)]


def test_known_schema_parts_give_the_same_change_as_decoding_the_whole_event() -> None:
    from ingest.cdc.debezium import SchemaParts, unwrap

    parts = SchemaParts(orjson.loads)
    first, *rest = _schema_events()
    assert parts.change(first) is None  # not seen yet
    parts.remember(first, orjson.loads(first))
    for value in [first, *rest]:
        fast = parts.change(value)
        assert fast is not None and fast == unwrap(orjson.loads(value))


def test_events_that_only_look_like_a_known_schema_part_are_decoded_whole() -> None:
    from ingest.cdc.debezium import SchemaParts

    parts = SchemaParts(orjson.loads)
    first = _schema_events()[0]
    parts.remember(first, orjson.loads(first))
    head, _, payload = first.partition(b',"payload":{"before"')
    assert parts.change(first[:-1] + b', "extra": 1}') is None          # another key after the payload
    assert parts.change(first + b" ") is None                          # not the compact shape
    assert parts.change(head.replace(b'"int64"', b'"int32"', 1) + b',"payload":{"before"' + payload) is None
    assert parts.change(first.replace(b'"op":"c"', b'"op":"c"}', 1)) is None  # payload no longer parses
    # a schema part that is not the event's whole schema (the payload key inside it) is never cached
    tricky = b'{"schema":{"type":"struct","fields":[],"x":{"a":1,"payload":2}},"payload":{"op":"c","after":{}}}'
    parts.remember(tricky, orjson.loads(tricky))
    assert parts.change(tricky) is None


def test_the_change_mapper_maps_schema_events_alike_on_both_paths() -> None:
    cols = {"id": {"type": "bigint"}, "payload": {"type": "text"}, "price": {"type": "numeric(12,2)"},
            "at": {"type": "timestamptz"}, "lsn": {"type": "bigint", "source": "@source.lsn"}}
    settings = _settings(envelope="debezium", sink={"table": "x", "conflict_key": ["id"], "version_column": "lsn",
                                                    "columns": cols})
    events = _schema_events()
    cached, fresh = mapper_for(settings), mapper_for(settings)
    for value in events:
        cached.map(_record(value))  # the first one teaches it the schema part
    for value in events:
        a, b = mapper_for(settings).map(_record(value)), cached.map(_record(value))
        assert a == b and type(a[0]) is type(b[0])
    assert fresh.map(_record(events[2]))[0][0] == 2  # the delete of row 2


def test_tombstones_are_skipped_unmapped_only_when_every_one_is_a_no_change() -> None:
    assert mapper_for(_settings(envelope="debezium")).skips_tombstones  # the version comes from the event
    assert not mapper_for(_settings(envelope="debezium", tombstones="dlq")).skips_tombstones
    cols = {"k": {"type": "bigint", "source": "@key"}, "v": {"type": "text"}}
    assert not mapper_for(_settings(tombstones="delete", sink={"table": "kv", "conflict_key": ["k"],
                                                               "columns": cols})).skips_tombstones

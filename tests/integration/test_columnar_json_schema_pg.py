"""JSON Schema values (``format: json_schema``) on the columnar tier against the row path, end to end: the
real broker, the registry stand-in over HTTP, real PostgreSQL (and chDB for ClickHouse).

The same topic -- :func:`columnar_stream`'s updates of 700 keys and its poison (a wrong-typed value,
invalid JSON after the prefix, a value out of range, ISO timestamps only the row mapper takes), each
value behind the wire-format prefix of one of two JSON Schema versions (a tenth of them made by
confluent-kafka's own ``JSONSerializer``), plus records the decoder refuses before any JSON is read:
no magic byte (plain JSON), a value too short for its id, an unknown schema id, an Avro schema's id,
and a missing required field -- run by ``ingest run`` with the tier on (the default) and off
(``columnar: false``): identical tables, identical DLQ entries (partition, offset, stage, error
class, message), offsets committed at the log end by both (exactly once: the same stored watermarks
and lane offsets), and the tier stated (``write_tier: columnar``) and taking most records
(``columnar_records``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import psycopg
import pytest
from formats_helpers import format_config, migrate
from harness import run_ingest
from harness.kafka import log_end_offsets, produce
from harness.serde import json_schema_values
from pipeline_helpers import columnar_stream, run_pipeline_on_off
from test_columnar_exactly_once import _stored_offsets

V1 = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Event", "type": "object",
      "properties": {"id": {"type": "integer"}, "n": {"type": "integer"}, "kind": {"type": "string"},
                     "amount": {"type": "number"}, "ts": {"type": "integer"},
                     "by": {"type": "object", "properties": {"name": {"type": "string"}}}},
      "required": ["id"]}
#: a second version: ``flag`` added
V2 = {**V1, "properties": {**V1["properties"], "flag": {"type": "boolean"}}}
AVRO = {"type": "record", "name": "Event", "fields": [{"name": "id", "type": "long"}]}

PG_COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "n": {"type": "integer"},
    "kind": {"type": "text"},
    "amount": {"type": "numeric(14,4)"},
    "ts": {"type": "timestamptz"},
    "who": {"type": "text", "source": "$.by.name"},
    "flag": {"type": "boolean"},
}
CH_COLUMNS = {
    "id": {"type": "Int64"},
    "n": {"type": "Int32"},
    "kind": {"type": "String"},
    "ts": {"type": "DateTime64(3)"},
    "amount": {"type": "Decimal(14, 4)"},
}
#: the error classes the stream's poison must produce, by rows and on the tier alike
CLASSES = {"bad_magic_byte", "unknown_schema", "schema_mismatch", "invalid_json", "invalid_value", "out_of_range",
           "missing_field"}


def _doc(i: int) -> dict[str, Any]:
    return {"id": i % 700, "n": i, "kind": f"k{i % 7}", "amount": round(i / 7, 3), "ts": 1_764_460_800_000 + i,
            **({"by": {"name": f"who {i % 11}"}} if i % 3 else {}), **({"flag": i % 4 == 1} if i % 2 else {})}


def _prefix(schema_id: int) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big")


def _stream(registry: Any, topic: str) -> list[tuple[bytes, bytes]]:
    """The topic's records (see the module docstring): JSON Schema values, hostile ones mixed in."""
    ids = {"avro": registry.register("other-value", json.dumps(AVRO))}
    serialized = {i: v for i, v in zip(range(0, 3000, 10), json_schema_values(
        registry.url, topic, json.dumps(V2), [_doc(i) for i in range(0, 3000, 10)]), strict=True)}
    ids["v2"] = int.from_bytes(serialized[0][1:5], "big")  # the serializer registered it
    ids["v1"] = registry.register(f"{topic}-value", json.dumps(V1), "JSON")
    out = []
    for i, (key, value) in enumerate(columnar_stream(_doc)):
        if i % 211 == 19:
            pass  # plain JSON on a registry topic: bad_magic_byte
        elif i % 223 == 21:
            value = b"\x00\x00\x01"  # too short for its id: bad_magic_byte
        elif i % 227 == 23:
            value = _prefix(9999) + value  # unknown_schema
        elif i % 229 == 25:
            value = _prefix(ids["avro"]) + value  # an Avro schema's id: schema_mismatch
        elif i % 233 == 27:
            value = _prefix(ids["v1"]) + orjson.dumps({k: v for k, v in _doc(i).items() if k != "id"})  # missing
        elif i in serialized and value == orjson.dumps(_doc(i)):
            value = serialized[i]  # confluent-kafka's own bytes (json.dumps spacing)
        else:
            value = _prefix(ids["v1" if i % 4 else "v2"]) + value
        out.append((key, value))
    return out


def _pg_rows(dsn: str, table: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT {", ".join(PG_COLUMNS)} FROM "{table}" ORDER BY id').fetchall()


def _on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, registry_url, sink_of, **pipeline):
    """Both runs of the differential: ``{name: (summary stats, DLQ rows)}`` for ``js_rows`` (by rows)
    and ``js_cols`` (the tier: the default)."""
    out = {}
    for name, columnar in (("js_rows", False), ("js_cols", None)):
        out[name] = run_pipeline_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, {
            "name": name, "format": "json_schema", "sink": sink_of(name),
            "dlq": {"kind": "postgres", "dsn": pg_dsn, "table": f"{name}_dlq"}, **pipeline,
        }, columnar, top={"schema_registry": {"url": registry_url}})
    return out


def _same_dlq_and_tiers(out: dict, produced: int) -> None:
    (rows_stats, rows_dlq), (col_stats, col_dlq) = out["js_rows"], out["js_cols"]
    assert col_dlq == rows_dlq
    assert {r[3] for r in rows_dlq} == CLASSES
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq) > 60
    assert rows_stats["write_tier"] == "rows (columnar: false)" and rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar"
    # poison and all written columnar (into ClickHouse, batches holding an ISO timestamp go by rows)
    assert produced // 2 <= col_stats["columnar_records"] <= col_stats["records_consumed"] == produced, col_stats


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_json_schema_run_on_the_columnar_tier_writes_and_dead_letters_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry, lanes):
    """With two lanes too: the accept loop routes each record by the plan's lane keys, read from the
    JSON after the prefix (the row path's)."""
    topic = new_topic(3)
    records = _stream(schema_registry, topic)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    out = _on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, lambda name: {
        "kind": "postgres", "dsn": pg_dsn, "table": name, "conflict_key": ["id"], "columns": PG_COLUMNS},
        lanes=lanes)
    rows, cols = _pg_rows(pg_dsn, "js_rows"), _pg_rows(pg_dsn, "js_cols")
    assert len(rows) == 700 and cols == rows
    assert {r[5] for r in rows} >= {None, "who 1"} and {r[6] for r in rows} >= {None, True, False}
    _same_dlq_and_tiers(out, len(records))


def test_an_exactly_once_json_schema_run_on_the_tier_matches_the_row_path(kafka_bootstrap, pg_dsn, new_topic,
                                                                          tmp_path, schema_registry):
    """Exactly once (one lane, keyed): the same rows, DLQ and stored offsets (watermarks, lane offsets)."""
    topic = new_topic(3)
    records = _stream(schema_registry, topic)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    out = _on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, lambda name: {
        "kind": "postgres", "dsn": pg_dsn, "table": name, "conflict_key": ["id"], "delivery": "exactly_once",
        "columns": PG_COLUMNS})
    rows, cols = _pg_rows(pg_dsn, "js_rows"), _pg_rows(pg_dsn, "js_cols")
    assert len(rows) == 700 and cols == rows
    _same_dlq_and_tiers(out, len(records))
    ends = {p: e for p, e in log_end_offsets(kafka_bootstrap, topic).items() if e > 0}
    rows_offsets, col_offsets = _stored_offsets(pg_dsn, "js_rows"), _stored_offsets(pg_dsn, "js_cols")
    assert rows_offsets[0] == col_offsets[0] == ends
    assert col_offsets[1] == rows_offsets[1] and len(rows_offsets[1]) == 3


def test_a_json_schema_run_into_clickhouse_on_the_tier_matches_the_row_path(kafka_bootstrap, pg_dsn, new_topic,
                                                                            tmp_path, schema_registry, chdb):
    topic = new_topic(3)
    records = _stream(schema_registry, topic)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    # each run owns the chDB path while it runs; this process opens it only afterwards
    out = _on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, lambda name: {
        "kind": "clickhouse", "url": chdb.url, "database": "js", "table": name, "order_by": ["id"],
        "columns": CH_COLUMNS})
    try:
        client = chdb.client()
        rows, cols = ([tuple(r) for r in client.query(
            f"SELECT {', '.join(CH_COLUMNS)} FROM js.{name} FINAL ORDER BY id").result_rows]
            for name in ("js_rows", "js_cols"))
    finally:
        chdb.close()
    assert len(rows) == 700 and cols == rows
    _same_dlq_and_tiers(out, len(records))


def test_check_states_the_columnar_tier_of_a_json_schema_pipeline(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                  tmp_path, schema_registry):
    topic = new_topic(1)
    schema_registry.register(f"{topic}-value", json.dumps(V2), "JSON")
    cfg = format_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, fmt="json_schema",
                        registry=schema_registry.url, name="js", sink={
                            "kind": "postgres", "dsn": pg_dsn, "table": "js", "conflict_key": ["id"],
                            "columns": PG_COLUMNS})
    res = run_ingest(["check", "-c", migrate(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok   pipeline js: write tier: columnar\n" in res.stdout

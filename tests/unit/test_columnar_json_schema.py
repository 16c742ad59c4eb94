"""JSON Schema values (``format: json_schema``) on the columnar tier, against the row path, which decides.

The plan reads the JSON after each value's wire-format prefix as it reads plain JSON values; a record
whose prefix or schema the pipeline's decoder would refuse (no magic byte, too short, an unknown id,
the id of an Avro schema) is left to the row mapper. So for every batch of hostile values -- those, a
GUID prefix, a schema id in a header, invalid JSON after a good prefix, wrong-typed values, a missing
required field, two schema versions -- every record the plan takes must be one the row mapper maps, the
rows it keeps are the rows the row path writes after the collapse, each record it routes to a lane goes
where the row path routes it, and the tier hands poison back with the row mapper's own failure.

The JSON texts are ``tests/unit/test_columnar.py``'s (its columns and hostile documents); the registry
is the stand-in of ``tests/harness/schema_registry.py`` over real HTTP.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_columnar import COLUMNS, _as_database_would
from test_columnar import values as json_texts
from test_columnar_avro import _row_path

from harness.schema_registry import SchemaRegistryStandIn
from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.config.formats import SchemaRegistrySettings
from ingest.core.mapping import Mapper
from ingest.core.mapping.columnar import UNROUTED
from ingest.core.routing import key_bytes
from ingest.formats.json_schema import JsonSchemaDecoder
from ingest.formats.wire import VALUE_SCHEMA_ID_HEADER
from ingest.runner.columnar import ColumnarTier, write_tier
from ingest.types import Item, Record

TOPIC = "events"
V1 = {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"type": "string"}}, "required": ["id"]}
V2 = {**V1, "properties": {**V1["properties"], "amount": {"type": "number"}}}
AVRO = {"type": "record", "name": "E", "fields": [{"name": "id", "type": "long"}]}


@pytest.fixture(scope="module")
def registry():
    stand_in = SchemaRegistryStandIn()
    try:
        ids = {"v1": stand_in.register(f"{TOPIC}-value", json.dumps(V1), "JSON"),
               "v2": stand_in.register(f"{TOPIC}-value", json.dumps(V2), "JSON"),
               "avro": stand_in.register("other-value", json.dumps(AVRO))}
        yield stand_in, ids
    finally:
        stand_in.stop()


def _pipeline(url: str, **overrides) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": [TOPIC], "format": "json_schema",
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["event_id"],
                 "columns": COLUMNS}, **overrides})


def _fresh(url: str) -> tuple:
    """A json_schema pipeline's decoder (its own schema store), row mapper, collapse rule and plan."""
    p = _pipeline(url)
    decoder = JsonSchemaDecoder(p, SchemaRegistrySettings(url=url))
    mapper = Mapper(p.sink.columns, decoder=decoder)
    rule = p.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None, mapper.columnar_refusal(rule.key_index)
    return decoder, mapper, rule, plan


@pytest.fixture(scope="module")
def parts(registry):
    stand_in, ids = registry
    decoder, mapper, rule, plan = _fresh(stand_in.url)
    with urllib.request.urlopen(f"{stand_in.url}/schemas/ids/{ids['v1']}") as answer:  # noqa: S310 - the stand-in
        guid = json.load(answer)["guid"]
    return ids, guid, decoder, mapper, rule, plan


def _prefix(schema_id: int) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big")


@st.composite
def wire_values(draw: st.DrawFn, ids: dict[str, int], guid: str) -> tuple[bytes, tuple]:
    """A value and its headers: mostly JSON behind a good prefix, else what the decoder refuses."""
    text = draw(json_texts())
    kinds = ["v1"] * 6 + ["v2"] * 3 + ["unknown", "avro", "plain", "short", "header", "missing", "broken"]
    kind = draw(st.sampled_from(kinds + ["guid"]))
    if kind in ("v1", "v2"):
        return _prefix(ids[kind]) + text, ()
    if kind == "unknown":
        return _prefix(9999) + text, ()  # unknown_schema
    if kind == "avro":
        return _prefix(ids["avro"]) + text, ()  # an Avro schema's id: schema_mismatch
    if kind == "plain":
        return text, ()  # no prefix: bad_magic_byte (or "{" read as one: bad_magic_byte too)
    if kind == "short":
        return draw(st.sampled_from([b"", b"\x00", b"\x00\x00\x00\x01", b"\x01\x02"])), ()
    if kind == "header":  # the id in a header, the whole value JSON (a known id, or an unknown one)
        return text, ((VALUE_SCHEMA_ID_HEADER, _prefix(draw(st.sampled_from([ids["v1"], 9999])))),)
    if kind == "missing":
        return _prefix(ids["v1"]) + b'{"kind": "no id"}', ()  # map/missing_field
    if kind == "broken":
        return _prefix(ids["v2"]) + draw(st.sampled_from([b"{", b'{"id": 1,', b"\xff", b""])), ()  # invalid JSON
    return b"\x01" + uuid.UUID(guid).bytes + text, ()


def _records(values: list[tuple[bytes, tuple]]) -> list[Record]:
    return [Record(TOPIC, i % 3, i, b"k", v, 1_700_000_000_000 + i, headers)
            for i, (v, headers) in enumerate(values)]


def _tier(plan, mapper: Mapper) -> ColumnarTier:
    return ColumnarTier("p", plan, lambda table: table, lambda payload, token=None: None, mapper.map)


#: how many batches the differential compared whole, or left to the row path; records routed by the plan
COMPARED = {"columnar": 0, "by rows": 0, "routed": 0}


@pytest.mark.xdist_group("columnar-json-schema-differential")  # with its check, on one worker (--dist loadgroup)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_plan_writes_what_the_row_path_writes(parts, data):
    ids, guid, decoder, mapper, rule, plan = parts
    records = _records(data.draw(st.lists(wire_values(ids, guid), min_size=1, max_size=25)))
    decoder.prepare(records)
    expected, poison = _row_path(mapper, rule, records)
    for record, key in zip(records, plan.lane_keys(records), strict=True):
        if key is not UNROUTED and record.offset not in poison:
            assert key == key_bytes(mapper.map(record)[0][0]), record
            COMPARED["routed"] += 1
    built = plan.build(records)
    assert built is not None  # no tombstone, no newline: never the whole batch declined
    rejected = set(built.rejected)
    assert set(poison) <= rejected, "a poison record was taken by the columnar plan"
    if not rejected <= set(poison):  # a rejected record maps after all: the tier writes the batch by rows
        COMPARED["by rows"] += 1
        assert _tier(plan, mapper).build([Item(r, None, None, 0, 1) for r in records]) is None
        return
    COMPARED["columnar"] += 1
    got = {row["event_id"]: _as_database_would(row) for row in built.table.to_pylist()}
    assert got == expected
    planned = _tier(plan, mapper).build([Item(r, None, None, 0, 1) for r in records])
    assert planned is not None
    assert {item.record.offset: (f.stage, f.error_class, f.message) for item, f in planned.poison} == poison


@pytest.mark.xdist_group("columnar-json-schema-differential")  # with its check, on one worker (--dist loadgroup)
def test_the_differential_compared_columnar_batches():
    """Runs after it (file order): the comparison must not have been skipped every time."""
    assert COMPARED["columnar"] >= 30 and COMPARED["routed"] >= 40, COMPARED


def test_refused_prefixes_are_poison_with_the_row_paths_class_and_the_rest_is_taken(parts):
    ids, _, decoder, mapper, rule, plan = parts
    good = [_prefix(ids["v1" if i % 2 else "v2"]) + json.dumps({"id": i % 4, "kind": f"k{i}"}).encode()
            for i in range(10)]
    hostile = [b'{"id": 1}', _prefix(9999) + b'{"id": 2}', _prefix(ids["avro"]) + b'{"id": 3}',
               _prefix(ids["v1"]) + b'{"id": 4,', _prefix(ids["v1"]) + b'{"id": "four"}',
               _prefix(ids["v1"]) + b'{"kind": "no id"}', b"\x00\x00"]
    records = _records([(v, ()) for v in good[:5] + hostile + good[5:]])
    decoder.prepare(records)
    expected, poison = _row_path(mapper, rule, records)
    assert sorted(c for _, c, _ in poison.values()) == sorted(
        ["bad_magic_byte", "unknown_schema", "schema_mismatch", "invalid_json", "invalid_value", "missing_field",
         "bad_magic_byte"])
    planned = _tier(plan, mapper).build([Item(r, None, None, 0, 1) for r in records])
    assert planned is not None and planned.rows == len(expected) == 4
    assert {item.record.offset: (f.stage, f.error_class, f.message) for item, f in planned.poison} == poison


def test_a_clean_batch_is_read_whole_without_decoding_any_record_one_by_one(parts, monkeypatch):
    ids, _, decoder, mapper, rule, plan = parts
    records = _records([(_prefix(ids["v1"]) + json.dumps({"id": i % 5, "kind": "x", "s": i}).encode(), ())
                        for i in range(50)])
    decoder.prepare(records)
    calls = []
    monkeypatch.setattr(decoder, "decode", lambda record: calls.append(record))
    built = plan.build(records)
    assert built is not None and built.rejected == [] and built.table.num_rows == 5 and calls == []


def test_a_schema_the_store_does_not_hold_yet_is_left_to_the_row_mapper(registry):
    """The plan never fetches: an id nobody prepared is the row mapper's (which fetches it and maps)."""
    stand_in, ids = registry
    _, mapper, _, plan = _fresh(stand_in.url)
    records = _records([(_prefix(ids["v1"]) + b'{"id": 1}', ())])
    built = plan.build(records)
    assert built is not None and built.rejected == [0]
    assert mapper.map(records[0])[0][0] == 1


def test_a_json_schema_pipeline_states_the_columnar_tier_and_why_not_where_it_cannot(registry):
    stand_in, _ = registry

    class Sink:
        def use_columnar(self, columns):
            pass

    def tier(p, exactly_once=False):  # the pipeline's own row mapper (a ChangeMapper for change events)
        return write_tier(p, Sink(), columnar_capable=True, exactly_once=exactly_once,
                          mapper=lambda: mapper_for(p, decoder=JsonSchemaDecoder(
                              p, SchemaRegistrySettings(url=stand_in.url))))

    assert tier(_pipeline(stand_in.url)) == "columnar"
    assert tier(_pipeline(stand_in.url, lanes=3)) == "columnar"  # routed by the JSON's key values
    assert tier(_pipeline(stand_in.url), exactly_once=True) == "columnar"
    assert tier(_pipeline(stand_in.url, lanes=2), exactly_once=True).startswith(
        "rows (exactly-once delivery with lanes above 1 into a table with a conflict key")
    assert tier(_pipeline(stand_in.url, columnar=False)) == "rows (columnar: false)"
    assert tier(_pipeline(stand_in.url, envelope="debezium")) == "columnar"  # change events (ingest.cdc.columnar)
    assert tier(_pipeline(stand_in.url, envelope="debezium", deletes={"mode": "soft"}, lanes=2)) == "columnar"
    assert tier(_pipeline(stand_in.url, transforms=[{"set": {"label": "'x'"}}])).startswith(
        "rows (a JSON Schema pipeline's transforms run on the row path")

"""The change plan (ingest.cdc.columnar) of Debezium Avro events against the row mapper, value by value.

Avro's logical types decode to Python values JSON never has: ``timestamp-micros`` to aware UTC datetimes,
``local-timestamp-micros`` to naive ones, ``decimal`` to Decimals of the schema's scale (``0E-10``...).
The plan lists a datetime as its ISO 8601 text and a Decimal as its plain digits where only timestamp /
``numeric`` columns read them; for every event it takes, the staged value must be the row mapper's value
-- microseconds since the epoch of the column's own zone (UTC for ``timestamptz``, the wall clock for
``timestamp``), the same decimal number and scale -- and every other event is left to the row mapper.
Aware and naive datetimes go into both kinds of column, years 1 to 9999 (the tier stages 1685-2255).

The registry is the stand-in of ``tests/harness/schema_registry.py`` over real HTTP.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_columnar_avro import _datum, _framed

from harness.schema_registry import SchemaRegistryStandIn
from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.config.formats import SchemaRegistrySettings
from ingest.formats.avro import AvroDecoder
from ingest.types import DeleteRow, Record

TOPIC = "db.public.items"
_TIMESTAMP = {"type": "long", "logicalType": "timestamp-micros"}
_LOCAL = {"type": "long", "logicalType": "local-timestamp-micros"}
_DECIMAL = {"type": "bytes", "logicalType": "decimal", "precision": 30, "scale": 10}
VALUE = {"type": "record", "name": "Value", "fields": [
    {"name": "id", "type": "long"},
    {"name": "at", "type": ["null", _TIMESTAMP], "default": None},
    {"name": "wall", "type": ["null", _LOCAL], "default": None},
    {"name": "amount", "type": ["null", _DECIMAL], "default": None}]}
ENVELOPE = {"type": "record", "name": "Envelope", "namespace": TOPIC, "fields": [
    {"name": "before", "type": ["null", VALUE], "default": None},
    {"name": "after", "type": ["null", "Value"], "default": None},
    {"name": "source", "type": {"type": "record", "name": "Source", "fields": [
        {"name": "lsn", "type": ["null", "long"], "default": None}]}},
    {"name": "op", "type": "string"}]}

COLUMNS = {
    "id": {"type": "bigint"},
    "at": {"type": "timestamptz"},
    "at_wall": {"type": "timestamp", "source": "$.at"},  # an aware datetime into a column without a zone
    "wall": {"type": "timestamp"},
    "wall_tz": {"type": "timestamptz", "source": "$.wall"},  # a naive one into timestamptz: taken as UTC
    "amount": {"type": "numeric"},
    "lsn": {"type": "bigint", "source": "@source.lsn"},
}
EPOCH_AWARE, EPOCH_NAIVE = datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(1970, 1, 1)
MICROSECOND = timedelta(microseconds=1)


@pytest.fixture(scope="module")
def parts():
    stand_in = SchemaRegistryStandIn()
    try:
        schema_id = stand_in.register(f"{TOPIC}-value", json.dumps(ENVELOPE))
        p = PipelineSettings.model_validate({
            "name": "p", "topics": [TOPIC], "format": "avro", "envelope": "debezium",
            "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
                     "version_column": "lsn", "columns": COLUMNS}})
        decoder = AvroDecoder(p, SchemaRegistrySettings(url=stand_in.url))
        mapper = mapper_for(p, decoder=decoder)
        rule = p.collapse_rule()
        plan = mapper.columnar_plan(rule.key_index, rule.version_index)
        assert plan is not None, mapper.columnar_refusal(rule.key_index, rule.version_index)
        yield schema_id, decoder, mapper, plan
    finally:
        stand_in.stop()


def _staged_as_row(name: str, value: object) -> object:
    """A staged value as the row mapper's value: microseconds since the column's epoch as its datetime,
    a numeric's text as its Decimal."""
    if value is None:
        return None
    if name in ("at", "wall_tz"):
        return EPOCH_AWARE + value * MICROSECOND
    if name in ("at_wall", "wall"):
        return EPOCH_NAIVE + value * MICROSECOND
    if name == "amount":
        return Decimal(value)
    return value


moments = st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999))
amounts = st.builds(lambda unscaled: Decimal(unscaled).scaleb(-10), st.integers(-10**29 + 1, 10**29 - 1))
images = st.builds(lambda at, wall, amount: {"at": at and at.replace(tzinfo=timezone.utc), "wall": wall,
                                             "amount": amount},
                   st.one_of(st.none(), moments), st.one_of(st.none(), moments),
                   st.one_of(st.none(), st.just(Decimal(0).scaleb(-10)), amounts))
events = st.lists(st.tuples(st.sampled_from("cud"), images), min_size=1, max_size=20)


def test_every_logical_value_the_plan_takes_is_the_row_mappers(parts):
    schema_id, decoder, mapper, plan = parts
    compared = {"values": 0, "deletes": 0, "left": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(events)
    def check(batch: list[tuple[str, dict]]) -> None:
        values = []
        for key, (op, image) in enumerate(batch):  # one event per key: no collapse
            row = {"id": key, **image}
            before, after = (row, None) if op == "d" else (None, row)
            values.append(_framed(schema_id, _datum(ENVELOPE, {"before": before, "after": after, "op": op,
                                                               "source": {"lsn": 100 + key}})))
        records = [Record(TOPIC, 0, offset, b"k", value, None) for offset, value in enumerate(values)]
        decoder.prepare(records)
        built = plan.build(records)
        assert built is not None
        left = set(built.rejected)
        compared["left"] += len(left)
        rows = {row["id"]: row for row in built.table.to_pylist()} if built.table is not None else {}
        assert set(rows) == set(range(len(batch))) - left
        for key, staged in rows.items():
            expected, _ = mapper.map(records[key])
            assert staged["_ingest_deleted"] is isinstance(expected, DeleteRow)
            compared["deletes"] += staged["_ingest_deleted"]
            for position, name in enumerate(COLUMNS):
                if staged["_ingest_deleted"] and name not in ("id", "lsn"):
                    continue  # a delete's other columns: the sink's filler, never written
                got = _staged_as_row(name, staged[name])
                assert got == expected[position], (name, staged[name], expected[position])
                if name == "amount" and got is not None:
                    assert got.as_tuple().exponent == expected[position].as_tuple().exponent  # the same scale
                compared["values"] += 1

    check()
    # the plan took most values (years outside 1685-2255 went to the row mapper), deletes among them
    assert compared["values"] > 1000 and compared["deletes"] > 50 and compared["left"] > 20, compared

"""Per-record decode and map cost of each format, on the benchmark's own record, side by side.

    .venv/bin/python bench/formats_decode.py [--records 20000] [--rounds 5]

The end-to-end benchmark (``pg_pipeline.py --format all``) says how much slower a whole run
is; this one says where the difference comes from. The same records (bench/common.py's event:
id, user, kind, amount, ts) are encoded once per format -- JSON, Avro with the natural types
(decimal(12,2), timestamp-millis) by confluent-kafka's AvroSerializer, Protobuf (int64, string,
a decimal as text, Timestamp) by its ProtobufSerializer, JSON Schema by its JSONSerializer --
against the Schema Registry stand-in of tests/harness, and then for each format, per record,
best of ``--rounds``:

  library   the bare library call: orjson.loads / fastavro.schemaless_reader / FromString
  decode    ingest's decoder (wire format, schema cache, checks)
  map       Mapper.map to the bench's five columns (decode included)
  columnar  the columnar tier's plan (ColumnarPlan.build: decode, Arrow columns, checks, collapse) of
            batches of 5000, per record, for the formats that have the tier (JSON, Avro; issue #38)

It runs in one process, one thread: the figures are CPU per record of that work alone.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT)]

import orjson  # noqa: E402
from common import (  # noqa: E402
    EVENT_AVRO_SCHEMA,
    event,
    event_avro_doc,
    event_message,
    event_message_class,
)
from harness.schema_registry import SchemaRegistryStandIn  # noqa: E402
from harness.serde import avro_values, json_schema_values, protobuf_values  # noqa: E402
from pg_pipeline import COLUMNS  # noqa: E402  (the end-to-end bench's columns)

from ingest.config import ColumnSpec, PipelineSettings  # noqa: E402
from ingest.config.formats import SchemaRegistrySettings  # noqa: E402
from ingest.core.mapping import Mapper  # noqa: E402
from ingest.formats.registry import build_decoder  # noqa: E402
from ingest.types import Record  # noqa: E402

EVENT_JSON_SCHEMA = orjson.dumps({
    "type": "object", "properties": {"id": {"type": "integer"}, "user": {"type": "integer"},
                                     "kind": {"type": "string"}, "amount": {"type": "number"},
                                     "ts": {"type": "integer"}}}).decode()


class _Pipeline:
    """The settings a decoder reads."""

    avro_schema = None
    key_format = "raw"

    def __init__(self, fmt: str) -> None:
        self.format = fmt


def _per_record_us(fn: Callable[[Any], Any], items: Sequence[Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - start)
    return best / len(items) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    n = args.records
    registry = SchemaRegistryStandIn()
    settings = SchemaRegistrySettings(url=registry.url)
    topic = "bench-formats"
    docs = [orjson.loads(event(i, i % (n // 3 or 1))) for i in range(n)]
    event_class = event_message_class()
    messages = [event_message(event_class, i, doc["id"]) for i, doc in enumerate(docs)]
    encoded = {
        "json": [orjson.dumps(d) for d in docs],
        "avro": avro_values(registry.url, topic, EVENT_AVRO_SCHEMA, [event_avro_doc(i, d["id"])
                                                                     for i, d in enumerate(docs)]),
        "json_schema": json_schema_values(registry.url, topic + "-js", EVENT_JSON_SCHEMA, docs),
        "protobuf": protobuf_values(registry.url, topic + "-pb", messages),
    }
    columns = {name: ColumnSpec(**spec) for name, spec in COLUMNS.items()}
    print(f"{n} records (bench/common.py's event, ~110 B as JSON), best of {args.rounds} rounds, "
          "µs per record, one thread")
    print(f"{'format':<12} {'bytes':>6} {'library':>9} {'decode':>8} {'map':>8} {'map / json map':>15} "
          f"{'columnar':>9}")
    json_map = None
    sink = {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["event_id"],
            "columns": COLUMNS}
    for fmt, values in encoded.items():
        records = [Record(topic, 0, i, None, v, None) for i, v in enumerate(values)]
        decoder = build_decoder(_Pipeline(fmt), settings)
        prepare = getattr(decoder, "prepare", None)
        if prepare is not None:
            prepare(records)
        library = _library(fmt, decoder, event_class)
        lib_us = _per_record_us(library, values, args.rounds)
        decode_us = _per_record_us(decoder.decode, records, args.rounds)
        mapper = Mapper(columns, decoder=decoder)
        map_us = _per_record_us(mapper.map, records, args.rounds)
        json_map = json_map or map_us
        size = sum(map(len, values)) / n
        rule = PipelineSettings.model_validate({"name": fmt, "topics": [topic], "sink": sink}).collapse_rule()
        plan = mapper.columnar_plan(rule.key_index, rule.version_index)
        columnar = "-"
        if plan is not None:
            batches = [records[i:i + 5000] for i in range(0, n, 5000)]
            columnar = f"{_per_record_us(plan.build, batches, args.rounds) * len(batches) / n:.2f}"
        print(f"{fmt:<12} {size:>6.0f} {lib_us:>9.2f} {decode_us:>8.2f} {map_us:>8.2f} {map_us / json_map:>14.2f}x"
              f" {columnar:>9}")
    registry.stop()


def _library(fmt: str, decoder: Any, event_class: Any) -> Callable[[bytes], Any]:
    """The bare library call each format's decoder makes, on the same bytes."""
    if fmt == "json":
        return orjson.loads
    if fmt == "json_schema":
        return lambda value: orjson.loads(memoryview(value)[5:])
    if fmt == "avro":
        from fastavro import schemaless_reader

        schema = next(iter(decoder.store.parsed.values()))  # the one schema these records name
        return lambda value: schemaless_reader(io.BytesIO(value[5:]), schema, None)
    return lambda value: event_class.FromString(value[6:])


if __name__ == "__main__":
    main()

"""Avro on the columnar tier: batch decoders A/B, and the tier's plan for Avro beside JSON's.

    .venv/bin/python bench/avro_columnar.py [--batch 5000] [--batches 4] [--rounds 7]

On the benchmark's own record (bench/common.py's event; Avro with its natural types, decimal(12,2)
and timestamp-millis, by confluent-kafka's AvroSerializer against the Schema Registry stand-in), per
record, process CPU, rounds interleaved (each round measures every candidate once), median and best:

Decoders of one batch of one writer schema (the candidates of issue #38):

  fastavro per record       ingest's decoder (``AvroDecoder.decode_batch``: wire format, schema
                            cache, fastavro's schemaless_reader per datum, leftover check): what the
                            row path reads
  + pa.Table.from_pylist    the same, then the documents into Arrow columns
  batch reader              what the tier reads since this change (``AvroDecoder.decode_fields``: the
                            datums of one schema field by field over the batch, each within its own
                            bytes; ingest/formats/avro_batch.py), every field of the record
  fastavro one OCF block    the datums framed as one Avro object-container block (header with the
                            writer schema, one block: count, size, the datums, sync marker) read by
                            ``fastavro.reader``: datum boundaries are lost (see the README), measured
                            only
  polars read_avro          the same block read by polars (an Arrow-native reader), when installed

Lane routing (lanes > 1: the accept loop reads each chunk's key fields): the Avro key fields read
off whole datums (``decode_fields``) and by the prefix reader (``route_fields``, what routing uses),
and the plans' ``lane_keys`` of JSON and Avro.

The plan (``ColumnarPlan.build``: the batch's documents, Arrow columns, checks, collapse) of the same
records as JSON and as Avro, and the row mapper (``Mapper.map`` per record) of each.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT)]

import orjson  # noqa: E402
from common import EVENT_AVRO_SCHEMA, event, event_avro_doc  # noqa: E402
from harness.schema_registry import SchemaRegistryStandIn  # noqa: E402
from harness.serde import avro_values, avro_varint  # noqa: E402
from pg_pipeline import COLUMNS  # noqa: E402  (the end-to-end bench's columns)

from ingest.config import PipelineSettings  # noqa: E402
from ingest.config.formats import SchemaRegistrySettings  # noqa: E402
from ingest.core.mapping import Mapper  # noqa: E402
from ingest.formats.avro import AvroDecoder  # noqa: E402
from ingest.tuning import tune_for_throughput  # noqa: E402
from ingest.types import Record  # noqa: E402


def _text(b: bytes) -> bytes:
    return avro_varint(len(b)) + b


def ocf_block(schema_text: str, datums: list[bytes]) -> bytes:
    """The datums of one writer schema as an Avro object container: header and one null-codec block."""
    sync = os.urandom(16)
    meta = avro_varint(2) + _text(b"avro.schema") + _text(schema_text.encode()) + _text(b"avro.codec") + _text(b"null") \
        + avro_varint(0)
    data = b"".join(datums)
    return b"Obj\x01" + meta + sync + avro_varint(len(datums)) + avro_varint(len(data)) + data + sync


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    n = args.batch * args.batches
    tune_for_throughput()  # the interpreter settings of `ingest run` (its garbage collector's thresholds)
    registry = SchemaRegistryStandIn()
    try:
        run(registry, args, n)
    finally:
        registry.stop()


def run(registry: SchemaRegistryStandIn, args: argparse.Namespace, n: int) -> None:
    import pyarrow as pa
    from fastavro import reader as ocf_reader

    topic = "bench-avro-columnar"
    keys = [i % (n // 3 or 1) for i in range(n)]
    json_values = [event(i, k) for i, k in enumerate(keys)]
    avro_values_ = avro_values(registry.url, topic, EVENT_AVRO_SCHEMA, [event_avro_doc(i, k) for i, k in enumerate(keys)])
    json_records = [Record(topic, i % 6, i, str(k).encode(), v, 1_764_460_800_000 + i)
                    for i, (k, v) in enumerate(zip(keys, json_values))]
    avro_records = [Record(topic, r.partition, r.offset, r.key, v, r.timestamp_ms) for r, v in zip(json_records, avro_values_)]
    sink = {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["event_id"], "columns": COLUMNS}
    p_json = PipelineSettings.model_validate({"name": "j", "topics": [topic], "sink": sink})
    p_avro = PipelineSettings.model_validate({"name": "a", "topics": [topic], "format": "avro", "sink": sink})
    decoder = AvroDecoder(p_avro, SchemaRegistrySettings(url=registry.url))
    decoder.prepare(avro_records)
    json_mapper = Mapper(p_json.sink.columns)
    avro_mapper = Mapper(p_avro.sink.columns, decoder=decoder)
    rule = p_json.collapse_rule()
    json_plan = json_mapper.columnar_plan(rule.key_index, rule.version_index)
    avro_plan = avro_mapper.columnar_plan(rule.key_index, rule.version_index)
    assert json_plan is not None and avro_plan is not None
    batches = [slice(i, i + args.batch) for i in range(0, n, args.batch)]
    schema_text = json.dumps(json.loads(EVENT_AVRO_SCHEMA))
    datums = [v[5:] for v in avro_values_]
    blocks = [ocf_block(schema_text, datums[s]) for s in batches]
    try:
        import polars
    except ImportError:
        polars = None

    # every candidate must give the same documents before it is timed
    per_record = decoder.decode_batch(avro_records[batches[0]])
    assert list(ocf_reader(io.BytesIO(blocks[0]))) == per_record
    # the batch reader reads the fields the plan reads, as fastavro does, and doubts no clean datum
    keys_read = list(per_record[0])
    by_field, refused = decoder.decode_fields(avro_records[batches[0]], keys_read)
    assert not refused and [dict(zip(keys_read, vs)) for vs in zip(*by_field)] == per_record
    # the plan of the Avro batch writes what the row path writes (the tests hold it to that; here a check
    # that it takes the bench record whole)
    built = avro_plan.build(avro_records[batches[0]])
    assert built is not None and not built.rejected, "the Avro plan did not take the bench batch"

    candidates: dict[str, Callable[[], Any]] = {
        "decode: fastavro per record": lambda: [decoder.decode_batch(avro_records[s]) for s in batches],
        "decode: fastavro per record + pa.Table.from_pylist": lambda: [
            pa.Table.from_pylist(decoder.decode_batch(avro_records[s])) for s in batches],
        "decode: fastavro one OCF block": lambda: [list(ocf_reader(io.BytesIO(b))) for b in blocks],
        "decode: batch reader (AvroDecoder.decode_fields)": lambda: [
            decoder.decode_fields(avro_records[s], list(keys_read)) for s in batches],
    }
    if polars is not None:
        candidates["decode: polars read_avro one OCF block"] = lambda: [
            polars.read_avro(io.BytesIO(b)).to_arrow() for b in blocks]
    route_keys = avro_plan._route_doc_keys  # the key fields lane routing reads (lanes > 1)
    candidates.update({
        "route: Avro keys, whole datums (decode_fields)": lambda: [
            decoder.decode_fields(avro_records[s], route_keys) for s in batches],
        "route: Avro keys, prefix reader (route_fields)": lambda: [
            decoder.route_fields(avro_records[s], route_keys) for s in batches],
        "route: JSON (ColumnarPlan.lane_keys)": lambda: [json_plan.lane_keys(json_records[s]) for s in batches],
        "route: Avro (ColumnarPlan.lane_keys)": lambda: [avro_plan.lane_keys(avro_records[s]) for s in batches],
        "plan: JSON (ColumnarPlan.build)": lambda: [json_plan.build(json_records[s]) for s in batches],
        "plan: Avro (ColumnarPlan.build)": lambda: [avro_plan.build(avro_records[s]) for s in batches],
        "rows: JSON (Mapper.map per record)": lambda: [json_mapper.map(r) for r in json_records],
        "rows: Avro (Mapper.map per record)": lambda: [avro_mapper.map(r) for r in avro_records],
    })
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            start = time.process_time()
            fn()
            times[name].append((time.process_time() - start) / n * 1e6)
    print(f"{n} bench records in {len(batches)} batches of {args.batch}, {args.rounds} interleaved rounds, "
          "process CPU µs per record")
    if polars is None:
        print("(polars is not installed: its read_avro is not measured)")
    print(f"{'candidate':<52} {'median':>8} {'best':>8}")
    for name, ts in times.items():
        print(f"{name:<52} {statistics.median(ts):>8.2f} {min(ts):>8.2f}")
    ratio = statistics.median(times["plan: Avro (ColumnarPlan.build)"]) / statistics.median(
        times["plan: JSON (ColumnarPlan.build)"])
    print(f"plan Avro / plan JSON (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Registry failures in the middle of decoding (found by review; each test failed before its fix).

- a TransientError raised while a chunk is being mapped must not let shutdown commit a position past
  the records of that chunk (the pipeline stops with nothing of them committed);
- a schema a chunk was prepared with is what decoding uses: no second lookup (which an outage could fail);
- an outage fetching a Protobuf schema's *reference* is an outage (held), not poison;
- a value protobuf cannot convert (a Timestamp past datetime's range, NaN in a Struct) is poison, not a crash;
- an outage met decoding a key (``@key.$`` sources) propagates, it is not dead-lettered.

The registry is the stand-in of harness/schema_registry.py over real HTTP, in process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import orjson
import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError
from harness import proto_messages, serde
from harness.schema_registry import SchemaRegistryStandIn
from unit.runner_fakes import FAST_RETRY, FakeClock, ModelDlq, ModelTable, SteppedLanes

from ingest.config import ColumnSpec, PipelineSettings
from ingest.config.formats import SchemaRegistrySettings
from ingest.core.mapping import Mapper
from ingest.errors import FatalPipelineError, InvalidRecord, TransientError
from ingest.formats.avro import AvroDecoder
from ingest.formats.protobuf import ProtobufDecoder
from ingest.formats.registry import build_decoder
from ingest.runner.pipeline import Pipeline, RunOptions
from ingest.sources.memory import MemoryLog, MemorySource
from ingest.types import Partition, Record
from ingest.runner.writer import BatchWriter

SCHEMA = '{"type":"record","name":"R","fields":[{"name":"id","type":"long"}]}'


class _P:
    avro_schema = None
    format = "protobuf"


@pytest.fixture
def registry() -> Iterator[SchemaRegistryStandIn]:
    reg = SchemaRegistryStandIn()
    yield reg
    reg.stop()


def _settings() -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["t"], "format": "avro", "lanes": 1, "commit_interval_ms": 10,
        "shutdown_timeout_s": 30, "retry": FAST_RETRY.model_dump(),
        "sink": {"kind": "postgres", "dsn": "postgresql://m@127.0.0.1:1/x", "table": "t", "conflict_key": ["id"],
                 "columns": {"id": {"type": "bigint"}}}})


def _pipeline(settings: PipelineSettings, log: MemoryLog, decoder: AvroDecoder) -> tuple[Pipeline, ModelTable,
                                                                                          ModelDlq, dict]:
    table, dlq = ModelTable(key_index=(0,)), ModelDlq()
    writer = BatchWriter(pipeline="p", write=table.write, dlq=dlq, retry=FAST_RETRY,
                         collapse_rule=settings.sink.collapse_rule(), abort=threading.Event())
    src: dict = {}

    def factory(listener):
        src["s"] = MemorySource(log, listener, ["t"])
        return src["s"]

    pipe = Pipeline(settings, source_factory=factory, writer=writer, stop=threading.Event(), abort=threading.Event(),
                    options=RunOptions(consume_batch_size=100, poll_timeout_ms=0), lanes=SteppedLanes(1, writer),
                    decoder=decoder, clock=FakeClock())
    return pipe, table, dlq, src


def test_an_outage_while_a_chunk_is_mapped_commits_nothing_past_it(registry, monkeypatch):
    settings = _settings()
    good = serde.avro_values(registry.url, "t", SCHEMA, [{"id": i} for i in range(4)])
    p0, p1 = Partition("t", 0), Partition("t", 1)
    log = MemoryLog({p0: [], p1: []})
    log.append(p0, None, good[0])
    for value in good[1:]:
        log.append(p1, None, value)
    decoder = AvroDecoder(settings, SchemaRegistrySettings(url=[registry.url]))
    real_decode = decoder.decode
    calls = {"n": 0}

    def decode(record: Record):
        calls["n"] += 1
        if calls["n"] >= 3:  # from the second record of p1 on: the registry fails mid-chunk
            raise TransientError("schema registry went away", error_class="schema_registry_unavailable")
        return real_decode(record)

    monkeypatch.setattr(decoder, "decode", decode)
    pipe, table, dlq, src = _pipeline(settings, log, decoder)
    pipe.start()
    src["s"].assign([p0, p1])
    assert pipe.step() is False
    with pytest.raises(FatalPipelineError, match="schema registry went away"):
        pipe.finish()
    assert dlq.entries == []
    # p1's records were never written or dead-lettered: nothing of p1 may be committed.
    assert log.committed.get(p1, 0) == 0, dict(log.committed)


def test_decoding_uses_what_prepare_found_without_asking_again(registry):
    good = serde.avro_values(registry.url, "t", SCHEMA, [{"id": 1}])[0]
    unknown = b"\x00\x00\x00\x03\xe7\x02"  # schema id 999
    decoder = AvroDecoder(_P(), SchemaRegistrySettings(url=[registry.url]))
    records = [Record("t", 0, 0, None, good, None), Record("t", 0, 1, None, unknown, None)]
    decoder.prepare(records)
    asked = registry.requests["schemas/ids"]
    registry.fault("503")  # whatever happens now, decoding makes no request
    assert decoder.decode(records[0]) == {"id": 1}
    with pytest.raises(InvalidRecord) as info:
        decoder.decode(records[1])
    assert info.value.error_class == "unknown_schema"
    assert registry.requests["schemas/ids"] == asked


def test_an_outage_fetching_a_protobuf_reference_is_held_not_poison(registry):
    order, _ = proto_messages.classes()
    value = serde.protobuf_values(registry.url, "orders", [order(id=1, status="x")])[0]
    record = Record("orders", 0, 0, None, value, None)
    decoder = ProtobufDecoder(_P(), SchemaRegistrySettings(url=[registry.url]))
    real = decoder.store.client.get_version

    def down(*args, **kwargs):
        raise SchemaRegistryError(503, 50301, "unavailable")

    decoder.store.client.get_version = down
    with pytest.raises(TransientError):
        decoder.prepare([record])
    decoder.store.client.get_version = real  # the registry recovers: the schema is usable
    decoder.prepare([record])
    assert decoder.decode(record)["status"] == "x"


@pytest.mark.parametrize("case", ["timestamp past datetime", "duration past timedelta", "NaN in a Struct"])
def test_a_value_protobuf_cannot_convert_is_poison_not_a_crash(case, registry):
    order, _ = proto_messages.classes()
    message = order(id=1)
    if case == "timestamp past datetime":
        message.at.seconds = 10**12
    elif case == "duration past timedelta":
        message.wait.seconds = 10**15
    else:
        message.extra.update({"x": float("nan")})
    value = serde.protobuf_values(registry.url, "orders", [message])[0]
    record = Record("orders", 0, 0, None, value, None)
    decoder = ProtobufDecoder(_P(), SchemaRegistrySettings(url=[registry.url]))
    decoder.prepare([record])
    mapper = Mapper({"id": ColumnSpec(type="bigint")}, decoder=decoder)
    with pytest.raises(InvalidRecord) as info:
        mapper.map(record)
    assert (info.value.stage, info.value.error_class) == ("decode", "schema_mismatch")


def test_an_outage_decoding_a_key_propagates_and_is_not_dead_lettered(registry):
    key = serde.avro_values(registry.url, "t", SCHEMA, [{"id": 7}], field="key")[0]
    p = PipelineSettings.model_validate({
        "name": "p", "topics": ["t"], "key_format": "avro",
        "sink": {"kind": "postgres", "dsn": "postgresql://m@127.0.0.1:1/x", "table": "t", "on_conflict": "none",
                 "columns": {"id": {"type": "bigint", "source": "@key.$.id"}, "v": {"type": "text"}}}})
    sr = SchemaRegistrySettings(url=[registry.url])
    mapper = Mapper(p.sink.columns, p.key, decoder=build_decoder(p, sr), key_decoder=build_decoder(p, sr, "key"))
    registry.fault("503")  # not prepared, and the registry is down
    with pytest.raises(TransientError):
        mapper.map(Record("t", 0, 0, key, orjson.dumps({"v": "x"}), None))

"""Unit tests of what CEL expressions see of typed values (issue #37, loose ends): Avro logical types
decoded by fastavro, Protobuf well-known types, binary keys and headers -- each has a defined CEL
value or fails the record with a clear ``transform_error``, never a crash."""

from __future__ import annotations

import datetime
import decimal
import io
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastavro import parse_schema, schemaless_writer

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.config.transforms import TransformStep
from ingest.core.transforms import compile_transforms
from ingest.errors import InvalidRecord
from ingest.types import Record

WHERE = "pipelines[0].transforms"
UTC = datetime.timezone.utc


def rec(value: Any = None, *, key: bytes | None = b"k1", headers: tuple[tuple[str, bytes | None], ...] = ()) -> Record:
    raw = None if value is None else orjson.dumps(value)
    return Record("orders", 1, 5, key, raw, 1000, headers, None)


def transformer(*steps: dict[str, Any]):
    t = compile_transforms([TransformStep.model_validate(s) for s in steps], WHERE)
    assert t is not None
    return t


def apply(steps: list[dict[str, Any]], doc: Any, record: Record | None = None) -> Any:
    return transformer(*steps).apply(record or rec({}), doc)


# --------------------------------------------------------------------------- Avro logical types, decoded by fastavro
AVSC = {"type": "record", "name": "Payment", "fields": [
    {"name": "id", "type": "long"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "rate", "type": {"type": "fixed", "name": "Rate", "size": 8, "logicalType": "decimal",
                              "precision": 18, "scale": 6}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    {"name": "local_ms", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
    {"name": "t_ms", "type": {"type": "int", "logicalType": "time-millis"}},
    {"name": "t_us", "type": {"type": "long", "logicalType": "time-micros"}},
    {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "blob", "type": "bytes"},
    {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["CARD", "CASH"]}},
    {"name": "note", "type": ["null", "string"], "default": None},
]}
PAYMENT = {
    "id": 7, "amount": decimal.Decimal("1234.29"), "rate": decimal.Decimal("0.000125"),
    "day": datetime.date(2026, 12, 5),
    "at_ms": datetime.datetime(2026, 12, 5, 10, 30, 1, 250000, tzinfo=UTC),
    "at_us": datetime.datetime(2026, 12, 5, 10, 30, 1, 123456, tzinfo=UTC),
    "local_ms": datetime.datetime(2026, 12, 5, 10, 30, 1, 500000),
    "t_ms": datetime.time(10, 30, 1, 250000), "t_us": datetime.time(10, 30, 1, 123456),
    "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "blob": b"\x00\xffab", "digest": b"\x00\x01\x02\x03", "kind": "CASH", "note": None,
}


def avro_pipeline(tmp_path: Path, transforms: list[dict[str, Any]], columns: dict[str, Any]) -> PipelineSettings:
    avsc = tmp_path / "payment.avsc"
    avsc.write_text(orjson.dumps(AVSC).decode())
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["payments"], "format": "avro", "avro_schema": str(avsc), "transforms": transforms,
        "sink": {"table": "t", "conflict_key": ["id"], "columns": {"id": {"type": "bigint"}, **columns}}})


def avro_record(doc: dict[str, Any]) -> Record:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(AVSC), doc)
    return Record("payments", 0, 1, b"7", buf.getvalue(), 1000)


def map_avro(tmp_path: Path, exprs: dict[str, str], doc: dict[str, Any] = PAYMENT) -> dict[str, Any]:
    """The values the ``set`` expressions give on ``doc`` written by fastavro and decoded by ingest."""
    p = avro_pipeline(tmp_path, [{"set": exprs}], {name: {"type": "jsonb"} for name in exprs})
    row, _ = mapper_for(p, decoder=_decoder(p)).map(avro_record(doc))
    return {"id": row[0], **{name: orjson.loads(v) for name, v in zip(exprs, row[1:])}}  # jsonb: JSON text


def _decoder(p: PipelineSettings) -> Any:
    from ingest.formats.registry import build_decoder

    return build_decoder(p, None)


def test_an_avro_decimal_is_a_cel_double(tmp_path: Path) -> None:
    got = map_avro(tmp_path, {"cents": "int(math.round(value.amount * 100.0))", "big": "value.amount > 1000.0",
                              "same": "value.amount", "rate": "value.rate * 1000000.0"})
    assert got["cents"] == 123429 and got["big"] is True
    assert got["same"] == 1234.29 and got["rate"] == 125.0


def test_a_decimal_anywhere_in_the_value_does_not_fail_expressions_reading_other_fields(tmp_path: Path) -> None:
    # the binding converts the whole value when an expression runs: one Decimal used to fail them all
    got = map_avro(tmp_path, {"k": "value.kind", "n": "has(value.note) && value.note != null"})
    assert got == {"id": 7, "k": "CASH", "n": False}


def test_avro_dates_times_and_timestamps(tmp_path: Path) -> None:
    got = map_avro(tmp_path, {
        "day": "value.day", "day_ts": "timestamp(value.day + 'T00:00:00Z')",
        "at_ms": "value.at_ms", "hour": "value.at_ms.getHours()", "us": "value.at_us",
        "age_s": "value.at_us - value.at_ms",
        "local": "value.local_ms", "t_ms": "value.t_ms", "t_us": "value.t_us",
    })
    assert got["day"] == "2026-12-05" and got["day_ts"] == "2026-12-05T00:00:00+00:00"
    assert got["at_ms"] == "2026-12-05T10:30:01.250000+00:00" and got["hour"] == 10
    assert got["us"] == "2026-12-05T10:30:01.123456+00:00"
    assert got["age_s"] == -0.126544  # a duration's result: seconds
    assert got["local"] == "2026-12-05T10:30:01.500000+00:00"  # a local timestamp is read as UTC
    assert got["t_ms"] == "10:30:01.250000" and got["t_us"] == "10:30:01.123456"


def test_avro_uuid_bytes_fixed_and_enum(tmp_path: Path) -> None:
    got = map_avro(tmp_path, {"ref": "value.ref", "n": "size(value.blob)", "hex": "value.digest == b'\\x00\\x01\\x02\\x03'",
                              "d": "size(value.digest)", "kind": "value.kind"})
    assert got == {"id": 7, "ref": "12345678-1234-5678-1234-567812345678", "n": 4, "hex": True, "d": 4,
                   "kind": "CASH"}


def test_the_decoded_values_the_mapper_gets_are_not_converted(tmp_path: Path) -> None:
    # CEL sees converted copies; the columns still read the exact decoded values
    p = avro_pipeline(tmp_path, [{"filter": "value.amount > 1.0"}],
                      {"amount": {"type": "numeric(12,2)"}, "at_us": {"type": "timestamptz"}})
    row, _ = mapper_for(p, decoder=_decoder(p)).map(avro_record(PAYMENT))
    assert row[1] == decimal.Decimal("1234.29") and row[2] == PAYMENT["at_us"]


# --------------------------------------------------------------------------- values as the decoders give them
@pytest.mark.parametrize(("value", "expr", "expected"), [
    (decimal.Decimal("0.1"), "value.x", 0.1),
    (decimal.Decimal("-12345678901234567890.5"), "value.x < 0.0", True),
    (datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "value.x.getFullYear()", 2026),  # Protobuf Timestamp
    (datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
     "value.x", "2026-01-02T01:04:05+00:00"),
    (datetime.timedelta(seconds=90, microseconds=5), "value.x", 90.000005),  # Protobuf Duration
    (datetime.timedelta(minutes=2), "value.x > duration('1m')", True),
    (b"\x00\x01", "size(value.x)", 2),
    (bytearray(b"\x00\x01"), "size(value.x)", 2),
    ((1, "a"), "value.x[1]", "a"),
    (2**64 - 1, "uint(value.x) == 18446744073709551615u", True),  # Protobuf uint64 past int64: exact text
    (-(2**63), "value.x", -(2**63)),
    ({"n": [decimal.Decimal("1.5"), {"d": datetime.date(2026, 1, 2)}]}, "value.x.n[1].d + '/' + string(value.x.n[0])",
     "2026-01-02/1.5"),
])
def test_typed_values_have_a_defined_cel_value(value: Any, expr: str, expected: Any) -> None:
    assert apply([{"set": {"y": expr}}], {"x": value})["y"] == expected


def test_a_value_cel_cannot_hold_is_a_clear_transform_error() -> None:
    with pytest.raises(InvalidRecord) as info:
        apply([{"set": {"y": "value.other"}}], {"x": {1, 2}, "other": 1})
    assert info.value.error_class == "transform_error"
    assert "value.x" in str(info.value) and "set" in str(info.value), str(info.value)
    with pytest.raises(InvalidRecord) as info:  # past 64 bits: the binding's own message
        apply([{"set": {"y": "value.other"}}], {"x": 2**70, "other": 1})
    assert info.value.error_class == "transform_error" and "out of range" in str(info.value), str(info.value)


def test_optional_field_access_is_no_read_for_the_schema_check() -> None:
    from ingest.core.transforms.fields import transform_problems

    steps = [TransformStep.model_validate({"set": {"y": "value.?nosuch.orValue(1)", "z": "value.b"}})]
    assert [p.split(":")[0] for p in transform_problems(steps, WHERE, lambda path: path == ("a",), "S")] == [
        f"{WHERE}[0].set.z"]
    assert apply([{"set": {"y": "value.?nosuch.orValue(1)"}}], {}) == {"y": 1}


# --------------------------------------------------------------------------- binary keys and headers
def test_a_binary_key_and_header_reach_cel_whole() -> None:
    # the binding cut Python bytes at the first NUL: a Confluent wire-format key (magic byte 0) read as b''
    key = b"\x00\x00\x00\x00\x07\x02ab"
    t = transformer({"set": {"n": "size(key)", "h": "size(headers['trace'])", "first": "key == b'\\x00\\x00\\x00\\x00\\x07\\x02ab'"}})
    got = t.apply(rec({}, key=key, headers=(("trace", b"\x00\x01\x02"),)), {})
    assert got == {"n": 8, "h": 3, "first": True}


# --------------------------------------------------------------------------- ingest_time, explicitly
T0 = datetime.datetime(2026, 12, 5, 14, 0, 0, 250000, tzinfo=UTC)


def ticking(start: datetime.datetime = T0) -> Any:
    """A clock that moves one second each time it is read (and says how often it was)."""
    reads: list[datetime.datetime] = []

    def clock() -> datetime.datetime:
        reads.append(start + datetime.timedelta(seconds=len(reads)))
        return reads[-1]

    clock.reads = reads  # type: ignore[attr-defined]
    return clock


def live(*steps: dict[str, Any], clock: Any) -> Any:
    t = compile_transforms([TransformStep.model_validate(s) for s in steps], WHERE, clock=clock)
    assert t is not None
    return t


def test_ingest_time_is_read_by_a_step_that_declares_it_not_replay_stable() -> None:
    clock = ticking()
    t = live({"set": {"loaded_at": "ingest_time", "lag_s": "ingest_time - timestamp(value.ts)"},
              "replay_stable": False},
             {"filter": "ingest_time.getFullYear() == 2026", "replay_stable": False},
             {"set": {"again": "ingest_time"}, "when": "value.n > 0", "replay_stable": False}, clock=clock)
    got = t.apply(rec({}), {"ts": "2026-12-05T13:59:00Z", "n": 1})
    # one ingest time per record, whatever the number of steps reading it
    assert got == {"ts": "2026-12-05T13:59:00Z", "n": 1, "loaded_at": "2026-12-05T14:00:00.250000+00:00",
                   "lag_s": 60.25, "again": "2026-12-05T14:00:00.250000+00:00"}
    assert len(clock.reads) == 1
    assert t.apply(rec({}), {"ts": "2026-12-05T13:59:00Z", "n": 1})["loaded_at"] == "2026-12-05T14:00:01.250000+00:00"


def test_a_pipeline_reading_no_ingest_time_never_reads_the_clock() -> None:
    clock = ticking()
    t = live({"set": {"a": "value.n + 1", "note": "'ingest_time'"}}, clock=clock)
    assert t.apply(rec({}), {"n": 1}) == {"n": 1, "a": 2, "note": "ingest_time"}  # a name in a literal is text
    assert clock.reads == []


@pytest.mark.parametrize(("step", "path", "column"), [
    ({"set": {"x": "value.n", "loaded_at": "ingest_time"}}, "set.loaded_at", 1),
    ({"filter": "value.n > 0 && ingest_time > timestamp(value.ts)"}, "filter", 16),
    ({"set": {"x": "1"}, "when": "ingest_time != null"}, "when", 1),
    ({"set": {"x": "1"}, "when": "ingest_time != null", "replay_stable": True}, "when", 1),
])
def test_reading_ingest_time_elsewhere_is_refused_naming_the_step_and_position(step: dict[str, Any], path: str,
                                                                              column: int) -> None:
    from ingest.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        compile_transforms([TransformStep.model_validate({"set": {"y": "1"}}), TransformStep.model_validate(step)],
                           WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}[1].{path}: does not compile at line 1, column {column}: reads ingest_time, "
                              "which is not replay-stable"), message
    assert "replay_stable: false" in message


def test_the_config_and_check_refuse_ingest_time_in_a_replay_stable_step(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from harness import write_config
    from ingest.cli import app
    from ingest.config import load_settings
    from ingest.errors import ConfigError

    cfg = {"kafka": {"bootstrap_servers": "127.0.0.1:1"}, "pipelines": [{
        "name": "p", "topics": ["t"], "transforms": [{"set": {"at": "ingest_time"}}],
        "sink": {"dsn": "postgresql://u@127.0.0.1:1/db", "table": "t", "conflict_key": ["id"],
                 "columns": {"id": {"type": "bigint"}, "at": {"type": "timestamptz"}}}}]}
    path = write_config(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"pipelines\[0\]\.transforms\[0\]\.set\.at: .*reads ingest_time"):
        load_settings(path)
    result = CliRunner().invoke(app, ["check", "-c", str(path)])
    assert result.exit_code == 2 and "pipelines[0].transforms[0].set.at" in result.output, result.output
    cfg["pipelines"][0]["transforms"][0]["replay_stable"] = False
    assert load_settings(write_config(tmp_path, cfg, name="ok.yaml")).pipelines[0].transforms[0].replay_stable is False


# --------------------------------------------------------------------------- the CEL functions the README lists
FUNCTIONS_DOC = {"s": "Hello, World", "n": -2.5, "l": [3, 1, 2], "m": {"a": 1}, "ts": "2026-12-05T10:30:00Z"}


@pytest.mark.parametrize(("expr", "expected"), [
    ("size(value.s) + value.l.size()", 15), ("has(value.m.a) && !has(value.m.b)", True),
    ("value.s.matches('^H.*d$') && value.s.startsWith('He') && value.s.endsWith('ld')", True),
    ("value.s.contains('lo') && 'a' in value.m && 2 in value.l", True),
    ("[int('42'), int(2.9), int(-2.9)]", [42, 2, -2]), ("double('1.5') + double(1)", 2.5),
    ("string(1.5) + string(7) + string(b'ab')", "1.57ab"), ("uint('42') == 42u", True),
    ("type(value.n) == double && dyn(1) == 1.0", True),
    ("[value.l.all(x, x > 0), value.l.exists(x, x > 2), value.l.exists_one(x, x > 2)]", [True, True, True]),
    ("value.l.map(x, x * 2) + value.l.filter(x, x > 1) + value.l.map(x, x > 1, x * 10)", [6, 2, 4, 3, 2, 30, 20]),
    ("timestamp(value.ts) + duration('1h30m')", "2026-12-05T12:00:00+00:00"),
    ("timestamp(value.ts) - timestamp('2026-12-05T00:00:00Z')", 37800.0),
    ("[timestamp(value.ts).getFullYear(), timestamp(value.ts).getMonth(), timestamp(value.ts).getDate(), "
     "timestamp(value.ts).getDayOfMonth(), timestamp(value.ts).getDayOfWeek(), timestamp(value.ts).getDayOfYear()]",
     [2026, 11, 5, 4, 6, 338]),
    ("[timestamp(value.ts).getHours(), timestamp(value.ts).getHours('Europe/Rome'), timestamp(value.ts).getMinutes(), "
     "timestamp(value.ts).getSeconds(), timestamp(value.ts).getMilliseconds()]", [10, 11, 30, 0, 0]),
    ("int(timestamp(value.ts))", 1796466600), ("string(timestamp(value.ts))", "2026-12-05T10:30:00Z"),
    ("timestamp(1796466600) == timestamp(value.ts)", True), ("duration('90s').getMinutes()", 1),
    ("[value.s.charAt(1), value.s.lowerAscii(), value.s.upperAscii(), value.s.replace('l', 'L', 1)]",
     ["e", "hello, world", "HELLO, WORLD", "HeLlo, World"]),
    ("[value.s.indexOf('o'), value.s.lastIndexOf('o')]", [4, 8]),
    ("value.s.split(', ') + [value.s.substring(0, 5), '  x '.trim(), ['a', 'b'].join('-'), value.s.reverse()]",
     ["Hello", "World", "Hello", "x", "a-b", "dlroW ,olleH"]),
    ("'%s=%d %.2f'.format(['a', 1, 2.5])", "a=1 2.50"), ("strings.quote('a')", '"a"'),
    ("[math.ceil(value.n), math.floor(value.n), math.round(value.n), math.trunc(value.n), math.abs(value.n)]",
     [-2.0, -3.0, -3.0, -2.0, 2.5]),
    ("[math.greatest(1, 5, 3), math.least([4, 2]), math.bitAnd(6, 3)]", [5, 2, 2]),
    ("math.isNaN(0.0 / 0.0) && math.isInf(1.0 / 0.0) && math.isFinite(value.n)", True),
    ("base64.encode(b'\\x00ab') + '/' + string(base64.decode('YWI='))", "AGFi/ab"),
    ("cel.bind(x, value.n * 2.0, x + x)", -10.0), ("value.?nope.orValue('d') + value.?s.orValue('d')", "dHello, World"),
])
def test_the_cel_functions_the_readme_lists(expr: str, expected: Any) -> None:
    assert apply([{"set": {"y": expr}}], FUNCTIONS_DOC)["y"] == expected

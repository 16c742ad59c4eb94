"""The Protobuf decoder's batch read for the columnar tier (``decode_fields``, ``route_fields``) against
its per-record :meth:`~ingest.formats.protobuf.ProtobufDecoder.decode`, which the row mapper uses.

For every batch of hostile values -- clean ``shop.Order`` messages (Timestamps anywhere in and beyond
the years a datetime holds, optional fields and wrappers set and unset, enums, maps, repeated
messages), truncated ones, garbage after the indexes, an unknown schema id, no magic byte, the file's
second message (indexes ``[1]``), a schema id in a header -- a record is rejected exactly when
``decode`` refuses it, and every other record's values are ``decode``'s: as they are, or for a staged
Timestamp key (``staged``) as the microseconds since the epoch of ``decode``'s datetime, which is what
the columnar plan stages of it; ``route_fields`` gives the same values of the key fields.
"""

from __future__ import annotations

import datetime as dt
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.proto_messages import classes
from harness.schema_registry import SchemaRegistryStandIn
from harness.serde import protobuf_values
from ingest.config.formats import SchemaRegistrySettings
from ingest.core.mapping.columnar import Digits, Micros
from ingest.errors import InvalidRecord
from ingest.formats.protobuf import ProtobufDecoder
from ingest.formats.wire import VALUE_SCHEMA_ID_HEADER
from ingest.types import Record

TOPIC = "orders"
KEYS = ["id", "status", "at", "maybe", "nickname", "tags", "attrs", "lines", "missing"]
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
#: seconds of the first and last datetime (UTC)
FIRST_S, LAST_S = -62_135_596_800, 253_402_300_799


class _Pipeline:
    format = "protobuf"
    avro_schema = None
    key_format = "raw"


@pytest.fixture(scope="module")
def parts():
    registry = SchemaRegistryStandIn()
    try:
        order, refund = classes()
        refund_value = protobuf_values(registry.url, TOPIC + "-refunds", [refund(id=7, reason="second")])[0]
        decoder = ProtobufDecoder(_Pipeline(), SchemaRegistrySettings(url=registry.url))
        yield registry.url, order, refund_value, decoder
    finally:
        registry.stop()


@st.composite
def orders(draw: st.DrawFn, order: type) -> object:
    m = order(id=draw(st.integers(min_value=-(2**63), max_value=2**63 - 1)), status=draw(st.text(max_size=4)),
              state=draw(st.integers(min_value=0, max_value=3)), tags=draw(st.lists(st.text(max_size=2), max_size=2)))
    if draw(st.booleans()):
        m.at.seconds = draw(st.integers(min_value=FIRST_S - 2, max_value=LAST_S + 2) | st.sampled_from(
            [FIRST_S, LAST_S, FIRST_S - 1, LAST_S + 1, 0, -1]))
        m.at.nanos = draw(st.sampled_from([0, 999, 1000, 999_999_999, 500_000_000]))
    if draw(st.booleans()):
        m.maybe.value = draw(st.integers(min_value=-5, max_value=5))
    if draw(st.booleans()):
        m.nickname = draw(st.text(max_size=3))
    for k, v in draw(st.dictionaries(st.text(max_size=2), st.integers(min_value=0, max_value=9), max_size=2)).items():
        m.attrs[k] = v
    if draw(st.booleans()):
        m.lines.add(sku="a", qty=draw(st.integers(min_value=0, max_value=3)))
    return m


@st.composite
def batches(draw: st.DrawFn, url: str, order: type, refund_value: bytes) -> list[Record]:
    messages = draw(st.lists(orders(order), min_size=1, max_size=8))
    values = protobuf_values(url, TOPIC, messages)
    records = []
    for i, value in enumerate(values):
        how = draw(st.sampled_from(["clean"] * 6 + ["cut", "garbage", "unknown", "magic", "refund", "header"]))
        headers = None
        if how == "cut":
            value = value[:draw(st.integers(min_value=0, max_value=len(value) - 1))]
        elif how == "garbage":
            value = value[:6] + draw(st.binary(min_size=1, max_size=6))
        elif how == "unknown":
            value = b"\x00" + struct.pack(">I", 9999) + value[5:]
        elif how == "magic":
            value = b"\x7b" + value[1:]
        elif how == "refund":
            value = refund_value
        elif how == "header":  # the id in a header, the whole value the payload (indexes first)
            headers = ((VALUE_SCHEMA_ID_HEADER, value[:5]),)
            value = value[5:]
        records.append(Record(TOPIC, 0, i, None, value, None, headers))
    return records


def _staged(value: object) -> object:
    return Micros((value - EPOCH) // dt.timedelta(microseconds=1)) if isinstance(value, dt.datetime) else value


COMPARED = {"taken": 0, "rejected": 0}


@pytest.mark.xdist_group("protobuf-fields")  # with its check, on one worker (--dist loadgroup)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), staged=st.sampled_from([None, Micros, Digits]))
def test_the_batch_read_gives_decodes_values_and_rejects_what_decode_refuses(parts, data, staged):
    """``staged`` for the Timestamp key ``at``: Micros, as a timestamp column stages it; Digits, as a
    numeric column would -- ignored (only an ``int`` type is a Timestamp's staged form: the row mapper
    refuses a datetime for a number, and so must the plan)."""
    url, order, refund_value, decoder = parts
    records = data.draw(batches(url, order, refund_value))
    decoder.prepare(records)
    by_field, rejected = decoder.decode_fields(records, KEYS, {"at": staged} if staged else None)
    routed, route_rejected = decoder.route_fields(records, ["id", "at"])
    for i, record in enumerate(records):
        try:
            doc = decoder.decode(record)
        except InvalidRecord:
            assert i in rejected, record  # (route_fields may give a poison record's keys: its lane does not matter)
            COMPARED["rejected"] += 1
            continue
        assert i not in rejected and i not in route_rejected, record
        COMPARED["taken"] += 1
        for key, values in zip(KEYS, by_field, strict=True):
            want = doc.get(key)
            want = _staged(want) if staged is Micros and key == "at" else want
            assert values[i] == want and type(values[i]) is type(want), (key, values[i], want)
        assert [routed[0][i], routed[1][i]] == [doc.get("id"), doc.get("at")]


@pytest.mark.xdist_group("protobuf-fields")  # with its check, on one worker (--dist loadgroup)
def test_the_batch_read_compared_both_kinds_of_record():
    """Runs after it (file order): both kinds must have been compared many times."""
    assert COMPARED["taken"] >= 150 and COMPARED["rejected"] >= 50, COMPARED

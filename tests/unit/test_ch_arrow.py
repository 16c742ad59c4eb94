"""ClickHouse type -> Arrow type mapping of the Arrow insert path (pure logic, no server)."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest

from ingest.core.dialects import ch_type
from ingest.sinks.clickhouse.arrow import ArrowEncoder, arrow_type


@pytest.mark.parametrize(("name", "expected"), [
    ("UInt8", pa.uint8()), ("UInt64", pa.uint64()), ("Int8", pa.int8()), ("Int64", pa.int64()),
    ("Float32", pa.float32()), ("Float64", pa.float64()),
    ("Decimal(12, 2)", pa.decimal128(12, 2)), ("Decimal(40, 10)", pa.decimal256(40, 10)),
    ("String", pa.string()), ("LowCardinality(String)", pa.string()), ("JSON", pa.string()),
    ("Bool", pa.bool_()), ("Date", pa.date32()),
    ("DateTime64(3)", pa.timestamp("ms")), ("DateTime64(6)", pa.timestamp("us")), ("DateTime64(0)", pa.timestamp("s")),
    ("Nullable(Int32)", pa.int32()), ("Array(Nullable(String))", pa.list_(pa.string())),
    ("Array(Array(UInt8))", pa.list_(pa.list_(pa.uint8()))),
])
def test_types_with_an_exact_arrow_twin(name: str, expected: pa.DataType) -> None:
    assert arrow_type(ch_type(name), pa) == expected


@pytest.mark.parametrize("name", ["UUID", "Nullable(UUID)", "Array(UUID)", "DateTime64(4)"])
def test_types_without_one_keep_native(name: str) -> None:
    assert arrow_type(ch_type(name), pa) is None
    assert ArrowEncoder.for_columns(["id", "x"], [ch_type("UInt64"), ch_type(name)]) is None


def test_table_from_mapper_values() -> None:
    enc = ArrowEncoder.for_columns(["id", "amount", "ts", "tags"], [
        ch_type("UInt64"), ch_type("Decimal(12, 2)"), ch_type("DateTime64(3)"), ch_type("Array(Nullable(String))")])
    assert enc is not None
    table = enc.table([(1, 2), (Decimal("1.50"), None), (1_700_000_000_123, 0), (["a", None], [])])
    assert table.num_rows == 2
    assert table.column("amount").to_pylist() == [Decimal("1.50"), None]
    assert table.column("ts").cast(pa.int64()).to_pylist() == [1_700_000_000_123, 0]
    assert table.column("tags").to_pylist() == [["a", None], []]


def test_values_arrow_refuses_raise() -> None:
    enc = ArrowEncoder.for_columns(["u8"], [ch_type("UInt8")])
    assert enc is not None
    with pytest.raises((pa.ArrowException, OverflowError)):
        enc.table([(300,)])

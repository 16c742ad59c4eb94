"""numeric columns staged as text (``ingest.sinks.postgres.statements``): the same stored values as
psycopg's own numeric parameters, the same data errors.

The COPY path writes a Decimal's text into a text stage column and the upsert casts it; the
``values`` path sends the Decimal as a parameter (psycopg's numeric dumper), which is the
reference here. Both write the same rows into twin tables of a real PostgreSQL; every stored value
must read back as the same text (scale included), and a value too large for its column must fail
both with SQLSTATE class 22 so poison isolation treats it alike.
"""

from __future__ import annotations

from decimal import Decimal

import psycopg
import pytest

from ingest.core.routing import stream_id
from ingest.errors import PermanentError
from ingest.sinks.postgres.schema import sink_table_sql
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.sink import PostgresSink
from ingest.sinks.postgres.statements import UpsertStatements

COLUMNS = {
    "id": {"type": "bigint"},
    "amount": {"type": "numeric(12,2)"},  # rounded to 2 places; |value| < 10**10
    "exact": {"type": "numeric"},  # unconstrained: keeps the Decimal's scale
    "price": {"type": "numeric(6,3)"},  # a conflict key: staged binary, compared by the upsert
}

#: Decimals of every shape a coercer can produce: exponents, negative zero, halves to round, many digits.
VALUES = [Decimal("12.34"), Decimal("12.345"), Decimal("-12.345"), Decimal("0.005"), Decimal("-0.005"),
          Decimal("1E+2"), Decimal("1.5E-10"), Decimal("-0"), Decimal("-0.00"), Decimal("9999999999.994"),
          Decimal("12.340"), Decimal("0.1"), Decimal("123456789.123456789"), Decimal("1E-7"), None]


#: the sink's hidden source columns (_ingest_stream, _ingest_offset) of a row read at ``offset``
def _source(offset: int) -> tuple[int, int]:
    return stream_id("t", 0), offset


def _sink(pg_dsn: str, table: str, method: str) -> PostgresSink:
    cfg = PostgresSinkSettings(dsn=pg_dsn, table=table, conflict_key=["id", "price"], columns=COLUMNS,
                               write_method=method)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in sink_table_sql(cfg):
            conn.execute(statement)
    return PostgresSink(cfg, pool_size=1)


def _stored(pg_dsn: str, table: str) -> list[tuple]:
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(f'SELECT id, amount::text, exact::text, price::text FROM "{table}" ORDER BY id').fetchall()


def test_only_numeric_columns_the_upsert_alone_reads_are_staged_as_text(pg_dsn):
    cfg = PostgresSinkSettings(dsn=pg_dsn, table="t", conflict_key=["id", "price"], columns=COLUMNS,
                               version_column="exact")
    assert UpsertStatements(cfg).numeric_as_text == (1,)  # exact: the version; price: a key
    cfg = PostgresSinkSettings(dsn=pg_dsn, table="t", conflict_key=["id", "price"], columns=COLUMNS)
    assert UpsertStatements(cfg).numeric_as_text == (1, 2)


def test_numeric_text_stage_stores_what_numeric_parameters_store(pg_dsn):
    rows = [(i, v, v, Decimal(i) / 8, *_source(i)) for i, v in enumerate(VALUES)]
    sinks = {m: _sink(pg_dsn, f"num_{m}", m) for m in ("copy", "values")}
    try:
        for sink in sinks.values():
            sink.write(rows)
        copied, reference = _stored(pg_dsn, "num_copy"), _stored(pg_dsn, "num_values")
        assert copied == reference
        assert len(copied) == len(VALUES)
        by_id = {r[0]: r for r in copied}
        assert by_id[1][1:3] == ("12.35", "12.345") and by_id[2][1] == "-12.35"  # rounded half away from zero
        assert by_id[5][1:3] == ("100.00", "100") and by_id[10][2] == "12.340" and by_id[14][1:3] == (None, None)
        # An upsert of the same keys with new values replaces them alike.
        for sink in sinks.values():
            sink.write([(r[0], Decimal("1.5"), Decimal("2.50"), r[3], *_source(100 + r[0])) for r in rows[:3]])
        assert _stored(pg_dsn, "num_copy") == _stored(pg_dsn, "num_values")
        assert _stored(pg_dsn, "num_copy")[0][1:3] == ("1.50", "2.50")
    finally:
        for sink in sinks.values():
            sink.close()


@pytest.mark.parametrize("method", ["copy", "values"])
def test_a_numeric_value_too_large_for_its_column_is_a_data_error(pg_dsn, method):
    sink = _sink(pg_dsn, f"num_over_{method}", method)
    try:
        with pytest.raises(PermanentError) as caught:
            sink.write([(1, Decimal("1"), None, Decimal("0"), *_source(1)),
                        (2, Decimal("1E+10"), None, Decimal("0"), *_source(2))])
        # numeric_value_out_of_range, class 22: isolation splits the batch down to that row
        assert (caught.value.sqlstate, caught.value.error_class) == ("22003", "data_exception")
        assert _stored(pg_dsn, f"num_over_{method}") == []  # the batch's transaction rolled back
        sink.write([(1, Decimal("1"), None, Decimal("0"), *_source(1))])
        assert _stored(pg_dsn, f"num_over_{method}") == [(1, "1.00", None, "0.000")]
    finally:
        sink.close()

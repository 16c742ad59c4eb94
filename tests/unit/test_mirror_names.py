"""The name sanitiser and the case guard (ingest.mirror.names)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.mirror.errors import SchemaIncompatible, Unroutable
from ingest.mirror.names import (
    CH_MAX_COLUMN_ESCAPED,
    CLICKHOUSE,
    POSTGRES,
    NameGuard,
    Reserved,
    ch_escaped,
    ch_max_table_name,
    check_column,
    sanitize_table,
)


def refusal(name: str, dialect: str = POSTGRES, **kw) -> str:
    with pytest.raises(Unroutable) as err:
        sanitize_table(name, dialect, **kw)
    assert err.value.error_class == "unroutable"
    return err.value.reason


@pytest.mark.parametrize("dialect", [POSTGRES, CLICKHOUSE])
def test_dots_become_underscores_and_everything_else_is_kept(dialect) -> None:
    assert sanitize_table("shop.public.orders", dialect) == "shop_public_orders"
    hostile = 'Ord"ers `x` ; DROP TABLE t; -- ü 表 😀'
    assert sanitize_table(hostile, dialect) == hostile


@pytest.mark.parametrize("dialect", [POSTGRES, CLICKHOUSE])
@pytest.mark.parametrize("bad", ["a\x00b", "tab\there", "new\nline", "del\x7f", "c1\x85", "ls\u2028", "ps\u2029",
                                 "surrogate\ud800"])
def test_control_characters_are_refused(dialect, bad) -> None:
    assert refusal(bad, dialect) == "control_character"


def test_the_empty_name_is_refused() -> None:
    assert refusal("") == "empty_name"


def test_postgres_names_hold_63_bytes_never_truncated() -> None:
    assert sanitize_table("a" * 63, POSTGRES) == "a" * 63
    assert refusal("a" * 64) == "too_long"
    assert refusal("é" * 32) == "too_long"  # 64 bytes in 32 characters
    assert sanitize_table("é" * 31, POSTGRES) == "é" * 31
    assert refusal("x" * 200) == "too_long"


def test_a_derived_suffix_must_fit_too() -> None:
    name = "a" * 50
    assert sanitize_table(name, POSTGRES) == name
    assert refusal(name, suffixes=("_ingest_deleted",)) == "too_long"
    assert sanitize_table("a" * 48, POSTGRES, suffixes=("_ingest_deleted",)) == "a" * 48


def test_clickhouse_measures_the_escaped_file_name_against_its_database() -> None:
    assert ch_escaped("ab_C9") == "ab_C9"
    assert ch_escaped("a.b é") == "a%2Eb%20%C3%A9"
    assert ch_max_table_name("default") == 206  # 255 - len("default") - 42, as ClickHouse computes it
    assert ch_max_table_name("x" * 300) == 0
    assert sanitize_table("a" * 206, CLICKHOUSE) == "a" * 206
    assert refusal("a" * 207, CLICKHOUSE) == "too_long"
    assert refusal("a" * 200, CLICKHOUSE, database="long_database_name") == "too_long"
    assert refusal("é" * 40, CLICKHOUSE) == "too_long"  # 80 bytes, 240 escaped
    assert sanitize_table("x" * 200 + ".", CLICKHOUSE) == "x" * 200 + "_"  # a dot is '_', not '%2E'


@pytest.mark.parametrize("dialect", [POSTGRES, CLICKHOUSE])
@pytest.mark.parametrize("name", ["ingest_offsets", "ingest_lane_offsets", "orders_ingest_deleted",
                                  "ingest.offsets", "my_dlq"])
def test_ingests_own_tables_are_refused(dialect, name) -> None:
    assert refusal(name, dialect, reserved=Reserved(dlq_table="my_dlq")) == "reserved_name"


def test_the_default_dlq_table_is_reserved_by_default() -> None:
    assert refusal("ingest_dlq") == "reserved_name"
    assert refusal("ingest.dlq", CLICKHOUSE) == "reserved_name"  # a dot is an underscore first


def test_reserved_names_are_compared_as_postgres_folds_them() -> None:
    assert refusal("INGEST_OFFSETS") == "reserved_name"
    assert refusal("Orders_Ingest_Deleted") == "reserved_name"
    assert sanitize_table("INGEST_OFFSETS", CLICKHOUSE) == "INGEST_OFFSETS"  # ClickHouse folds nothing
    assert refusal("tomb", reserved=Reserved(tables=frozenset({"Tomb"}))) == "reserved_name"
    assert sanitize_table("ingest_dlq", POSTGRES, reserved=Reserved(dlq_table="other")) == "ingest_dlq"


def test_the_guard_keeps_the_first_spelling_and_refuses_another() -> None:
    guard = NameGuard(POSTGRES, existing=["Customers"])
    assert guard.claim("orders") == "orders"
    assert guard.claim("orders") == "orders"
    with pytest.raises(Unroutable) as err:
        guard.claim("Orders")
    assert err.value.reason == "case_collision"
    with pytest.raises(Unroutable):
        guard.claim("customers")  # the catalog's spelling owns it
    assert guard.claim("Customers") == "Customers"
    assert guard.claim("ÜBER") == "ÜBER" and guard.claim("über") == "über"  # PostgreSQL folds ASCII only
    assert guard.known()["orders"] == "orders"


def test_clickhouse_has_no_case_collisions() -> None:
    guard = NameGuard(CLICKHOUSE)
    assert guard.claim("Orders") == "Orders" and guard.claim("orders") == "orders"


def test_the_guard_is_consistent_under_threads() -> None:
    guard = NameGuard(POSTGRES)
    spellings = ["Items", "ITEMS", "items", "iTeMs"] * 25
    won: list[str] = []
    lock = threading.Lock()

    def claim(name: str) -> None:
        try:
            guard.claim(name)
        except Unroutable:
            return
        with lock:
            won.append(name)

    threads = [threading.Thread(target=claim, args=(s,)) for s in spellings]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(won)) == 1


def test_column_names_are_kept_and_refused_by_the_same_rules() -> None:
    assert check_column("a.b c", POSTGRES) == "a.b c"
    for bad, dialect in [("", POSTGRES), ("x\x00", POSTGRES), ("a" * 64, POSTGRES), ("_ingest_deleted", POSTGRES),
                         ("_version", CLICKHOUSE), ("é" * (CH_MAX_COLUMN_ESCAPED // 6 + 1), CLICKHOUSE)]:
        with pytest.raises(SchemaIncompatible) as err:
            check_column(bad, dialect, reserved=("_version",) if dialect == CLICKHOUSE else ())
        assert err.value.reason == "bad_column_name" and err.value.error_class == "schema_incompatible"


@given(st.text(max_size=80), st.sampled_from([POSTGRES, CLICKHOUSE]))
def test_a_name_is_either_refused_with_a_reason_or_a_dot_free_identifier_within_the_limit(text, dialect) -> None:
    """Property: sanitising never raises anything but Unroutable, and what it returns has no dot, no
    control character, fits the limit and differs from the input only where dots were."""
    try:
        name = sanitize_table(text, dialect)
    except Unroutable as exc:
        assert exc.reason in {"empty_name", "control_character", "too_long", "reserved_name"}
        return
    assert "." not in name and len(name) == len(text)
    assert all(a == b or (a == "." and b == "_") for a, b in zip(text, name))
    if dialect == POSTGRES:
        assert len(name.encode()) <= 63
    else:
        assert len(ch_escaped(name)) <= ch_max_table_name("default")
    assert sanitize_table(name, dialect) == name  # idempotent


@given(st.lists(st.text(alphabet="aAbB", min_size=1, max_size=3), max_size=20))
def test_the_guard_admits_exactly_one_spelling_per_folded_name(names) -> None:
    guard = NameGuard(POSTGRES)
    admitted: dict[str, str] = {}
    for n in names:
        try:
            guard.claim(n)
        except Unroutable:
            assert admitted[n.lower()] != n
            continue
        assert admitted.setdefault(n.lower(), n) == n

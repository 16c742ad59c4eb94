"""Unit tests for ingest.sinks.clickhouse.errors: one test per class of the classification table.

Exceptions are built the way clickhouse-connect raises them (``code``/``name``
attributes from modern servers; the code only in the text from old ones such
as 18.16; transport errors without any code). The same classifier is
exercised against real chDB and 18.16 errors in tests/integration/test_clickhouse.py.
"""

from __future__ import annotations

import struct

import pytest
import urllib3
from clickhouse_connect.driver import exceptions as cc

from ingest.errors import PermanentError, TransientError
from ingest.sinks.clickhouse.errors import (
    PERMANENT_CODES,
    TRANSIENT_CODES,
    classify,
    error_code,
)


def server_error(code: int, name: str, text: str = "something failed") -> cc.DatabaseError:
    """As clickhouse-connect raises it for a modern server (code header present)."""
    return cc.DatabaseError(
        f"HTTP driver received HTTP status 500, server response: Code: {code}. DB::Exception: {text}. "
        f"({name}) (version 24.8.4.13 (official build)) (for url http://127.0.0.1:8123)",
        code=code, name=name,
    )


def transient(exc: BaseException) -> TransientError:
    err = classify(exc)
    assert isinstance(err, TransientError), f"{exc!r} -> {err!r}"
    return err


def permanent(exc: BaseException) -> PermanentError:
    err = classify(exc)
    assert isinstance(err, PermanentError), f"{exc!r} -> {err!r}"
    return err


# --------------------------------------------------------------------------- transient


@pytest.mark.parametrize("exc", [
    cc.OperationalError("Error HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded "
                        "(Caused by NewConnectionError: [Errno 111] Connection refused)"),
    ConnectionRefusedError(111, "Connection refused"),
    ConnectionResetError(104, "Connection reset by peer"),
    TimeoutError("timed out"),
    urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection: refused"),  # type: ignore[arg-type]
    urllib3.exceptions.ProtocolError("Connection aborted."),
    urllib3.exceptions.ReadTimeoutError(None, "/", "Read timed out."),  # type: ignore[arg-type]
    cc.DatabaseError("HTTP driver received HTTP status 502, server response: <html>Bad Gateway</html>"),
])
def test_network_and_unreachable_are_transient(exc: BaseException) -> None:
    assert transient(exc).error_class == "connection"


@pytest.mark.parametrize(("code", "name"), [(159, "TIMEOUT_EXCEEDED"), (209, "SOCKET_TIMEOUT"), (160, "TOO_SLOW")])
def test_timeouts_are_transient(code: int, name: str) -> None:
    assert transient(server_error(code, name)).error_class == name.lower()


@pytest.mark.parametrize(("code", "name"), [
    (252, "TOO_MANY_PARTS"), (202, "TOO_MANY_SIMULTANEOUS_QUERIES"), (241, "MEMORY_LIMIT_EXCEEDED"),
    (173, "CANNOT_ALLOCATE_MEMORY"), (243, "NOT_ENOUGH_SPACE"), (201, "QUOTA_EXCEEDED"),
])
def test_overload_is_transient(code: int, name: str) -> None:
    err = transient(server_error(code, name, "Too many parts (300) in all partitions in total"))
    assert err.error_class == name.lower()


@pytest.mark.parametrize(("code", "name"), [
    (236, "ABORTED"), (394, "QUERY_WAS_CANCELLED"), (218, "TABLE_IS_DROPPED"), (210, "NETWORK_ERROR"),
    (3, "UNEXPECTED_END_OF_FILE"), (33, "CANNOT_READ_ALL_DATA"),
])
def test_server_restarting_or_broken_request_is_transient(code: int, name: str) -> None:
    transient(server_error(code, name, "Server shutdown is called"))


@pytest.mark.parametrize(("code", "name"), [
    (242, "TABLE_IS_READ_ONLY"), (999, "KEEPER_EXCEPTION"), (319, "UNKNOWN_STATUS_OF_INSERT"),
    (285, "TOO_FEW_LIVE_REPLICAS"),
])
def test_replication_trouble_is_transient(code: int, name: str) -> None:
    transient(server_error(code, name))


@pytest.mark.parametrize(("code", "name"), [
    (516, "AUTHENTICATION_FAILED"), (497, "ACCESS_DENIED"), (164, "READONLY"),
    (60, "UNKNOWN_TABLE"), (81, "UNKNOWN_DATABASE"),
])
def test_not_the_datas_fault_is_never_dead_lettered(code: int, name: str) -> None:
    # Every row would fail the same way: retried, then the pipeline stops with this message.
    transient(server_error(code, name))


def test_client_misuse_is_transient() -> None:
    assert transient(cc.ProgrammingError("Setting max_threads is readonly")).error_class == "client_error"


# --------------------------------------------------------------------------- permanent


@pytest.mark.parametrize(("code", "name"), [
    (6, "CANNOT_PARSE_TEXT"), (27, "CANNOT_PARSE_INPUT_ASSERTION_FAILED"), (38, "CANNOT_PARSE_DATE"),
    (53, "TYPE_MISMATCH"), (70, "CANNOT_CONVERT_TYPE"), (117, "INCORRECT_DATA"), (72, "CANNOT_PARSE_NUMBER"),
])
def test_type_and_parse_errors_are_permanent(code: int, name: str) -> None:
    assert permanent(server_error(code, name)).error_class == name.lower()


@pytest.mark.parametrize(("code", "name"), [
    (16, "NO_SUCH_COLUMN_IN_TABLE"), (47, "UNKNOWN_IDENTIFIER"), (8, "THERE_IS_NO_COLUMN"),
    (10, "NOT_FOUND_COLUMN_IN_BLOCK"),
])
def test_unknown_column_is_permanent(code: int, name: str) -> None:
    permanent(server_error(code, name))


@pytest.mark.parametrize(("code", "name"), [
    (321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE"), (69, "ARGUMENT_OUT_OF_BOUND"), (407, "DECIMAL_OVERFLOW"),
    (469, "VIOLATED_CONSTRAINT"), (349, "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN"),
])
def test_out_of_range_and_constraints_are_permanent(code: int, name: str) -> None:
    assert permanent(server_error(code, name)).error_class == name.lower()


def test_unknown_code_is_permanent() -> None:
    err = permanent(cc.DatabaseError("Code: 48. DB::Exception: Not implemented. (NOT_IMPLEMENTED)", code=48))
    assert err.error_class == "not_implemented"
    err = permanent(cc.DatabaseError("Code: 12345. DB::Exception: brand new error", code=12345))
    assert err.error_class == "code_12345"


@pytest.mark.parametrize("exc", [
    cc.DataError("Unable to create native array for column `k`: error"),
    ValueError("invalid literal for int() with base 10: 'x'"),
    TypeError("int() argument must be a string, a bytes-like object or a real number, not 'NoneType'"),
    OverflowError("int too big to convert"),
    struct.error("ushort format requires 0 <= number <= 65535"),
])
def test_client_side_encoding_errors_are_permanent(exc: BaseException) -> None:
    assert permanent(exc).error_class == "client_data_error"


# --------------------------------------------------------------------------- old servers, messages


def test_code_is_read_from_the_text_of_old_servers() -> None:
    # ClickHouse 18.16 sends no X-ClickHouse-Exception-Code header: the code is only in the body.
    text = ("HTTP driver received HTTP status 500, server response: Code: 16, e.displayText() = "
            "DB::Exception: No such column nope in table t, e.what() = DB::Exception "
            "(for url http://127.0.0.1:18123)")
    exc = cc.DatabaseError(text)
    assert error_code(exc) == 16
    err = permanent(exc)
    assert err.error_class == "no_such_column_in_table"
    assert str(err).startswith("Code: 16") and "for url" not in str(err)
    exc = cc.DatabaseError("HTTP driver received HTTP status 500, server response: Code: 252, "
                           "e.displayText() = DB::Exception: Too many parts (300)")
    assert transient(exc).error_class == "too_many_parts"


def test_messages_are_short_and_clean() -> None:
    err = classify(server_error(469, "VIOLATED_CONSTRAINT", "Constraint `pos` for table t is violated "
                                "at row 1. Expression: (v >= 0)" + "x" * 2000 + "\nstack trace line"))
    text = str(err)
    assert text.startswith("Code: 469") and "(version" not in text and "for url" not in text
    assert "stack trace" not in text and len(text) <= 500


def test_tables_are_disjoint() -> None:
    assert not set(TRANSIENT_CODES) & set(PERMANENT_CODES)
    assert all(name == name.upper() for name in {**TRANSIENT_CODES, **PERMANENT_CODES}.values())

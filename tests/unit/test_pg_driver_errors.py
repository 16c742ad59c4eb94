"""The PostgreSQL error classification table (ingest/drivers/postgres.py), one test per class.

Exceptions are the real psycopg classes, looked up by SQLSTATE
(``psycopg.errors.lookup``), plus client-side errors raised without a SQLSTATE.
"""

from __future__ import annotations

import errno
import socket

import psycopg
import psycopg.errors
import pytest

from ingest.drivers.postgres import (
    PERMANENT_CLASSES,
    PERMANENT_CODES,
    TRANSIENT_CODES,
    classify,
    is_row_error,
)
from ingest.errors import PermanentError, TransientError, UnclassifiedError


def server_error(sqlstate: str, message: str = "server said no") -> psycopg.Error:
    cls = psycopg.errors.lookup(sqlstate)
    exc = cls(message)
    assert exc.sqlstate == sqlstate, f"psycopg class {cls.__name__} carries {exc.sqlstate}"
    return exc


# --------------------------------------------------------------------------- transient

TRANSIENT_SQLSTATES = {
    # class 08: connection exception
    "08000": "ConnectionException",
    "08001": "SqlclientUnableToEstablishSqlconnection",
    "08003": "ConnectionDoesNotExist",
    "08004": "SqlserverRejectedEstablishmentOfSqlconnection",
    "08006": "ConnectionFailure",
    "08P01": "ProtocolViolation",
    # serialization failure, deadlock
    "40001": "SerializationFailure",
    "40P01": "DeadlockDetected",
    # class 53: insufficient resources (too many connections, disk full, out of memory)
    "53300": "TooManyConnections",
    "53100": "DiskFull",
    "53200": "OutOfMemory",
    # class 57: operator intervention
    "57P01": "AdminShutdown",
    "57P02": "CrashShutdown",
    "57P03": "CannotConnectNow",
    "57014": "QueryCanceled",  # statement_timeout
    # lock timeout, system I/O error, internal error
    "55P03": "LockNotAvailable",
    "58030": "IoError",
    "XX000": "InternalError_",
    # finding 8 of issue 15: outages that used to dead-letter good rows
    "25006": "ReadOnlySqlTransaction",  # a failover: the server is a read-only standby for a while
    "42501": "InsufficientPrivilege",  # permission denied (a revoked INSERT/UPDATE)
    # the schema is not what the config says: no record can fix that
    "42P01": "UndefinedTable",
    "42703": "UndefinedColumn",
    "42804": "DatatypeMismatch",
    "3D000": "InvalidCatalogName",
    "3F000": "InvalidSchemaName",
    "28P01": "InvalidPassword",
    "0A000": "FeatureNotSupported",
    "54011": "TooManyColumns",
}


@pytest.mark.parametrize("sqlstate", sorted(TRANSIENT_SQLSTATES))
def test_transient_sqlstates(sqlstate: str) -> None:
    exc = server_error(sqlstate, "terminating connection due to administrator command")
    assert type(exc).__name__ == TRANSIENT_SQLSTATES[sqlstate]
    out = classify(exc)
    assert isinstance(out, TransientError), f"{sqlstate} must be transient, got {out!r}"
    assert out.sqlstate == sqlstate
    assert out.error_class == type(exc).__name__
    assert "administrator command" in str(out)
    assert not is_row_error(sqlstate, "terminating connection due to administrator command")


@pytest.mark.parametrize("sqlstate", ["08006", "40001", "40P01", "53300", "57P01", "57014"])
def test_transient_required_by_the_issue(sqlstate: str) -> None:
    """The codes the issue names explicitly (connection, serialization, deadlock, too many
    connections, admin shutdown, statement timeout)."""
    assert isinstance(classify(server_error(sqlstate)), TransientError)


def test_row_level_security_violation_is_the_rows_own() -> None:
    out = classify(server_error("42501", 'new row violates row-level security policy for table "orders"'))
    assert isinstance(out, PermanentError) and out.sqlstate == "42501"
    assert out.error_class == "row_level_security_violation"
    denied = classify(server_error("42501", "permission denied for table orders"))
    assert isinstance(denied, TransientError) and "permission denied" in str(denied)


def test_error_without_sqlstate_on_a_healthy_connection_is_unclassified() -> None:
    exc = psycopg.OperationalError("sending query and params failed: number of parameters must be between 0 and 65535")
    out = classify(exc, healthy=True)
    assert isinstance(out, UnclassifiedError) and not isinstance(out, (TransientError, PermanentError))
    assert "65535" in str(out)
    assert isinstance(classify(exc, healthy=False), TransientError)


def test_operational_error_without_sqlstate_is_a_connection_error() -> None:
    exc = psycopg.OperationalError("server closed the connection unexpectedly\n\tThis probably means ...")
    assert exc.sqlstate is None
    out = classify(exc)
    assert isinstance(out, TransientError)
    assert out.sqlstate is None
    assert out.error_class == "connection"
    assert "server closed the connection unexpectedly" in str(out)
    assert "\n" not in str(out)  # first line only


def test_interface_error_without_sqlstate_is_transient() -> None:
    out = classify(psycopg.InterfaceError("the connection is closed"))
    assert isinstance(out, TransientError)
    assert out.error_class == "connection"


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
        TimeoutError("timed out"),
        socket.timeout("timed out"),
        OSError(errno.EHOSTUNREACH, "No route to host"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_os_level_errors_are_transient(exc: BaseException) -> None:
    out = classify(exc)
    assert isinstance(out, TransientError)
    assert out.error_class == "connection"
    assert type(exc).__name__ in str(out)


def test_real_connection_refused_is_transient_and_hides_the_dsn() -> None:
    """A real failed connect (nothing listens on port 1) with a password in the DSN."""
    dsn = "postgresql://ingest_user:S3cretPassw0rd@127.0.0.1:1/somedb?application_name=x"
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect(dsn, connect_timeout=2)
    out = classify(info.value)
    assert isinstance(out, TransientError)
    assert out.error_class == "connection"
    text = str(out)
    assert "S3cretPassw0rd" not in text
    assert "ingest_user" not in text
    assert dsn not in text
    assert "postgresql://" not in text


def test_row_error_table_membership() -> None:
    assert {"22", "23", "P0"} <= PERMANENT_CLASSES
    assert not {"08", "25", "28", "40", "42", "53", "55", "57", "58", "XX"} & PERMANENT_CLASSES
    assert PERMANENT_CODES == {"40002"} and TRANSIENT_CODES == {"54011"}
    assert is_row_error("23505") and is_row_error("22001") and is_row_error("54000")
    assert not is_row_error("40001") and not is_row_error("54011") and not is_row_error("42501", "permission denied")


# --------------------------------------------------------------------------- permanent

PERMANENT_SQLSTATES = {
    # sqlstate: (psycopg class, error_class recorded in the DLQ)
    "22001": ("StringDataRightTruncation", "data_exception"),  # value too long for varchar(n)
    "22P02": ("InvalidTextRepresentation", "data_exception"),
    "22003": ("NumericValueOutOfRange", "data_exception"),
    "22021": ("CharacterNotInRepertoire", "data_exception"),
    "23502": ("NotNullViolation", "integrity_constraint_violation"),
    "23503": ("ForeignKeyViolation", "integrity_constraint_violation"),
    "23505": ("UniqueViolation", "integrity_constraint_violation"),
    "23514": ("CheckViolation", "integrity_constraint_violation"),
    "23P01": ("ExclusionViolation", "integrity_constraint_violation"),
    "40002": ("TransactionIntegrityConstraintViolation", "database_error"),  # a deferred constraint at commit
    "54000": ("ProgramLimitExceeded", "program_limit_exceeded"),  # e.g. an index row too large
    "P0001": ("RaiseException", "raised_by_trigger"),
    "P0004": ("AssertFailure", "raised_by_trigger"),
    "44000": ("WithCheckOptionViolation", "database_error"),
}


@pytest.mark.parametrize("sqlstate", sorted(PERMANENT_SQLSTATES))
def test_permanent_sqlstates(sqlstate: str) -> None:
    cls_name, error_class = PERMANENT_SQLSTATES[sqlstate]
    exc = server_error(sqlstate, 'new row for relation "orders" violates something')
    assert type(exc).__name__ == cls_name
    out = classify(exc)
    assert isinstance(out, PermanentError), f"{sqlstate} must be permanent, got {out!r}"
    assert out.sqlstate == sqlstate
    assert out.error_class == error_class
    assert 'relation "orders"' in str(out)
    assert is_row_error(sqlstate)


@pytest.mark.parametrize("sqlstate", ["22001", "22P02", "23502", "23503", "23505", "23514"])
def test_permanent_required_by_the_issue(sqlstate: str) -> None:
    out = classify(server_error(sqlstate))
    assert isinstance(out, PermanentError)
    assert out.sqlstate == sqlstate


def test_a_sqlstate_no_row_can_cause_is_an_outage() -> None:
    exc = server_error("0A000")  # feature_not_supported
    out = classify(exc)
    assert isinstance(out, TransientError)
    assert out.sqlstate == "0A000"


def test_client_side_data_error_without_sqlstate_is_permanent() -> None:
    """psycopg raises DataError client-side when it cannot adapt a value (no SQLSTATE)."""
    exc = psycopg.DataError("int too large to convert")
    assert exc.sqlstate is None
    out = classify(exc)
    assert isinstance(out, PermanentError)
    assert out.sqlstate is None
    assert out.error_class == "client_data_error"


@pytest.mark.parametrize("exc", [ValueError("bad value"), TypeError("no adapter"), OverflowError("too big")],
                         ids=lambda e: type(e).__name__)
def test_non_driver_errors_are_permanent_client_errors(exc: BaseException) -> None:
    out = classify(exc)
    assert isinstance(out, PermanentError)
    assert out.error_class == "client_data_error"
    assert type(exc).__name__ in str(out)


def test_empty_message_still_says_something() -> None:
    out = classify(psycopg.OperationalError(""))
    assert isinstance(out, TransientError)
    assert str(out).strip()


def test_every_sqlstate_psycopg_knows_is_classified_consistently() -> None:
    """Walk psycopg's whole SQLSTATE table: transient iff the class/code is in the table."""
    classes = {
        obj.sqlstate: obj for obj in vars(psycopg.errors).values()
        if isinstance(obj, type) and issubclass(obj, psycopg.Error) and getattr(obj, "sqlstate", None)
    }
    seen = 0
    for sqlstate, cls in classes.items():
        assert psycopg.errors.lookup(sqlstate) is cls
        out = classify(cls("x"))
        expect_row = (sqlstate[:2] in PERMANENT_CLASSES or sqlstate in PERMANENT_CODES) and sqlstate not in TRANSIENT_CODES
        assert isinstance(out, PermanentError if expect_row else TransientError), sqlstate
        assert out.sqlstate == sqlstate
        if sqlstate[:2] == "22":
            assert isinstance(out, PermanentError), f"data exception {sqlstate} must be permanent"
        seen += 1
    assert seen > 200

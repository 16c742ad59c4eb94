"""Classify PostgreSQL errors as transient or permanent: the one table.

Transient (retry, never dead-letter):

- no SQLSTATE at all: the connection failed or broke (network, server down)
- class 08: connection exception
- 40001 serialization_failure, 40P01 deadlock_detected
- class 53: insufficient resources (disk full, out of memory, too many connections)
- class 57P: operator intervention (admin shutdown, crash shutdown, cannot connect now)
- 57014 query_canceled (statement_timeout: the database was too slow, not the data wrong)
- 55P03 lock_not_available
- class 58: system error (I/O error)
- XX000 internal_error is treated as transient too: retrying is the safe choice

Permanent (split the batch, dead-letter the rows that fail alone):

- class 22: data exception (value too long, invalid text representation,
  numeric out of range, untranslatable character, ...)
- class 23: integrity constraint violation (not null, foreign key, unique,
  check, exclusion)
- class 42: syntax error or access rule violation (undefined column, ...)
  -- a config/schema problem that would fail every row: the DLQ guard stops
  the pipeline before the topic is emptied into the DLQ.
- anything else with a SQLSTATE.
"""

from __future__ import annotations

import psycopg

from ingest.errors import PermanentError, TransientError

TRANSIENT_CLASSES: frozenset[str] = frozenset({"08", "53", "58"})
TRANSIENT_CODES: frozenset[str] = frozenset(
    {"40001", "40P01", "57014", "57P01", "57P02", "57P03", "57P04", "57P05", "55P03", "XX000"}
)

#: Human names for the error class recorded in the DLQ, by SQLSTATE class.
_CLASS_NAMES: dict[str, str] = {
    "22": "data_exception",
    "23": "integrity_constraint_violation",
    "42": "syntax_error_or_access_rule_violation",
}


def is_transient_sqlstate(sqlstate: str | None) -> bool:
    """True when an error with this SQLSTATE should be retried."""
    if sqlstate is None:
        return True
    return sqlstate[:2] in TRANSIENT_CLASSES or sqlstate in TRANSIENT_CODES


def classify(exc: BaseException) -> TransientError | PermanentError:
    """Translate a driver error into our tree. The message never contains the DSN.

    ``psycopg`` diagnostics carry the server's message, which names columns and
    constraints but not credentials.
    """
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.Error):
        diag_msg = getattr(getattr(exc, "diag", None), "message_primary", None)
        message = diag_msg or _first_line(str(exc))
        if sqlstate is None:
            if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
                return TransientError(f"connection: {message}", error_class="connection")
            # Raised client-side while adapting a value (e.g. a number too big for its type).
            return PermanentError(message, error_class="client_data_error")
        if is_transient_sqlstate(sqlstate):
            return TransientError(message, sqlstate=sqlstate, error_class=type(exc).__name__)
        detail = getattr(getattr(exc, "diag", None), "message_detail", None)
        if detail:
            message = f"{message} ({detail})"
        return PermanentError(message, sqlstate=sqlstate, error_class=_CLASS_NAMES.get(sqlstate[:2], "database_error"))
    if isinstance(exc, (OSError, TimeoutError)):
        return TransientError(f"{type(exc).__name__}: {_first_line(str(exc))}", error_class="connection")
    return PermanentError(f"{type(exc).__name__}: {_first_line(str(exc))}", error_class="client_error")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"

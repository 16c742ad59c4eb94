"""Classify ClickHouse errors as transient or permanent: the one table.

ClickHouse reports a numeric error code (``Code: 241. DB::Exception: ...
(MEMORY_LIMIT_EXCEEDED)``); clickhouse-connect puts it in ``exc.code`` when
the server sends the ``X-ClickHouse-Exception-Code`` header (servers since
about 2020) and in the message otherwise, where :func:`error_code` finds it.

Transient (retry with backoff, never dead-letter; when retries run out the
pipeline stops without committing):

- no code, from the transport: connection refused or reset, DNS, TLS,
  timeouts (clickhouse-connect ``OperationalError``, ``OSError``,
  ``TimeoutError``, urllib3 errors) -- the server is down or restarting;
- the server is overloaded or restarting: TOO_MANY_PARTS, TOO_MANY_SIMULTANEOUS_QUERIES,
  MEMORY_LIMIT_EXCEEDED / CANNOT_ALLOCATE_MEMORY (on insert these are load, not data),
  TIMEOUT_EXCEEDED, TOO_SLOW, SOCKET_TIMEOUT, NETWORK_ERROR, NO_FREE_CONNECTION,
  ABORTED / QUERY_WAS_CANCELLED / TABLE_IS_DROPPED (shutdown in progress), NOT_ENOUGH_SPACE,
  QUOTA_EXCEEDED, CANNOT_SCHEDULE_TASK;
- replication: TABLE_IS_READ_ONLY, NO_ZOOKEEPER, KEEPER_EXCEPTION, TOO_FEW_LIVE_REPLICAS,
  UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE, UNKNOWN_STATUS_OF_INSERT, ALL_REPLICAS_LOST,
  ALL_CONNECTION_TRIES_FAILED, NO_REMOTE_SHARD_AVAILABLE;
- a truncated request body (UNEXPECTED_END_OF_FILE, ATTEMPT_TO_READ_AFTER_EOF,
  CANNOT_READ_ALL_DATA, CANNOT_READ_FROM_ISTREAM): the connection broke mid-insert;
- not the data's fault, so never a reason to dead-letter: AUTHENTICATION_FAILED,
  WRONG_PASSWORD, UNKNOWN_USER, ACCESS_DENIED, READONLY, UNKNOWN_DATABASE,
  UNKNOWN_TABLE (``ingest migrate`` not run yet) -- retried, then the pipeline
  stops with the server's message;
- POCO_EXCEPTION, STD_EXCEPTION, UNKNOWN_EXCEPTION: retrying is the safe choice
  (as for PostgreSQL's XX000).

Permanent (split the batch, dead-letter the rows that fail alone): every
other code, notably type and parse errors (CANNOT_PARSE_*, TYPE_MISMATCH,
CANNOT_CONVERT_TYPE, INCORRECT_DATA), unknown columns (NO_SUCH_COLUMN_IN_TABLE,
THERE_IS_NO_COLUMN, NOT_FOUND_COLUMN_IN_BLOCK, UNKNOWN_IDENTIFIER), values out of
range (VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE, ARGUMENT_OUT_OF_BOUND, DECIMAL_OVERFLOW),
CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN, VIOLATED_CONSTRAINT, and LOGICAL_ERROR
(an engine bug a particular row can trigger: isolating it beats stalling).
An unknown column fails every row: the DLQ guard stops the pipeline then.
Client-side serialisation errors (clickhouse-connect ``DataError`` without a
code, ``ValueError``/``TypeError``/``OverflowError``/``struct.error``: a value
the Native encoder cannot write) are permanent with class ``client_data_error``.
"""

from __future__ import annotations

import re
import struct

from ingest.errors import PermanentError, TransientError

#: Codes retried with backoff, by number (names as in ClickHouse's ErrorCodes.cpp).
TRANSIENT_CODES: dict[int, str] = {
    3: "UNEXPECTED_END_OF_FILE",
    23: "CANNOT_READ_FROM_ISTREAM",
    24: "CANNOT_WRITE_TO_OSTREAM",
    32: "ATTEMPT_TO_READ_AFTER_EOF",
    33: "CANNOT_READ_ALL_DATA",
    60: "UNKNOWN_TABLE",
    81: "UNKNOWN_DATABASE",
    159: "TIMEOUT_EXCEEDED",
    160: "TOO_SLOW",
    164: "READONLY",
    173: "CANNOT_ALLOCATE_MEMORY",
    192: "UNKNOWN_USER",
    193: "WRONG_PASSWORD",
    198: "DNS_ERROR",
    201: "QUOTA_EXCEEDED",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES",
    203: "NO_FREE_CONNECTION",
    209: "SOCKET_TIMEOUT",
    210: "NETWORK_ERROR",
    218: "TABLE_IS_DROPPED",
    225: "NO_ZOOKEEPER",
    236: "ABORTED",
    241: "MEMORY_LIMIT_EXCEEDED",
    242: "TABLE_IS_READ_ONLY",
    243: "NOT_ENOUGH_SPACE",
    252: "TOO_MANY_PARTS",
    279: "ALL_CONNECTION_TRIES_FAILED",
    285: "TOO_FEW_LIVE_REPLICAS",
    286: "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE",
    319: "UNKNOWN_STATUS_OF_INSERT",
    394: "QUERY_WAS_CANCELLED",
    415: "ALL_REPLICAS_LOST",
    425: "SYSTEM_ERROR",
    439: "CANNOT_SCHEDULE_TASK",
    497: "ACCESS_DENIED",
    516: "AUTHENTICATION_FAILED",
    519: "NO_REMOTE_SHARD_AVAILABLE",
    735: "QUERY_WAS_CANCELLED_BY_CLIENT",
    999: "KEEPER_EXCEPTION",
    1000: "POCO_EXCEPTION",
    1001: "STD_EXCEPTION",
    1002: "UNKNOWN_EXCEPTION",
}

#: Permanent codes with a name (for the DLQ's error_class); any code not in
#: TRANSIENT_CODES is permanent whether listed here or not.
PERMANENT_CODES: dict[int, str] = {
    6: "CANNOT_PARSE_TEXT",
    8: "THERE_IS_NO_COLUMN",
    10: "NOT_FOUND_COLUMN_IN_BLOCK",
    16: "NO_SUCH_COLUMN_IN_TABLE",
    25: "CANNOT_PARSE_ESCAPE_SEQUENCE",
    26: "CANNOT_PARSE_QUOTED_STRING",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED",
    36: "BAD_ARGUMENTS",
    38: "CANNOT_PARSE_DATE",
    41: "CANNOT_PARSE_DATETIME",
    43: "ILLEGAL_TYPE_OF_ARGUMENT",
    44: "ILLEGAL_COLUMN",
    47: "UNKNOWN_IDENTIFIER",
    49: "LOGICAL_ERROR",
    53: "TYPE_MISMATCH",
    62: "SYNTAX_ERROR",
    69: "ARGUMENT_OUT_OF_BOUND",
    70: "CANNOT_CONVERT_TYPE",
    72: "CANNOT_PARSE_NUMBER",
    115: "UNKNOWN_SETTING",
    117: "INCORRECT_DATA",
    131: "TOO_LARGE_STRING_SIZE",
    190: "SIZES_OF_ARRAYS_DONT_MATCH",
    321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
    349: "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN",
    395: "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO",
    407: "DECIMAL_OVERFLOW",
    469: "VIOLATED_CONSTRAINT",
}

_CODE_RE = re.compile(r"\bCode:\s*(\d+)")
_NAME_RE = re.compile(r"\(([A-Z][A-Z0-9_]+)\)")
_URL_TAIL_RE = re.compile(r"\s*\(for url [^)]*\)")
_VERSION_TAIL_RE = re.compile(r"\s*\(version [^)]*(\([^)]*\))?[^)]*\)\s*$")
_MAX_MESSAGE = 500


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code of ``exc``: ``exc.code``, else ``Code: N`` in its message."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    match = _CODE_RE.search(str(exc))
    return int(match.group(1)) if match else None


def error_name(code: int, exc: BaseException | None = None) -> str:
    """Symbolic name of ``code``: from the exception, our tables, or ``CODE_<n>``."""
    name = getattr(exc, "name", None) if exc is not None else None
    if isinstance(name, str) and name:
        return name
    known = TRANSIENT_CODES.get(code) or PERMANENT_CODES.get(code)
    if known:
        return known
    if exc is not None:
        found = _NAME_RE.findall(str(exc))
        if found:
            return found[-1]
    return f"CODE_{code}"


def is_transient_code(code: int) -> bool:
    return code in TRANSIENT_CODES


def _message(exc: BaseException) -> str:
    """The server's message without the URL, version trailer or stack: never credentials
    (clickhouse-connect authenticates with headers; URLs carry no password)."""
    text = str(exc).strip()
    start = text.find("Code:")
    if start > 0:
        text = text[start:]
    text = _URL_TAIL_RE.sub("", text)
    text = text.splitlines()[0] if text else "(no message)"
    text = _VERSION_TAIL_RE.sub("", text)
    return text[:_MAX_MESSAGE]


def _is_transport_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    module = type(exc).__module__ or ""
    return module.startswith(("urllib3", "http.client", "ssl"))


def classify(exc: BaseException) -> TransientError | PermanentError:
    """Translate a clickhouse-connect / chDB / transport error into our tree."""
    code = error_code(exc)
    if code is not None:
        name = error_name(code, exc)
        message = _message(exc)
        if is_transient_code(code):
            return TransientError(message, error_class=name.lower())
        return PermanentError(message, error_class=name.lower())

    try:
        from clickhouse_connect.driver import exceptions as cc
    except ImportError:  # pragma: no cover - clickhouse-connect is a dependency
        cc = None  # type: ignore[assignment]
    message = _message(exc)
    if cc is not None and isinstance(exc, cc.Error):
        if isinstance(exc, cc.DataError):
            # Raised while encoding the Native block: a value the column type cannot hold.
            return PermanentError(f"cannot encode value: {message}", error_class="client_data_error")
        if isinstance(exc, cc.ProgrammingError):
            # Client-side misuse (e.g. a readonly setting in `settings`): the same for every row,
            # so retrying it stops the pipeline with this message instead of dead-lettering.
            return TransientError(f"client error: {message}", error_class="client_error")
        # OperationalError (transport failed, server unreachable), or a DatabaseError without a
        # code (e.g. an HTTP 502/503 from a proxy): the service, not the data.
        return TransientError(f"connection: {message}", error_class="connection")
    if _is_transport_error(exc):
        return TransientError(f"connection: {type(exc).__name__}: {message}", error_class="connection")
    if isinstance(exc, (ValueError, TypeError, OverflowError, struct.error, UnicodeError)):
        return PermanentError(f"cannot encode value: {type(exc).__name__}: {message}",
                              error_class="client_data_error")
    return PermanentError(f"{type(exc).__name__}: {message}", error_class="client_error")

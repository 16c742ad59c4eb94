"""Structured logging: one event per line, JSON when stderr is not a TTY.

Modules log with the standard library (``log.info("event", extra={...})``);
this module only installs the formatter. Fields passed in ``extra`` (pipeline,
partition, offset, lane, error, ...) become JSON keys. Adapters never put DSNs
or credentials into log records, and the handler scrubs every record of the
configured secrets anyway (:class:`ingest.redact.RedactingFilter`): a driver's
message may quote a piece of a malformed DSN.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import orjson

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime", "taskName"}


def _process_index() -> int | None:
    """``INGEST_PROCESS_INDEX`` of a child of ``ingest run --processes P`` (see ingest.supervisor)."""
    try:
        return int(os.environ["INGEST_PROCESS_INDEX"])
    except (KeyError, ValueError):
        return None


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        #: worker process index under ``--processes`` (one shared stderr): a ``"process"`` key
        self._process = _process_index()

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **_fields(record),
        }
        if self._process is not None:
            event["process"] = self._process
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            event["exception"] = record.exc_text
        return orjson.dumps(event, default=str).decode()


class ConsoleFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        index = _process_index()
        self._tag = "" if index is None else f" [p{index}]"

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + self._tag
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{stamp} {record.levelname:<7} {record.getMessage()}" + (f"  {extra}" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            line += "\n" + record.exc_text
        return line


def setup_logging(level: str = "info", *, json_output: bool | None = None) -> None:
    """Install the root handler on stderr. ``json_output=None`` picks JSON unless stderr is a TTY."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    from ingest.redact import RedactingFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else ConsoleFormatter())
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # librdkafka chatter and pool internals only at warning and above.
    logging.getLogger("psycopg.pool").setLevel(max(logging.WARNING, root.level))
    # The Schema Registry client's HTTP library logs every request at info.
    for name in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))

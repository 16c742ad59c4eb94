"""One exception root, classified by what the caller can do about it::

    IngestError
    ├── TransientError        retry with backoff; when retries run out, stop without committing
    ├── PermanentError        the data's fault: split the batch, dead-letter the rows that fail alone
    ├── UnclassifiedError     neither: stop without committing, at once (no retry, no bisection)
    ├── InvalidRecord         a record that cannot be decoded, transformed or mapped: DLQ (stage decode /
    │                         transform / map)
    ├── ConfigError           bad configuration (CLI exit code 2)
    ├── ServiceUnreachable    a broker or database in the config does not answer (exit code 3)
    ├── MigrationError        the database refused migrate's DDL (exit code 1)
    └── FatalPipelineError    the pipeline must stop (exit code 1)

- :class:`TransientError`: the operation may succeed if retried unchanged
  (connection lost, server restarting, deadlock, a read-only failover, a
  revoked privilege). Retried with backoff; never a reason to dead-letter data.
- :class:`PermanentError`: retrying the same input fails the same way, and a
  row's values can be the cause (data or constraint error). A batch failing this
  way is split to find the rows that fail alone; those go to the DLQ.
- :class:`UnclassifiedError`: a failure that is neither: retrying the same call
  cannot help and no row is to blame (e.g. the driver refusing a statement on a
  healthy connection). The pipeline stops at once, naming it.
- :class:`InvalidRecord`: a record that cannot be decoded or mapped. Never
  reaches the database; goes to the DLQ with ``stage`` decode or map.
- :class:`ConfigError`: bad configuration (CLI exit code 2).
- :class:`ServiceUnreachable`: a broker or database named in the config does
  not answer (CLI exit code 3).
- :class:`FatalPipelineError`: the pipeline must stop (retries exhausted,
  DLQ guard tripped, an unclassified failure); nothing past the last handled
  record is committed.

Driver errors are translated into this tree at the adapter boundary, in one
place per backend (``ingest.drivers.postgres.translate``,
``ingest.sinks.clickhouse.errors.classify``), with ``raise ... from exc``.

Errors carry structured fields (``sqlstate``, ``partition``, ``offset``) and
their messages never contain secrets: adapters build messages from the
driver's diagnostic text, never from DSNs.
"""

from __future__ import annotations


class IngestError(Exception):
    """Root of every error raised by ingest."""


class TransientError(IngestError):
    """Retryable failure of an external service."""

    def __init__(self, message: str, *, sqlstate: str | None = None, error_class: str = "transient") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.error_class = error_class


class PermanentError(IngestError):
    """Failure caused by the data itself; the same input fails the same way."""

    def __init__(self, message: str, *, sqlstate: str | None = None, error_class: str = "data_error") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.error_class = error_class


class UnclassifiedError(IngestError):
    """Neither transient nor the data's fault: the pipeline stops without committing, naming the error."""


class InvalidRecord(IngestError):
    """A record that cannot be decoded (``stage='decode'``), transformed (``stage='transform'``, class
    ``transform_error``) or mapped (``stage='map'``)."""

    def __init__(self, stage: str, error_class: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.error_class = error_class
        self.message = message


class NoChange(Exception):
    """Raised by a change mapper for a record that is handled without writing anything: a truncate the
    pipeline ignores, a tombstone whose delete event (carrying the version) came before it. The
    record counts as done (skipped), never as a dead letter."""


class Filtered(NoChange):
    """Raised for a record a ``filter`` transform drops (ingest.core.transforms): done without a row,
    its offset committed like any handled record, counted per step (``step``: the filter's label)."""

    def __init__(self, step: str) -> None:
        super().__init__(f"filtered by {step}")
        self.step = step


class ConfigError(IngestError):
    """Invalid configuration. The message names the file and the field path."""


class ServiceUnreachable(IngestError):
    """A broker or database named in the config could not be reached."""

    def __init__(self, service: str, message: str) -> None:
        super().__init__(f"{service}: {message}")
        self.service = service


class MigrationError(IngestError):
    """The database refused a migration statement (exit 1, the message names the pipeline and object)."""


class FatalPipelineError(IngestError):
    """The pipeline cannot continue; the process exits non-zero.

    ``error_class`` names why, for ``GET /status`` and the metrics: the class of the error that ran
    out of retries (e.g. ``transient``, ``schema_registry_unavailable``), ``dlq_guard``,
    ``drain_timeout``, ``unclassified``, ``aborted``, or ``fatal`` when nothing more is known.
    """

    def __init__(self, message: str, *, error_class: str = "fatal") -> None:
        super().__init__(message)
        self.error_class = error_class

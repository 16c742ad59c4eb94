"""Building blocks of the settings models: frozen models, identifier and DSN checks, columns, the sink base.

Every model forbids unknown keys, is frozen, and never shows an input value in
a validation error (it may be a secret).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from ingest.core.collapse import CollapseRule

SOURCE_RE = re.compile(
    r"^((@key\.)?\$(\.[^.\[\]]+|\[\d+\])*|@source(\.[^.\[\]]+)+"
    r"|@(key|topic|partition|offset|stream|timestamp|header\.[^\s]+))$")
SECRET_CLIENT_KEYS = ("password", "secret", "sasl.oauthbearer.config", "ssl.key.pem")


def check_dsn_syntax(dsn: SecretStr | None) -> SecretStr | None:
    """A PostgreSQL DSN libpq can parse; the error never quotes it (libpq's own message quotes the token
    it could not parse, which can be a piece of the password)."""
    if dsn is None:
        return None
    from psycopg import conninfo

    try:
        conninfo.conninfo_to_dict(dsn.get_secret_value())
    except Exception:  # noqa: BLE001 - psycopg.ProgrammingError carries libpq's text: never shown
        raise ValueError(
            "not a valid PostgreSQL connection string: use a URL (postgresql://user:password@host:port/db, "
            "with reserved characters of the password percent-encoded, e.g. % as %25, @ as %40, "
            "space as %20) or key=value pairs (password='quoted if it holds spaces or quotes')"
        ) from None
    return dsn


def check_identifier(name: str) -> str:
    """Names reach SQL only through identifier quoting; here we only forbid what can never work."""
    if not name or "\x00" in name or len(name.encode()) > 63:
        raise ValueError(f"invalid SQL identifier {name!r}: must be 1-63 bytes without NUL")
    return name


class Frozen(BaseModel):
    # hide_input_in_errors: a validation error's text never carries the value (it may be a secret).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class PgNetworkSettings(Frozen):
    """How a PostgreSQL connection notices a network that went silent (``sink.network``, ``dlq.network``).

    A statement whose connection dies without a reset (a NAT or firewall that dropped the flow, a
    peer that crashed with the socket half open) would wait for ever: ``statement_timeout`` is
    enforced by the server, which cannot answer. So every wait on the network is bounded on the
    client too:

    - ``client_timeout_ms``: no single wait for the server (a statement, a piece of a COPY, a
      commit, the pool's health check) lasts longer; past it the connection is closed without
      waiting on it and the error is transient (the batch is retried on a new connection).
      Default: the statement timeout + 5 s (so the server's own timeout fires first when the
      server is there), 65 s when the statement timeout is off; 0 turns the bound off.
    - ``connect_timeout_s``: libpq's ``connect_timeout``, per host of a multi-host DSN.
    - ``tcp_user_timeout_ms``: libpq's ``tcp_user_timeout``: the kernel gives up on data it sent
      that the peer did not acknowledge within this time (a dead peer while writing).
    - ``keepalives_idle_s`` / ``keepalives_interval_s`` / ``keepalives_count``: TCP keepalives on
      an idle connection (a dead peer while waiting): found dead after idle + interval × count.

    A parameter the DSN sets itself (e.g. ``?connect_timeout=3``) wins over these.
    """

    client_timeout_ms: int | None = Field(default=None, ge=0)
    connect_timeout_s: int = Field(default=10, ge=1)
    tcp_user_timeout_ms: int = Field(default=30_000, ge=0)
    keepalives_idle_s: int = Field(default=15, ge=1)
    keepalives_interval_s: int = Field(default=5, ge=1)
    keepalives_count: int = Field(default=3, ge=1)

    def client_timeout_s(self, statement_timeout_ms: int) -> float | None:
        """The client-side bound on one wait, in seconds (None: unbounded), for this statement timeout."""
        if self.client_timeout_ms is not None:
            return self.client_timeout_ms / 1000.0 if self.client_timeout_ms else None
        return (statement_timeout_ms + 5_000) / 1000.0 if statement_timeout_ms else 65.0

    def idle_in_transaction_ms(self, statement_timeout_ms: int) -> int:
        """The ``idle_in_transaction_session_timeout`` ingest sets on its sessions (0: off): the client-side
        bound. A connection that went silent in the middle of a transaction leaves its server session
        behind, holding the transaction's row locks while it waits for a client that is gone (the server
        notices a dead peer only by its own TCP keepalives, two hours by default); every retry of the
        batch on a new connection would then wait on those locks. Ingest never idles in a transaction
        longer than one wait on the server, so the server may end such a session after that long."""
        bound = self.client_timeout_s(statement_timeout_ms)
        return 0 if bound is None else int(bound * 1000)

    def libpq_params(self) -> dict[str, int]:
        """The libpq connection parameters these settings stand for."""
        return {
            "connect_timeout": self.connect_timeout_s,
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle_s,
            "keepalives_interval": self.keepalives_interval_s,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": self.tcp_user_timeout_ms,
        }


class ColumnSpec(Frozen):
    """One target column: its database type and where its value comes from.

    ``source`` is a JSON path into the record value (``$.a.b``, ``$.items[0]``)
    or Kafka metadata (``@key``, ``@topic``, ``@partition``, ``@offset``,
    ``@timestamp``, ``@header.NAME``), or with ``envelope: debezium`` a path into the change
    event's ``source`` block (``@source.lsn``). Default: ``$.<column name>`` (with an envelope:
    the row image).
    """

    type: str
    source: str | None = None
    required: bool = False
    default: Any = None

    @field_validator("source")
    @classmethod
    def _source_syntax(cls, value: str | None) -> str | None:
        if value is not None and not SOURCE_RE.match(value):
            raise ValueError(
                f"invalid source {value!r}: use a JSON path like '$.a.b' or one of "
                "@key @key.$.PATH (with key_format) @topic @partition @offset @timestamp @header.NAME "
                "@source.PATH (with envelope debezium)"
            )
        return value


class SinkSettingsBase(Frozen):
    """What every sink's settings have, and what the rest of ingest asks of them.

    A sink kind subclasses this (its own fields, ``kind: Literal["..."]``) and
    registers it in :mod:`ingest.sinks.registry`. The target table is a field
    here, read by the sink through the batch's destination, not baked into it.
    """

    #: The sink kind (a ``Literal`` in each subclass): its key in the sink registry.
    kind: str
    table: str
    columns: dict[str, ColumnSpec]
    #: Write budget of this database, shared by every pipeline of the process writing to it:
    #: at most this many batch writes at once, granted by priority with aging. None = no limit.
    #: When pipelines sharing a database disagree, the smallest value wins.
    max_concurrent_writes: int | None = Field(default=None, ge=1)

    @field_validator("table")
    @classmethod
    def _table_name(cls, value: str) -> str:
        return check_identifier(value)

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: dict[str, ColumnSpec]) -> dict[str, ColumnSpec]:
        if not value:
            raise ValueError("at least one column is required")
        for name in value:
            check_identifier(name)
        return value

    def column_source(self, name: str) -> str:
        return self.columns[name].source or f"$.{name}"

    def delete_filler(self) -> list[Any]:
        """The values of a delete row's columns that are not its key, version or hidden columns
        (:class:`~ingest.types.DeleteRow`): ``None`` here; a sink whose columns cannot hold NULL says more."""
        return [None] * len(self.columns)

    def check_deletes(self, deletes: Any) -> None:
        """Raise ValueError when this sink cannot write deletes as ``deletes``
        (:class:`~ingest.config.cdc.DeleteSettings`) say; called for pipelines with deletes."""

    def collapse_rule(self) -> CollapseRule:
        """How this sink collapses a batch's records of one row (:mod:`ingest.core.collapse`)."""
        raise NotImplementedError(f"sink kind {self.kind!r} must define collapse_rule()")

    def explode_refusal(self) -> str | None:
        """Why this sink's pipelines cannot have ``explode`` steps (child tables written with the
        parent), or None when they can. Default: a sink kind that does not say it can, cannot."""
        return f"sink kind {self.kind!r} writes no child tables"

    def check_explode(self, explode: Any) -> None:
        """Raise ValueError when this sink cannot write ``explode``'s child table as configured (beyond
        :meth:`explode_refusal`, which is about the parent); default: it can."""

    def child_table(self, table: str, columns: dict[str, ColumnSpec], key: list[str]) -> SinkSettingsBase:
        """The settings of an ``explode`` step's child table beside this sink's: the same database and
        connection settings; ``table``, ``columns`` (this kind's column specs, plus the hidden columns the
        kind adds) and ``key``. Raises ValueError for columns this kind refuses."""
        raise NotImplementedError(f"sink kind {self.kind!r} writes no child tables")

    @property
    def exactly_once(self) -> bool:
        """Offsets are stored with the rows (the sink's backend declares the capability)."""
        return False

    @property
    def tracks_sources(self) -> bool:
        """Rows remember which record they were last written from (replay's order guard reads it)."""
        return False

    @property
    def postgres_dsn(self) -> SecretStr | None:
        """The PostgreSQL database this sink writes, when it is one: the DLQ table's default home."""
        return None



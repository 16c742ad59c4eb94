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



"""A test-only third sink kind, ``sqlite``, registered with one line -- the proof that a sink kind is a
settings class, one module and one registry line (issue 16). SQLite is a real database (the standard
library's sqlite3, a file), so the command matrix runs against it for real.

Load it with ``INGEST_PLUGINS=sqlite_sink`` and ``tests/plugins`` on ``PYTHONPATH``. Columns use the
PostgreSQL dialect's names (the mapper's coercers); values SQLite cannot store natively (Decimal,
datetime, UUID) are stored as text.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

from pydantic import Field, model_validator

from ingest.config import PipelineSettings
from ingest.config.base import SinkSettingsBase
from ingest.core.collapse import CollapseRule
from ingest.errors import (
    ConfigError,
    PermanentError,
    ServiceUnreachable,
    TransientError,
)
from ingest.sinks import registry
from ingest.sinks.base import Capabilities

for _type in (Decimal, datetime, date, UUID):
    sqlite3.register_adapter(_type, str)


class SqliteSinkSettings(SinkSettingsBase):
    kind: Literal["sqlite"] = "sqlite"
    path: str
    conflict_key: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _keys(self) -> SqliteSinkSettings:
        missing = [k for k in self.conflict_key if k not in self.columns]
        if missing:
            raise ValueError(f"conflict_key {missing} not among columns")
        return self

    def collapse_rule(self) -> CollapseRule:
        names = list(self.columns)
        return CollapseRule(tuple(names.index(k) for k in self.conflict_key))


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class SqliteSink:
    def __init__(self, cfg: SqliteSinkSettings) -> None:
        self._cfg = cfg
        cols = list(cfg.columns)
        updates = ", ".join(f"{_q(c)} = excluded.{_q(c)}" for c in cols if c not in cfg.conflict_key)
        self._upsert = (f"INSERT INTO {_q(cfg.table)} ({', '.join(map(_q, cols))}) VALUES "
                        f"({', '.join('?' * len(cols))}) ON CONFLICT ({', '.join(map(_q, cfg.conflict_key))}) "
                        + (f"DO UPDATE SET {updates}" if updates else "DO NOTHING"))
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self._cfg.path, timeout=10)

    def write(self, rows: Sequence[tuple[Any, ...]], *, token: str | None = None, in_tx: Any = None) -> None:
        if in_tx is not None:
            raise TypeError("the sqlite sink declares no transactions for others to join")
        try:
            with self._lock, self._connect() as conn:
                conn.executemany(self._upsert, rows)
        except sqlite3.IntegrityError as exc:
            raise PermanentError(str(exc), error_class="integrity_constraint_violation") from exc
        except sqlite3.Error as exc:
            raise TransientError(str(exc), error_class="sqlite") from exc

    def warm_up(self) -> None:
        pass

    def check(self) -> None:
        try:
            with self._connect() as conn:
                conn.execute("SELECT 1")
        except sqlite3.Error as exc:
            raise ServiceUnreachable(f"sqlite {self._cfg.path}", str(exc)) from None

    def close(self) -> None:
        pass


class SqliteBackend:
    kind = "sqlite"
    capabilities = Capabilities()

    def build(self, pipeline: PipelineSettings, *, lanes: int) -> SqliteSink:
        return SqliteSink(pipeline.sink)  # type: ignore[arg-type]

    def migrate(self, pipeline: PipelineSettings) -> list[str]:
        cfg = pipeline.sink
        cols = ", ".join(f"{_q(n)} {'NOT NULL' if s.required or n in cfg.conflict_key else ''}"  # type: ignore[attr-defined]
                         for n, s in cfg.columns.items())
        with sqlite3.connect(cfg.path) as conn:  # type: ignore[attr-defined]
            conn.execute(f"CREATE TABLE IF NOT EXISTS {_q(cfg.table)} ({cols}, "
                         f"PRIMARY KEY ({', '.join(map(_q, cfg.conflict_key))}))")  # type: ignore[attr-defined]
        return [f"{pipeline.name}: sqlite table {cfg.table}"]

    def identity(self, settings: Any) -> str:
        return str(settings.path)

    def describe(self, settings: Any) -> str:
        return f"table {settings.table} in {settings.path}"

    def offset_store(self, pipeline: PipelineSettings) -> None:
        return None

    def exactly_once_writer(self, sink: Any, pipeline: PipelineSettings, dlq: Any) -> Any:
        raise ConfigError("the sqlite test sink has no exactly-once delivery")


registry.register("sqlite", settings=SqliteSinkSettings, backend=SqliteBackend())  # the one registry line

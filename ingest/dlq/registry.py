"""The DLQ registry: ``dlq.kind`` → how to build its writer (for ``run``) and its reader (for ``dlq`` and
``replay-dlq``). The only place DLQ kinds are told apart.

- ``postgres``: the ``ingest_dlq`` table (:mod:`ingest.dlq.postgres`, :mod:`ingest.dlq.store`);
- ``kafka``: a dead-letter topic (:mod:`ingest.dlq.kafka`, :mod:`ingest.dlq.kafka_reader`), with the
  PostgreSQL table for oversized records when ``dlq.oversized: postgres``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ingest.config import PipelineSettings, Settings
from ingest.dlq.base import DeadLetterQueue, DlqReader


def _table_dsn(p: PipelineSettings) -> str:
    dsn = p.dlq_dsn
    assert dsn is not None, "a pipeline writing a PostgreSQL DLQ table has a DSN (validated)"
    return dsn.get_secret_value()


def _postgres_writer(settings: Settings, p: PipelineSettings) -> DeadLetterQueue:
    from ingest.dlq.postgres import PostgresDlq

    return PostgresDlq(_table_dsn(p), p.dlq.db_schema, p.dlq.table, pool_size=max(2, p.lanes),
                       network=p.dlq.network)


def _postgres_reader(settings: Settings, p: PipelineSettings) -> DlqReader:
    from ingest.dlq.store import DlqStore

    return DlqStore(_table_dsn(p), p.dlq.db_schema, p.dlq.table, p.dlq.network)


def _kafka_writer(settings: Settings, p: PipelineSettings) -> DeadLetterQueue:
    from ingest.dlq.kafka import KafkaDlq

    table = _postgres_writer(settings, p) if p.dlq.uses_postgres_table else None
    return KafkaDlq(settings.kafka, p.dlq, oversized=table, stored_in=f"postgres:{p.dlq.db_schema}.{p.dlq.table}")


def _kafka_reader(settings: Settings, p: PipelineSettings) -> DlqReader:
    from ingest.dlq.kafka_reader import KafkaDlqReader
    from ingest.dlq.store import DlqStore

    table = DlqStore(_table_dsn(p), p.dlq.db_schema, p.dlq.table, p.dlq.network) if p.dlq.uses_postgres_table else None
    return KafkaDlqReader(settings.kafka, p.dlq, p.name, table=table)


@dataclass(frozen=True)
class _Kind:
    writer: Callable[[Settings, PipelineSettings], DeadLetterQueue]
    reader: Callable[[Settings, PipelineSettings], DlqReader]


_KINDS = {"postgres": _Kind(_postgres_writer, _postgres_reader), "kafka": _Kind(_kafka_writer, _kafka_reader)}


def build_writer(settings: Settings, p: PipelineSettings) -> DeadLetterQueue:
    """The DLQ ``ingest run`` writes poison records to."""
    return _KINDS[p.dlq.kind].writer(settings, p)


def build_reader(settings: Settings, p: PipelineSettings) -> DlqReader:
    """The DLQ ``ingest dlq`` and ``ingest replay-dlq`` read and resolve."""
    return _KINDS[p.dlq.kind].reader(settings, p)

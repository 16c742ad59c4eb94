"""The PostgreSQL :class:`~ingest.sinks.base.SinkBackend`: what the rest of ingest asks of this sink kind."""

from __future__ import annotations

from ingest.config import PipelineSettings
from ingest.dlq.base import DeadLetterQueue
from ingest.dlq.postgres import PostgresDlq
from ingest.sinks.base import Capabilities, ExactlyOnceFn
from ingest.sinks.postgres.children import ChildTable
from ingest.sinks.postgres.exactly_once import ExactlyOnceWriter, StoredOffsets
from ingest.sinks.postgres.schema import migrate_postgres
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.sink import PostgresSink


class PostgresBackend:
    kind = "postgres"
    capabilities = Capabilities(transactions=True, exactly_once=True, row_sources=True, deletes=True, columnar=True)

    def build(self, pipeline: PipelineSettings, *, lanes: int) -> PostgresSink:
        cfg = self._settings(pipeline)
        children = [ChildTable(slot, cfg, explode) for slot, (_, explode) in enumerate(pipeline.explode_steps)]
        return PostgresSink(cfg, pool_size=lanes + 1, name=f"{pipeline.name}-sink",
                            deletes=pipeline.deletes if pipeline.has_deletes else None, children=children,
                            routed=pipeline.routes_tables)

    def migrate(self, pipeline: PipelineSettings) -> list[str]:
        return migrate_postgres(pipeline)

    def identity(self, settings: object) -> str:
        assert isinstance(settings, PostgresSinkSettings)
        return settings.dsn.get_secret_value()

    def describe(self, settings: object) -> str:
        assert isinstance(settings, PostgresSinkSettings)
        if "{" in settings.table:
            return f"tables {settings.db_schema}.{settings.table} (a template: one table per record's name)"
        return f"table {settings.db_schema}.{settings.table}"

    def offset_store(self, pipeline: PipelineSettings) -> StoredOffsets | None:
        cfg = self._settings(pipeline)
        if not cfg.exactly_once:
            return None
        return StoredOffsets(cfg.dsn.get_secret_value(), cfg.db_schema, pipeline.name, cfg.network,
                             cfg.statement_timeout_ms)

    def exactly_once_writer(self, sink: object, pipeline: PipelineSettings, dlq: DeadLetterQueue) -> ExactlyOnceFn:
        assert isinstance(sink, PostgresSink) and isinstance(dlq, PostgresDlq), "validated by the settings"
        return ExactlyOnceWriter(sink, pipeline, dlq)

    @staticmethod
    def _settings(pipeline: PipelineSettings) -> PostgresSinkSettings:
        assert isinstance(pipeline.sink, PostgresSinkSettings)
        return pipeline.sink


BACKEND = PostgresBackend()

"""The ClickHouse :class:`~ingest.sinks.base.SinkBackend`: what the rest of ingest asks of this sink kind."""

from __future__ import annotations

import functools

from ingest.config import PipelineSettings
from ingest.dlq.base import DeadLetterQueue
from ingest.errors import ConfigError
from ingest.sinks.base import Capabilities, ExactlyOnceFn
from ingest.sinks.clickhouse.children import ChildTable
from ingest.sinks.clickhouse.schema import create_table_sql, migrate_clickhouse
from ingest.sinks.clickhouse.settings import ClickHouseSinkSettings
from ingest.sinks.clickhouse.sink import ClickHouseSink, redact_url


class ClickHouseBackend:
    kind = "clickhouse"
    #: No transactions; retried inserts deduplicated by token; effectively-once through ReplacingMergeTree;
    #: columnar batches as Arrow inserts (ingest.runner.columnar).
    capabilities = Capabilities(insert_tokens=True, deletes=True, columnar=True)

    def build(self, pipeline: PipelineSettings, *, lanes: int) -> ClickHouseSink:
        cfg = self._settings(pipeline)
        children = [ChildTable(slot, cfg, explode) for slot, (_, explode) in enumerate(pipeline.explode_steps)]
        routed = functools.partial(create_table_sql, deletes=pipeline.has_deletes) if pipeline.routes_tables else None
        return ClickHouseSink(cfg, pipeline=pipeline.name, deletes=pipeline.has_deletes, children=children,
                              routed=routed)

    def migrate(self, pipeline: PipelineSettings) -> list[str]:
        return migrate_clickhouse(pipeline)

    def identity(self, settings: object) -> str:
        assert isinstance(settings, ClickHouseSinkSettings)
        return f"{settings.url}/{settings.database}"

    def describe(self, settings: object) -> str:
        assert isinstance(settings, ClickHouseSinkSettings)
        if settings.auto_columns:
            return (f"tables {settings.database}.{settings.table} (columns auto: each made from its records' "
                    f"schemas, ordered by their key) at {redact_url(settings.url)}")
        if "{" in settings.table:
            return (f"tables {settings.database}.{settings.table} (a template: one table per record's name) "
                    f"at {redact_url(settings.url)}")
        return f"table {settings.database}.{settings.table} at {redact_url(settings.url)}"

    def offset_store(self, pipeline: PipelineSettings) -> None:
        return None

    def exactly_once_writer(self, sink: object, pipeline: PipelineSettings, dlq: DeadLetterQueue) -> ExactlyOnceFn:
        raise ConfigError(f"pipelines.{pipeline.name}.sink: ClickHouse has no exactly-once delivery")

    @staticmethod
    def _settings(pipeline: PipelineSettings) -> ClickHouseSinkSettings:
        assert isinstance(pipeline.sink, ClickHouseSinkSettings)
        return pipeline.sink


BACKEND = ClickHouseBackend()

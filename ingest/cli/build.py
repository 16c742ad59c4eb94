"""The composition root: the only place adapters are built -- sources, sinks, DLQs, pipelines.

Everything here asks the sink registry (:mod:`ingest.sinks.registry`) and the
settings; nothing branches on a sink's kind. ``ingest demo`` and the commands
use these public functions.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from ingest.config import PipelineSettings, Settings
from ingest.dlq.base import DeadLetterQueue, DlqReader
from ingest.cdc.mapper import mapper_for
from ingest.formats.registry import build_decoder
from ingest.metrics import Metrics
from ingest.runner import Pipeline, RunOptions
from ingest.runner.columnar import columnar_tier, write_tier
from ingest.scheduler import WriteScheduler
from ingest.sinks import registry
from ingest.sinks.base import Sink


def build_sink(p: PipelineSettings, *, lanes: int) -> Sink:
    """The pipeline's sink, sized for ``lanes`` concurrent writers."""
    return registry.backend(p.sink.kind).build(p, lanes=lanes)


def dlq_dsn(p: PipelineSettings) -> str:
    """The DSN of the pipeline's PostgreSQL DLQ table (validated to exist when one is written)."""
    dsn = p.dlq_dsn
    assert dsn is not None, "a pipeline writing a PostgreSQL DLQ table has a DSN (validated)"
    return dsn.get_secret_value()


def build_dlq(settings: Settings, p: PipelineSettings) -> DeadLetterQueue:
    """The pipeline's DLQ (by ``dlq.kind``, see :mod:`ingest.dlq.registry`)."""
    from ingest.dlq import registry as dlq_registry

    return dlq_registry.build_writer(settings, p)


def build_dlq_reader(settings: Settings, p: PipelineSettings) -> DlqReader:
    """The pipeline's DLQ as ``ingest dlq`` and ``replay-dlq`` read it."""
    from ingest.dlq import registry as dlq_registry

    return dlq_registry.build_reader(settings, p)


def sink_identity(p: PipelineSettings) -> str:
    """Which database a pipeline writes to (used as a key only, never printed)."""
    return registry.backend(p.sink.kind).identity(p.sink)


def build_schedulers(settings: Settings, pipelines: list[PipelineSettings],
                     metrics: Metrics | None) -> dict[str, WriteScheduler]:
    """One WriteScheduler per database that some pipeline limits (smallest max_concurrent_writes wins)."""
    limits: dict[str, list[int]] = {}
    for p in pipelines:
        if p.sink.max_concurrent_writes is not None:
            limits.setdefault(sink_identity(p), []).append(p.sink.max_concurrent_writes)
    return {
        ident: WriteScheduler(f"db{i}", min(slots), aging_ms_per_level=settings.scheduler.aging_ms_per_level,
                              metrics_registry=metrics.registry if metrics is not None else None)
        for i, (ident, slots) in enumerate(sorted(limits.items()))
    }


@dataclass
class Built:
    """A pipeline ready to run, and what to close after it."""

    pipeline: Pipeline
    resources: list[Any] = field(default_factory=list)

    def warm_up(self) -> None:
        """Connect the sink now: the first batch should not pay for it. Never raises."""
        self.resources[0].warm_up()


    def close(self) -> None:
        import logging

        for r in self.resources:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing must not hide the run's outcome
                logging.getLogger("ingest").exception("error while closing")


def build_pipeline(settings: Settings, p: PipelineSettings, *, stop: threading.Event, abort: threading.Event,
                   options: RunOptions, metrics: Metrics | None = None,
                   schedulers: dict[str, WriteScheduler] | None = None) -> Built:
    """A :class:`~ingest.runner.Pipeline` with its sink, DLQ and source, built from the settings."""
    from ingest.sources.kafka import KafkaSource
    from ingest.runner.writer import BatchWriter

    decoder = build_decoder(p, settings.schema_registry)
    key_decoder = build_decoder(p, settings.schema_registry, "key")
    if p.transforms:  # refuse a step reading a field the declared schema lacks (registry: maybe deferred)
        import logging

        from ingest.formats.check import check_transforms_at_start

        check_transforms_at_start(p, decoder, f"pipelines[{settings.pipelines.index(p)}].transforms",
                                  logging.getLogger("ingest"))
    backend = registry.backend(p.sink.kind)
    sink = build_sink(p, lanes=p.lanes)
    dlq = build_dlq(settings, p)
    offset_store = backend.offset_store(p)
    exactly_once = backend.exactly_once_writer(sink, p, dlq) if offset_store is not None else None
    # One mapper: the accept loop's, and the columnar tier's for the records it leaves to rows (so the
    # run's fast-path statistics count those too).
    mapper = mapper_for(p, decoder=decoder, key_decoder=key_decoder)
    existing_tables = getattr(sink, "existing_tables", None)
    if p.routes_tables and existing_tables is not None:  # the case guard knows the tables already there
        mapper.router.seed_from(existing_tables)
    tier: list[str] = []
    columnar = columnar_tier(p, sink, columnar_capable=backend.capabilities.columnar,
                             exactly_once=exactly_once is not None, mapper=lambda: mapper, said=tier.append)
    writer = BatchWriter(pipeline=p.name, write=sink.write, dlq=dlq, retry=p.retry,
                         collapse_rule=p.collapse_rule(), abort=abort, exactly_once=exactly_once,
                         insert_tokens=backend.capabilities.insert_tokens, columnar=columnar,
                         routed=p.routes_tables)
    source_factory = functools.partial(KafkaSource, settings.kafka, p.effective_group_id, list(p.topics),
                                       exclude_topics=p.exclude_topics, topic_refresh_s=p.topic_refresh_s)
    pipeline = Pipeline(
        p, source_factory=source_factory, writer=writer, stop=stop, abort=abort, options=options,
        decoder=decoder, key_decoder=key_decoder, mapper=mapper,
        metrics=metrics.pipeline(p.name) if metrics is not None else None,
        offset_store=offset_store, scheduler=(schedulers or {}).get(sink_identity(p)),
    )
    pipeline.stats.write_tier = tier[0] if tier else None
    return Built(pipeline, [sink, dlq] + ([offset_store] if offset_store is not None else []))


def describe_tier(settings: Settings, p: PipelineSettings, sink: Sink) -> str:
    """What a run of ``p`` writes with: ``columnar``, or ``rows (<the first reason>)`` (for ``ingest
    check``; the run logs the same line at start-up). ``sink``: built by :func:`build_sink`, open."""
    backend = registry.backend(p.sink.kind)
    decoder = build_decoder(p, settings.schema_registry)
    key_decoder = build_decoder(p, settings.schema_registry, "key")
    return write_tier(p, sink, columnar_capable=backend.capabilities.columnar,
                      exactly_once=bool(getattr(p.sink, "exactly_once", False)),
                      mapper=lambda: mapper_for(p, decoder=decoder, key_decoder=key_decoder))

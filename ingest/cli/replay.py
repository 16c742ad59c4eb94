"""``ingest replay-dlq``: send dead-lettered records back through the pipeline once their cause is fixed."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import (
    EXIT_CONFIG,
    EXIT_FAILED,
    ConfigOpt,
    LogLevelOpt,
    OnePipelineOpt,
    app,
    fail,
    load,
    setup_logs,
)
from ingest.cli.dlq import (
    ErrorClassOpt,
    RangeOpt,
    SinceOpt,
    StageOpt,
    UntilOpt,
    call,
    open_dlq,
)
from ingest.config import PipelineSettings
from ingest.errors import IngestError

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show what would be replayed; change nothing.")]
LimitOpt = Annotated[Optional[int], typer.Option("--limit", help="Replay at most N entries.")]
RateOpt = Annotated[Optional[float], typer.Option("--rate", help="At most N records per second.")]
ToOpt = Annotated[str, typer.Option("--to", help="sink: write through the pipeline's mapping and sink; "
                                                 "topic: republish to the original topic.")]
PurgeOpt = Annotated[bool, typer.Option("--purge", help="Delete replayed entries instead of marking them "
                                                        "(a PostgreSQL DLQ table; a topic cannot delete).")]
MaxReplaysOpt = Annotated[Optional[int], typer.Option("--max-replays", help="Loop guard (default dlq.max_replays).")]
UnorderedOpt = Annotated[bool, typer.Option(
    "--apply-unordered", help="Also apply entries whose row was last written from another partition (or before "
                              "ingest kept row sources): ingest cannot tell whether they are older.")]


@app.command("replay-dlq")
def replay_dlq(config: ConfigOpt = None, pipeline: OnePipelineOpt = "", dry_run: DryRunOpt = False,
               limit: LimitOpt = None, error_class: ErrorClassOpt = None, stage: StageOpt = None,
               since: SinceOpt = None, until: UntilOpt = None, offset_range: RangeOpt = None, rate: RateOpt = None,
               to: ToOpt = "sink", purge: PurgeOpt = False, max_replays: MaxReplaysOpt = None,
               apply_unordered: UnorderedOpt = False, log_level: LogLevelOpt = "warning") -> None:
    """Send dead-lettered records back through the pipeline once their cause is fixed.

    Never makes a row older: an entry older than its row is resolved as superseded. Resumable:
    run it again after an interruption and each entry is replayed once. Entries that still fail
    stay in the DLQ with their attempt count and the new error; after --max-replays failed replays
    an entry is given up. Exit 0 when the run completed (even if some entries still fail).
    """
    setup_logs(log_level)
    if to not in ("sink", "topic"):
        raise fail(EXIT_CONFIG, f"--to {to!r}: expected sink or topic")
    settings = load(config)
    p, reader, flt = open_dlq(settings, pipeline, error_class=error_class, stage=stage, since=since, until=until,
                              offset_range=offset_range)
    if purge and not reader.can_purge:
        raise fail(EXIT_CONFIG, f"pipelines.{p.name}.dlq.kind is {p.dlq.kind!r}: --purge cannot delete from a "
                                "topic (replayed entries are marked; the topic's retention removes them)")
    sink, publisher = _targets(settings, p, to, dry_run)
    progress: Any = None
    try:
        replayer = _replayer(p, reader, sink, publisher, max_replays or p.dlq.max_replays, purge, rate,
                             apply_unordered, settings.schema_registry)
        selected, skipped = call(lambda: replayer.count(flt, limit))
        if dry_run:
            from ingest.replay import ReplaySummary

            typer.echo(ReplaySummary(selected=selected, skipped=skipped).line(dry_run=True))
            return
        progress = _progress(selected)
        replayer.on_progress = progress.advance if progress is not None else None
        summary = call(lambda: replayer.run(flt, limit))
    except IngestError as exc:
        raise fail(EXIT_FAILED, f"replay stopped: {exc}") from None
    finally:
        if progress is not None:
            progress.stop()
        for resource in (sink, publisher, reader):
            if resource is not None:
                resource.close()
    typer.echo(summary.line(dry_run=False))


def _targets(settings: Any, p: PipelineSettings, to: str, dry_run: bool) -> tuple[Any, Any]:
    """The sink (to write into, or to read row sources from) and the publisher (``--to topic``)."""
    from ingest.cli.build import build_sink
    from ingest.sinks import registry

    capabilities = registry.backend(p.sink.kind).capabilities
    sink = build_sink(p, lanes=1) if to == "sink" or capabilities.row_sources else None
    publisher = None
    if to == "topic" and not dry_run:
        from ingest.replay.publish import TopicPublisher

        publisher = TopicPublisher(settings.kafka)
    return sink, publisher


def _replayer(p: PipelineSettings, reader: Any, sink: Any, publisher: Any, max_replays: int, purge: bool,
              rate: float | None, apply_unordered: bool, schema_registry: Any = None) -> Any:
    from ingest.replay import Replayer
    from ingest.retry import retrying
    from ingest.sinks import registry

    capabilities = registry.backend(p.sink.kind).capabilities
    own = p.sink.postgres_dsn
    if sink is not None:
        sink = _Retrying(sink, lambda: retrying(p.retry, what="replay sink write"))
    from ingest.formats.registry import build_decoder

    return Replayer(p, reader, sink=sink, capabilities=capabilities, decoder=build_decoder(p, schema_registry),
                    key_decoder=build_decoder(p, schema_registry, "key"),
                    marks_in_sink_tx=reader.shares_database(own.get_secret_value() if own else None),
                    publish=publisher, max_replays=max_replays, purge=purge, rate_per_s=rate,
                    apply_unordered=apply_unordered)


class _Retrying:
    """The sink with ``write`` retried on transient errors (the pipeline's retry policy)."""

    def __init__(self, sink: Any, policy: Any) -> None:
        self._sink = sink
        self._policy = policy

    def write(self, rows: Any, **kwargs: Any) -> None:
        for attempt in self._policy():
            with attempt:
                self._sink.write(rows, **kwargs)

    def __getattr__(self, name: str) -> Any:  # row_sources, close: the sink's own
        return getattr(self._sink, name)


class _Progress:
    """A progress bar on a terminal's stderr."""

    def __init__(self, total: int) -> None:
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._task = self._bar.add_task("replaying", total=total)
        self._bar.start()

    def advance(self, n: int) -> None:
        self._bar.advance(self._task, n)

    def stop(self) -> None:
        self._bar.stop()


def _progress(total: int) -> _Progress | None:
    return _Progress(total) if sys.stderr.isatty() else None

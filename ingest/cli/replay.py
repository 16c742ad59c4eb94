"""``ingest replay-dlq``: send dead-lettered records back through the pipeline once their cause is fixed."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import EXIT_CONFIG, EXIT_FAILED, ConfigOpt, LogLevelOpt, OnePipelineOpt, app, fail, load, setup_logs
from ingest.cli.dlq import ErrorClassOpt, RangeOpt, SinceOpt, StageOpt, UntilOpt, _dlq_call, _dlq_store_and_filter
from ingest.config import Settings
from ingest.errors import IngestError

@app.command("replay-dlq")
def replay_dlq(
    config: ConfigOpt = None,
    pipeline: OnePipelineOpt = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be replayed; change nothing.")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Replay at most N entries.")] = None,
    error_class: ErrorClassOpt = None,
    stage: StageOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    offset_range: RangeOpt = None,
    rate: Annotated[Optional[float], typer.Option("--rate", help="At most N records per second.")] = None,
    to: Annotated[str, typer.Option("--to", help="sink: write through the pipeline's mapping and sink; "
                                                 "topic: republish to the original topic.")] = "sink",
    purge: Annotated[bool, typer.Option("--purge", help="Delete replayed entries instead of marking them.")] = False,
    max_replays: Annotated[Optional[int], typer.Option("--max-replays", help="Loop guard (default dlq.max_replays).")] = None,
    log_level: LogLevelOpt = "warning",
) -> None:
    """Send dead-lettered records back through the pipeline once their cause is fixed.

    Resumable: run it again after an interruption and each entry is replayed
    once. Entries that still fail stay in the DLQ with their attempt count and
    the new error; after --max-replays failed replays an entry is given up.
    Exit 0 when the run completed (even if some entries still fail).
    """
    setup_logs(log_level)
    if to not in ("sink", "topic"):
        raise fail(EXIT_CONFIG, f"--to {to!r}: expected sink or topic")
    settings = load(config)
    p, store, flt = _dlq_store_and_filter(settings, pipeline, error_class, stage, since, until, offset_range,
                                          ("pending",))
    from ingest.replay import Replayer

    limit_replays = max_replays or p.dlq.max_replays
    sink = None
    publish = None
    same_db = False
    if to == "sink":
        from ingest.cli.build import build_sink, dlq_dsn
        from ingest.sinks import registry

        sink = build_sink(p, lanes=1)
        own = p.sink.postgres_dsn
        same_db = (registry.backend(p.sink.kind).capabilities.transactions and own is not None
                   and dlq_dsn(p) == own.get_secret_value())
    elif not dry_run:
        publish = _make_publisher(settings)

    from tenacity import RetryError  # noqa: F401 - tenacity reraises the original error

    from ingest.retry import retrying

    if sink is not None:
        raw_write = sink.write

        def write_with_retry(rows: Any, in_tx: Any = None) -> None:
            for attempt in retrying(p.retry, what="replay sink write"):
                with attempt:
                    raw_write(rows, in_tx=in_tx)

        class _RetryingSink:
            write = staticmethod(write_with_retry)

        sink_for_replay: Any = _RetryingSink()
    else:
        sink_for_replay = None

    progress_cb = None
    progress_ctx: Any = None
    replayer = Replayer(p, store, sink=sink_for_replay, same_database=same_db, publish=publish,
                        max_replays=limit_replays, purge=purge, rate_per_s=rate)
    try:
        selected, skipped = _dlq_call(lambda: replayer.count(flt, limit))
        if dry_run:
            from ingest.replay import ReplaySummary

            typer.echo(ReplaySummary(selected=selected, skipped=skipped).line(dry_run=True))
            return
        if sys.stderr.isatty():
            from rich.progress import Progress

            progress_ctx = Progress(transient=True)
            task = progress_ctx.add_task("replaying", total=selected)
            progress_ctx.start()
            progress_cb = lambda n: progress_ctx.advance(task, n)  # noqa: E731
        replayer._on_progress = progress_cb
        summary = _dlq_call(lambda: replayer.run(flt, limit))
    except IngestError as exc:
        raise fail(EXIT_FAILED, f"replay stopped: {exc}") from None
    finally:
        if progress_ctx is not None:
            progress_ctx.stop()
        if sink is not None:
            sink.close()
    typer.echo(summary.line(dry_run=False))


def _make_publisher(settings: Settings) -> Any:
    """A function that republishes DLQ rows to their original topics and waits for acknowledgements."""
    from confluent_kafka import Producer

    from ingest.errors import TransientError
    from ingest.replay import republish_headers

    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True, "acks": "all"})

    def publish(rows: Any) -> None:
        errors: list[Any] = []
        for row in rows:
            rec = row.record
            producer.produce(rec.topic, key=rec.key, value=rec.value, partition=rec.partition,
                             headers=republish_headers(row),
                             on_delivery=lambda err, _m: errors.append(err) if err else None)
            producer.poll(0)
        if producer.flush(30) or errors:
            raise TransientError(f"republish failed: {errors[0].str() if errors else 'not acknowledged in time'}")

    return publish

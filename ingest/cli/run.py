"""``ingest run``: consume the configured topics into their sinks until stopped, idle, or failed."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import (
    EXIT_ABORTED,
    EXIT_CONFIG,
    EXIT_FAILED,
    ConfigOpt,
    LogLevelOpt,
    PipelineOpt,
    app,
    fail,
    load,
    select,
    setup_logs,
)
from ingest.errors import ConfigError

log = logging.getLogger("ingest")

UntilIdleOpt = Annotated[
    Optional[float],
    typer.Option("--until-idle", metavar="SECONDS",
                 help="Exit 0 once the consumer group has drained the topics (committed offsets at the log "
                      "end on every partition) and nothing arrived for this long."),
]
DrainTimeoutOpt = Annotated[
    Optional[float],
    typer.Option("--drain-timeout", metavar="SECONDS", min=0.0,
                 help="With --until-idle: give up after waiting this long for partitions held by other "
                      "members to drain, exit 1 and name them (default 10 x --until-idle)."),
]
MetricsPortOpt = Annotated[
    int, typer.Option("--metrics-port", envvar="INGEST_METRICS_PORT",
                      help="Serve /metrics, /healthz, /readyz and /status on this port (0 = off).")
]
LingerOpt = Annotated[
    float, typer.Option("--linger", envvar="INGEST_LINGER_S", metavar="SECONDS", min=0.0,
                        help="After the pipelines ended on their own (failed, or --until-idle), keep serving "
                             "/metrics and /status this long before exiting, so a scraper sees the final state "
                             "(a signal ends it at once; not used with --processes).")
]
SummaryOpt = Annotated[
    Optional[Path], typer.Option("--summary-json", help="Also write the exit summary as JSON to this file.")
]
ProcessesOpt = Annotated[
    int, typer.Option("--processes", envvar="INGEST_PROCESSES", min=1,
                      help="Run this many worker processes in the same consumer groups "
                           "(metrics port base+index; see ingest.supervisor).")
]


@app.command()
def run(config: ConfigOpt = None, pipeline: PipelineOpt = None, until_idle: UntilIdleOpt = None,
        drain_timeout: DrainTimeoutOpt = None, metrics_port: MetricsPortOpt = 9464, summary_json: SummaryOpt = None,
        log_level: LogLevelOpt = "info", processes: ProcessesOpt = 1, linger: LingerOpt = 0.0) -> None:
    """Consume the configured topics and write them into their sinks until stopped.

    SIGTERM / SIGINT: stop fetching, flush, wait for writes (shutdown_timeout_s),
    commit, exit 0. A second signal aborts at once without committing anything
    unwritten (exit 130).
    """
    setup_logs(log_level)
    settings = load(config)
    selected = select(settings, pipeline)
    if processes > 1:
        from ingest.supervisor import run_from_cli

        raise typer.Exit(run_from_cli(settings, processes, until_idle=until_idle is not None,
                                      metrics_port=metrics_port, summary_json=summary_json))
    from ingest.cli.build import build_pipeline, build_schedulers
    from ingest.metrics import Metrics
    from ingest.runner import RunOptions

    stop, abort, signalled, lingering = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    _install_signals(stop, abort, signalled, lingering)
    metrics = Metrics()
    server = _serve(metrics, metrics_port)
    options = RunOptions(consume_batch_size=settings.kafka.consume_batch_size,
                         poll_timeout_ms=settings.kafka.poll_timeout_ms, until_idle_s=until_idle,
                         drain_timeout_s=drain_timeout)
    try:
        schedulers = build_schedulers(settings, selected, metrics)
        built = [build_pipeline(settings, p, stop=stop, abort=abort, options=options, metrics=metrics,
                                schedulers=schedulers) for p in selected]
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    started = time.monotonic()
    errors = _run_all(built, stop, abort)
    aborted = abort.is_set()  # a signal during the linger below only ends the linger
    _report(built, errors, time.monotonic() - started, summary_json)
    if server is not None:
        if linger > 0 and not signalled.is_set():
            log.info("pipelines ended: serving their final status before exiting",
                     extra={"linger_s": linger, "failed": sorted(errors)})
            lingering.set()
            signalled.wait(linger)
        server.shutdown()
    if aborted:
        raise typer.Exit(EXIT_ABORTED)
    if errors:
        raise typer.Exit(EXIT_FAILED)


def _install_signals(stop: threading.Event, abort: threading.Event, signalled: threading.Event,
                     lingering: threading.Event) -> None:
    def on_signal(signum: int, _frame: Any) -> None:
        signalled.set()
        if lingering.is_set():  # the pipelines already ended: only the --linger wait is left
            log.info("signal received: exiting", extra={"signal": signal.Signals(signum).name})
            return
        if stop.is_set():
            log.warning("second signal: aborting")
            abort.set()
        else:
            log.info("signal received: stopping", extra={"signal": signal.Signals(signum).name})
            stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _serve(metrics: Any, port: int) -> Any:
    if not port:
        return None
    from ingest.http import serve

    try:
        server = serve(metrics, port)
    except OSError as exc:
        log.error("cannot serve metrics; continuing without", extra={"port": port, "error": str(exc)})
        return None
    log.info("serving /metrics /healthz /readyz /status", extra={"port": port})
    return server


def _run_all(built: list[Any], stop: threading.Event, abort: threading.Event) -> dict[str, BaseException]:
    """Run every pipeline in its own thread until all end; one failure stops the others. Closes them."""
    errors: dict[str, BaseException] = {}
    for b in built:  # connect sinks now: the first batch should not pay for it
        b.warm_up()
    from ingest.tuning import tune_for_throughput

    tune_for_throughput()

    def run_one(pl: Any) -> None:
        try:
            pl.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, the process exits non-zero
            errors[pl.settings.name] = exc
            stop.set()  # one failed pipeline stops the others cleanly

    threads = [threading.Thread(target=run_one, args=(b.pipeline,), name=f"pipeline-{b.pipeline.settings.name}")
               for b in built]
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
    for b in built:
        b.close()
    return errors


def _report(built: list[Any], errors: dict[str, BaseException], elapsed: float, summary_json: Path | None) -> None:
    """The exit summary on stderr (and as JSON), and each pipeline's error; secrets masked."""
    from ingest.redact import scrub

    for b in built:
        s = b.pipeline.stats
        typer.echo(
            f"pipeline {b.pipeline.settings.name}: consumed {s.records_consumed} records, wrote {s.rows_written} "
            f"rows ({s.rows_deleted} of them deletes), dead-lettered {s.dead_lettered_total}, "
            f"filtered {s.filtered_total}, skipped {s.skipped}, "
            f"{s.records_consumed / elapsed if elapsed > 0 else 0:.0f} records/s over {elapsed:.1f} s",
            err=True,
        )
    if summary_json is not None:
        import orjson

        summary = {
            "elapsed_s": round(elapsed, 3),
            "peak_rss_bytes": _peak_rss_bytes(),
            "pipelines": {b.pipeline.settings.name: b.pipeline.stats.as_dict() for b in built},
            "errors": {name: scrub(str(exc)) for name, exc in errors.items()},
        }
        summary_json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    for name, exc in errors.items():
        typer.echo(error_line(name, scrub(str(exc))), err=True)


def error_line(pipeline: str, message: str) -> str:
    """``error: pipeline NAME: MESSAGE``, the pipeline named once (errors raised inside a pipeline
    already begin with ``pipeline 'NAME': ``)."""
    prefix = f"pipeline {pipeline!r}: "
    while message.startswith(prefix):
        message = message[len(prefix):]
    return f"error: pipeline {pipeline}: {message}"


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

"""``ingest lag``: per-partition consumer lag of each pipeline's group, in records and in time."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    ConfigOpt,
    LogLevelOpt,
    PipelineOpt,
    app,
    fail,
    load,
    select,
    setup_logs,
)
from ingest.errors import ServiceUnreachable

FormatOpt = Annotated[
    Optional[str],
    typer.Option("--format", "-f", metavar="table|json",
                 help="table (default on a terminal) or json (default otherwise): one JSON document."),
]
WatchOpt = Annotated[
    Optional[float],
    typer.Option("--watch", "-w", metavar="SECONDS",
                 help="Measure again every SECONDS until Ctrl-C (json: one document per line)."),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", metavar="SECONDS", help="Per-request broker timeout.")]


@app.command()
def lag(config: ConfigOpt = None, pipeline: PipelineOpt = None, output_format: FormatOpt = None,
        watch: WatchOpt = None, timeout: TimeoutOpt = 10.0, log_level: LogLevelOpt = "warning") -> None:
    """Per-partition consumer lag of each pipeline's group, in records and in time.

    Reads committed offsets without joining the group (safe while pipelines
    run). A partition holding more than half of its pipeline's lag (of at
    least 100 records, with 2+ partitions) is flagged HOT. Exit 0 on success,
    1 when some partitions could not be measured (e.g. a missing topic),
    2 on configuration errors, 3 when the broker is unreachable.
    """
    setup_logs(log_level)
    fmt = (output_format or ("table" if sys.stdout.isatty() else "json")).lower()
    if fmt not in ("table", "json"):
        raise fail(EXIT_CONFIG, f"--format must be table or json, not {output_format!r}")
    if watch is not None and watch <= 0:
        raise fail(EXIT_CONFIG, "--watch must be a positive number of seconds")
    if timeout <= 0:
        raise fail(EXIT_CONFIG, "--timeout must be a positive number of seconds")
    settings = load(config)
    selected = select(settings, pipeline)
    from ingest.lag import collect_lag

    emit = _emitter(fmt, watch)
    if watch is None:
        try:
            report = collect_lag(settings.kafka, selected, timeout_s=timeout)
        except ServiceUnreachable as exc:
            raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
        emit(report)
        for err in report.errors:
            typer.echo(f"error: {err}", err=True)
        if report.errors:
            raise typer.Exit(EXIT_FAILED)
        return
    stop = _stop_on_signals()
    while not stop.is_set():
        started = time.monotonic()
        try:
            report = collect_lag(settings.kafka, selected, timeout_s=timeout)
        except ServiceUnreachable as exc:  # keep watching: the broker may come back
            typer.echo(f"error: unreachable: {exc}", err=True)
        else:
            emit(report)
            for err in report.errors:
                typer.echo(f"error: {err}", err=True)
        stop.wait(max(0.0, watch - (time.monotonic() - started)))


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM: ``--watch`` finishes the measurement under way
    (its clients closed, at most ``--timeout`` later) and exits 0. A KeyboardInterrupt raised inside
    the Kafka clients' calls could leave a consumer unclosed, whose teardown at exit may hang. A
    second signal ends the process at once (the default action)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def _emitter(fmt: str, watch: float | None) -> Any:
    from ingest.lag import render_json, render_tables

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

    return emit

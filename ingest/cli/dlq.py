"""``ingest dlq count|list|show``: inspect a pipeline's dead-letter queue without SQL, whatever its kind."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    ConfigOpt,
    OnePipelineOpt,
    app,
    fail,
    load,
    one,
)
from ingest.config import PipelineSettings, Settings
from ingest.dlq.base import STATUSES, DlqFilter, DlqReader
from ingest.errors import ConfigError, ServiceUnreachable

dlq_app = typer.Typer(help="Inspect the dead-letter queue (PostgreSQL table or Kafka topic).", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")

ErrorClassOpt = Annotated[Optional[str], typer.Option("--error-class", help="Only this error class.")]
StageOpt = Annotated[Optional[str], typer.Option("--stage", help="Only this stage: decode | map | write.")]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="Failed at or after (ISO 8601).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Failed before (ISO 8601).")]
RangeOpt = Annotated[Optional[str], typer.Option("--offset-range", help="[PARTITION:]FROM-TO, inclusive.")]
FormatOpt = Annotated[str, typer.Option("--format", help="table | json")]
StatusOpt = Annotated[Optional[list[str]], typer.Option(
    "--status", help=f"{' | '.join(STATUSES)} (repeatable; count: all, list: pending)")]


def open_dlq(settings: Settings, name: str, *, error_class: str | None = None, stage: str | None = None,
             since: str | None = None, until: str | None = None, offset_range: str | None = None,
             statuses: tuple[str, ...] = ("pending",)) -> tuple[PipelineSettings, DlqReader, DlqFilter]:
    """The pipeline, its DLQ reader and the filter of the options; exit 2 on a bad option."""
    from ingest.cli.build import build_dlq_reader
    from ingest.dlq.store import parse_offset_range, parse_time

    p = one(settings, name)
    try:
        bad = [s for s in statuses if s not in STATUSES]
        if bad:
            raise ConfigError(f"--status {bad[0]!r}: expected one of {', '.join(STATUSES)}")
        part, lo, hi = parse_offset_range(offset_range) if offset_range else (None, None, None)
        flt = DlqFilter(
            pipeline=p.name, error_class=error_class, stage=stage, since=parse_time(since, "--since"),
            until=parse_time(until, "--until"), partition=part, offset_from=lo, offset_to=hi, statuses=statuses,
        )
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    return p, build_dlq_reader(settings, p), flt


def call(fn: Any) -> Any:
    """Run a DLQ read or mark; an unreachable DLQ exits 3, a missing one 1 (run ``ingest migrate``)."""
    try:
        return fn()
    except ServiceUnreachable as exc:
        raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise fail(EXIT_FAILED, str(exc)) from None


@dlq_app.command("count")
def dlq_count(config: ConfigOpt = None, pipeline: OnePipelineOpt = "", error_class: ErrorClassOpt = None,
              stage: StageOpt = None, since: SinceOpt = None, until: UntilOpt = None,
              offset_range: RangeOpt = None, status: StatusOpt = None, fmt: FormatOpt = "table") -> None:
    """Count DLQ entries by stage, error class and status."""
    settings = load(config)
    _, reader, flt = open_dlq(settings, pipeline, error_class=error_class, stage=stage, since=since, until=until,
                              offset_range=offset_range, statuses=tuple(status or STATUSES))
    try:
        rows = call(lambda: reader.count(flt))
    finally:
        reader.close()
    if fmt == "json":
        import orjson

        typer.echo(orjson.dumps([{"stage": a, "error_class": b, "status": c, "count": n}
                                 for a, b, c, n in rows]).decode())
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
    settings = load(config)
    _, reader, flt = open_dlq(settings, pipeline, error_class=error_class, stage=stage, since=since, until=until,
                              offset_range=offset_range, statuses=tuple(status or ["pending"]))
    try:
        rows = call(lambda: reader.fetch(flt, limit=limit))
    finally:
        reader.close()
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
def dlq_show(entry_id: Annotated[str, typer.Argument(help="DLQ entry id (from `dlq list`).")],
             config: ConfigOpt = None, pipeline: OnePipelineOpt = "") -> None:
    """Show one DLQ entry in full (value as UTF-8 text, or base64 when it is not text) as JSON."""
    settings = load(config)
    _, reader, _ = open_dlq(settings, pipeline)
    try:
        row = call(lambda: reader.get(entry_id))
    finally:
        reader.close()
    if row is None:
        raise fail(EXIT_FAILED, f"no DLQ entry {entry_id}")
    import orjson

    typer.echo(orjson.dumps(row.as_dict(), option=orjson.OPT_INDENT_2).decode())

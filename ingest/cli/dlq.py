"""``ingest dlq count|list|show``: inspect a pipeline's dead-letter queue without SQL."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import EXIT_CONFIG, EXIT_FAILED, EXIT_UNREACHABLE, ConfigOpt, OnePipelineOpt, app, fail, load
from ingest.config import PipelineSettings, Settings
from ingest.errors import ConfigError

dlq_app = typer.Typer(help="Inspect the dead-letter queue (PostgreSQL DLQ backend).", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")

ErrorClassOpt = Annotated[Optional[str], typer.Option("--error-class", help="Only this error class.")]
StageOpt = Annotated[Optional[str], typer.Option("--stage", help="Only this stage: decode | map | write.")]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="Failed at or after (ISO 8601).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Failed before (ISO 8601).")]
RangeOpt = Annotated[Optional[str], typer.Option("--offset-range", help="[PARTITION:]FROM-TO, inclusive.")]
FormatOpt = Annotated[str, typer.Option("--format", help="table | json")]


def _dlq_store_and_filter(
    settings: Settings, pipeline: str, error_class: str | None, stage: str | None, since: str | None,
    until: str | None, offset_range: str | None, statuses: tuple[str, ...],
) -> tuple[PipelineSettings, Any, Any]:
    from ingest.cli.build import dlq_dsn
    from ingest.dlq.store import DlqFilter, DlqStore, parse_offset_range, parse_time

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
        raise fail(EXIT_CONFIG, str(exc)) from None


StatusOpt = Annotated[Optional[list[str]], typer.Option("--status", help="pending | replayed | gave_up (repeatable; default pending)")]


@dlq_app.command("count")
def dlq_count(config: ConfigOpt = None, pipeline: OnePipelineOpt = "", error_class: ErrorClassOpt = None,
              stage: StageOpt = None, since: SinceOpt = None, until: UntilOpt = None,
              offset_range: RangeOpt = None, status: StatusOpt = None, fmt: FormatOpt = "table") -> None:
    """Count DLQ entries by stage, error class and status."""
    settings = load(config)
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
    settings = load(config)
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
    settings = load(config)
    _, store, _ = _dlq_store_and_filter(settings, pipeline, None, None, None, None, None, ("pending",))
    row = _dlq_call(lambda: store.get(entry_id))
    if row is None:
        raise fail(EXIT_FAILED, f"no DLQ entry {entry_id}")
    import orjson

    typer.echo(orjson.dumps(row.as_dict(), option=orjson.OPT_INDENT_2).decode())


def _dlq_call(fn: Any) -> Any:
    import psycopg

    try:
        return fn()
    except psycopg.OperationalError as exc:
        from ingest.drivers.postgres import classify

        raise fail(EXIT_UNREACHABLE, f"unreachable: DLQ database: {classify(exc)}") from None
    except psycopg.errors.UndefinedTable:
        raise fail(EXIT_FAILED, "the DLQ table does not exist: run `ingest migrate`") from None

"""``ingest migrate``: create every table the pipelines write (idempotent)."""

from __future__ import annotations

from typing import Annotated

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
from ingest.errors import ConfigError, IngestError, ServiceUnreachable


@app.command()
def migrate(config: ConfigOpt = None, pipeline: PipelineOpt = None, log_level: LogLevelOpt = "warning",
            dry_run: Annotated[bool, typer.Option("--dry-run", help=(
                "Print the DDL the tables of columns: auto pipelines would get (created or altered from "
                "their topics' latest registry schemas), run nothing (the other tables are not shown)."))] = False,
            ) -> None:
    """Create sink tables, the DLQ table and bookkeeping tables (idempotent: safe to run twice)."""
    setup_logs(log_level)
    settings = load(config)
    from ingest.migrate import migrate_pipeline

    try:
        for p in select(settings, pipeline):
            if not dry_run:
                for line in migrate_pipeline(p):
                    typer.echo(f"ok   {line}")
            if p.routes_tables:
                _routed_tables(settings, p, dry_run=dry_run)
    except ServiceUnreachable as exc:
        raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    except IngestError as exc:
        raise fail(EXIT_FAILED, str(exc)) from None


def _routed_tables(settings: object, p: object, *, dry_run: bool = False) -> None:
    """A pipeline routing by a template that reads the topic only: create the tables of the topics
    that exist now (the others are created when their first record arrives). A broker that cannot be
    reached is a warning here, not a failure: the tables will be made by the run."""
    from ingest.cli.build import build_sink
    from ingest.mirror.router import tables_of_topics
    from ingest.sources.kafka import check_broker

    try:
        topics = check_broker(settings.kafka)  # type: ignore[attr-defined]
    except ServiceUnreachable as exc:
        typer.echo(f"warn {p.name}: topics not listed ({exc}): each table is created by the run")  # type: ignore[attr-defined]
        return
    sink = build_sink(p, lanes=1)  # type: ignore[arg-type]
    try:
        routes = tables_of_topics(p, topics, sink.existing_tables())  # type: ignore[attr-defined]
        if p.auto_columns:  # type: ignore[attr-defined]
            from ingest.cli.mirror_plan import auto_table_plans, describe

            for topic, table, why in routes:
                if table is None:
                    typer.echo(f"warn {p.name}: topic {topic} cannot be routed: {why}")  # type: ignore[attr-defined]
            for plan in auto_table_plans(settings, p, routes, sink, dry_run=dry_run):
                head, *statements = describe(plan, dry_run=dry_run)
                typer.echo(f"{head[:5]}{p.name}: {head[5:]}")  # type: ignore[attr-defined]
                for statement in statements:
                    typer.echo(statement)
            return
        for topic, table, why in routes:
            if table is None:
                typer.echo(f"warn {p.name}: topic {topic} cannot be routed: {why}")  # type: ignore[attr-defined]
                continue
            sink.ensure_table(table)  # type: ignore[attr-defined]
            typer.echo(f"ok   {p.name}: table {table} (topic {topic})")  # type: ignore[attr-defined]
    finally:
        sink.close()

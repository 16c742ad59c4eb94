"""``ingest check``: validate the config and reach every broker and database it names."""

from __future__ import annotations

from typing import Any

import typer

from ingest.cli.app import (
    EXIT_CONFIG,
    EXIT_UNREACHABLE,
    ConfigOpt,
    LogLevelOpt,
    app,
    fail,
    load,
    setup_logs,
)
from ingest.errors import ConfigError, ServiceUnreachable


@app.command()
def check(config: ConfigOpt = None, log_level: LogLevelOpt = "warning") -> None:
    """Validate the config and connect to every broker and database it names.

    Exit 0 when everything answers, 2 when the config is invalid (naming the
    file and field), 3 when a service is unreachable (naming which one).
    """
    setup_logs(log_level)
    settings = load(config)
    from ingest.cli.build import build_sink, describe_tier, dlq_dsn
    from ingest.drivers.postgres import check_dsn
    from ingest.sinks import registry
    from ingest.sources.kafka import check_broker

    problems: list[str] = []
    try:
        listed = check_broker(settings.kafka)
        typer.echo(f"ok   kafka {settings.kafka.bootstrap_servers}")
        for index, p in enumerate(settings.pipelines):
            _topics(p, listed)
            sink = build_sink(p, lanes=1)
            try:
                sink.check()
                tier = describe_tier(settings, p, sink)
                if p.auto_columns:
                    _auto_tables(settings, p, listed, sink)
            except ValueError as exc:  # a decoder the config cannot build: said by _schemas below
                tier = f"unknown ({exc})"
            finally:
                sink.close()
            described = registry.backend(p.sink.kind).describe(p.sink)
            typer.echo(f"ok   pipeline {p.name}: sink {p.sink.kind} {described}")
            if p.auto_columns:
                typer.echo(f"ok   pipeline {p.name}: columns auto: each table's columns and key from its records' "
                           f"schemas (evolve {p.sink.evolve}); a table is created by its first record or by migrate")
            for _, explode in p.explode_steps:  # written with the parent, in the same database
                child = registry.backend(p.sink.kind).describe(p.explode_sink(explode))
                typer.echo(f"ok   pipeline {p.name}: child {child} (explode {explode.path}"
                           f"{', replace' if explode.replace else ''})")
            typer.echo(f"ok   pipeline {p.name}: write tier: {tier}")
            if p.transforms:  # compiled when the file was loaded
                typer.echo(f"ok   pipeline {p.name}: {len(p.transforms)} transforms compiled "
                           f"({', '.join(step.label(i) for i, step in enumerate(p.transforms))})")
            if p.dlq.uses_postgres_table:
                check_dsn(dlq_dsn(p), f"postgres DLQ of pipeline {p.name!r}")
                typer.echo(f"ok   pipeline {p.name}: DLQ postgres table {p.dlq.table}")
            if not p.auto_columns:  # columns: auto reads whatever the schemas hold
                problems += _schemas(settings, p, f"pipelines[{index}].transforms")
    except ServiceUnreachable as exc:
        raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    if problems:
        raise fail(EXIT_CONFIG, "\n".join(f"FAIL {line}" for line in problems))
    typer.echo("config ok")


def _topics(p: Any, listed: list[str]) -> None:
    """A pipeline with topic patterns: the topics they match today (the run picks up new ones)."""
    selector = p.topic_selector
    if not selector.has_patterns:
        return
    matched = [t for t in selector.select(listed) if t not in selector.literals]
    patterns = " ".join(t for t in p.topics if t not in selector.literals)
    if matched:
        typer.echo(f"ok   pipeline {p.name}: topics matching {patterns}: {', '.join(matched)}")
        _routes(p, [t for t in selector.select(listed)])
    else:
        typer.echo(f"warn pipeline {p.name}: no topic matches {patterns} yet (a run picks up new ones "
                   f"every {p.topic_refresh_s:g} s)")


def _routes(p: Any, topics: list[str]) -> None:
    """A pipeline routing by a table template that reads the topic only: the table each topic goes to
    (a template reading the source block or a header is known per record only)."""
    if not p.routes_tables:
        return
    from ingest.mirror.router import tables_of_topics

    for topic, table, why in tables_of_topics(p, topics):
        if table is not None:
            typer.echo(f"ok   pipeline {p.name}: topic {topic} -> table {table}")
        else:
            typer.echo(f"warn pipeline {p.name}: topic {topic} cannot be routed: {why}")


def _auto_tables(settings: Any, p: Any, listed: list[str], sink: Any) -> None:
    """``columns: auto``: each routable topic's table as its latest registry schema would make it (exists,
    would be created, the columns it lacks, incompatible differences) -- nothing is changed."""
    from ingest.cli.mirror_plan import auto_table_plans, describe
    from ingest.mirror.router import tables_of_topics

    routes = tables_of_topics(p, p.topic_selector.select(listed), sink.existing_tables())
    for plan in auto_table_plans(settings, p, routes, sink, dry_run=True):
        head, *statements = describe(plan, dry_run=True)
        typer.echo(f"{head[:5]}pipeline {p.name}: {head[5:]}")
        for statement in statements:
            typer.echo(statement)


def _schemas(settings: Any, p: Any, where: str) -> list[str]:
    """Print the schema lines of a typed-format pipeline; return its problems."""
    from ingest.formats.check import check_schemas
    from ingest.formats.registry import build_decoder

    try:
        decoder = build_decoder(p, settings.schema_registry)
        key_decoder = build_decoder(p, settings.schema_registry, "key")
    except ValueError as exc:
        raise ConfigError(f"pipeline {p.name}: {exc}") from None
    report = check_schemas(p, decoder, key_decoder, where)
    for line in report.ok:
        typer.echo(f"ok   {line}")
    for line in report.warnings:
        typer.echo(f"warn {line}")
    return report.problems

"""``ingest migrate``: create every table the pipelines write (idempotent)."""

from __future__ import annotations

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
def migrate(config: ConfigOpt = None, pipeline: PipelineOpt = None, log_level: LogLevelOpt = "warning") -> None:
    """Create sink tables, the DLQ table and bookkeeping tables (idempotent: safe to run twice)."""
    setup_logs(log_level)
    settings = load(config)
    from ingest.migrate import migrate_pipeline

    try:
        for p in select(settings, pipeline):
            for line in migrate_pipeline(p):
                typer.echo(f"ok   {line}")
    except ServiceUnreachable as exc:
        raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    except IngestError as exc:
        raise fail(EXIT_FAILED, str(exc)) from None

"""The typer application and what every command shares: options, exit codes, loading, failing.

Exit codes: 0 success; 1 a pipeline failed (retries exhausted, DLQ guard,
--until-idle gave up) or a command did not complete; 2 invalid configuration
or usage; 3 a service named in the config is unreachable; 130 aborted by a
second signal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ingest import __version__
from ingest.config import PipelineSettings, Settings, load_settings
from ingest.errors import ConfigError

EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_ABORTED = 1, 2, 3, 130

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
OnePipelineOpt = Annotated[str, typer.Option("--pipeline", "-p", help="Pipeline name.")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error")]


def fail(code: int, message: str) -> typer.Exit:
    """Print ``error: <message>`` (configured secrets masked) to stderr; return the Exit to raise."""
    from ingest.redact import scrub

    typer.echo(f"error: {scrub(message)}", err=True)
    return typer.Exit(code)


def load(config: Path | None) -> Settings:
    """Load and validate the config; exit 2 naming the field on any problem."""
    from ingest.plugins import load_plugins

    load_plugins()
    try:
        return load_settings(config)
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None


def select(settings: Settings, names: list[str] | None) -> list[PipelineSettings]:
    if not names:
        return list(settings.pipelines)
    try:
        return [settings.pipeline(n) for n in names]
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None


def one(settings: Settings, name: str) -> PipelineSettings:
    try:
        return settings.pipeline(name)
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None


def setup_logs(level: str) -> None:
    from ingest.logs import setup_logging

    setup_logging(level)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)

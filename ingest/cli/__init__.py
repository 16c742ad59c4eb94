"""Command line: the composition root, one module per command group.

- :mod:`.app`: the typer app, shared options, exit codes, loading the config;
- :mod:`.build`: the only place adapters are built (sources, sinks, DLQs, pipelines);
- commands: :mod:`.check`, :mod:`.migrate`, :mod:`.run`, :mod:`.dlq`, :mod:`.replay`, :mod:`.preview`,
  :mod:`.lag`, :mod:`.demo`.

Exit codes: 0 success; 1 a pipeline failed or a command did not complete; 2 invalid
configuration or usage; 3 a service named in the config is unreachable; 130 aborted.
"""

from __future__ import annotations

import sys

import typer

from ingest.cli.app import EXIT_CONFIG, EXIT_FAILED, app
from ingest.errors import ConfigError, IngestError

# Importing the command modules registers their commands on `app`.
from ingest.cli import check, demo, dlq, lag, migrate, preview, replay, run  # noqa: E402,F401  isort: skip


def main() -> None:
    try:
        app()
    except IngestError as exc:
        from ingest.redact import scrub

        typer.echo(f"error: {scrub(str(exc))}", err=True)
        sys.exit(EXIT_FAILED if not isinstance(exc, ConfigError) else EXIT_CONFIG)


__all__ = ["app", "main"]

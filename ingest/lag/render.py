"""Rendering a :class:`~ingest.lag.model.LagReport`: one JSON document, or rich tables."""


from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)



from ingest.lag.model import LagReport, _iso


# --------------------------------------------------------------------------- rendering
def format_age(seconds: float | None) -> str:
    """``"-"``, ``"850ms"``, ``"12.3s"``, ``"4m05s"``, ``"2h07m"``, ``"3d04h"``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def render_json(report: LagReport, *, compact: bool = False) -> bytes:
    """The report as one JSON document (one line when ``compact``)."""
    import orjson

    return orjson.dumps(report.as_dict(), option=0 if compact else orjson.OPT_INDENT_2)


def render_tables(report: LagReport) -> list[Any]:
    """rich renderables: one table per pipeline, then a grand total line."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for pl in report.pipelines:
        title = (f"pipeline {pl.pipeline}  group {pl.group_id}  lag {pl.lag:,} records"
                 f"  oldest {format_age(pl.max_lag_s)}")
        table = Table(title=title, title_justify="left", show_footer=True)
        table.add_column("topic", footer="total", no_wrap=True)
        table.add_column("partition", justify="right")
        table.add_column("committed", justify="right")
        table.add_column("end", justify="right", footer=f"{sum(p.end for p in pl.partitions):,}")
        table.add_column("lag", justify="right", footer=f"{pl.lag:,}")
        table.add_column("oldest", justify="right", footer=format_age(pl.max_lag_s))
        table.add_column("", no_wrap=True)
        for p in pl.partitions:
            style = "bold red" if p.hot else ("yellow" if p.lag else "")
            table.add_row(
                p.topic, str(p.partition), "-" if p.committed is None else f"{p.committed:,}", f"{p.end:,}",
                Text(f"{p.lag:,}", style=style), format_age(p.lag_s),
                Text("HOT", style="bold red") if p.hot else ("no commit" if p.committed is None else ""),
            )
        out.append(table)
        for err in pl.errors:
            out.append(Text(f"error: {err}", style="red"))
    out.append(Text(f"total lag {report.lag:,} records over {len(report.pipelines)} pipeline(s) at "
                    f"{_iso(report.at_ms)}"))
    return out

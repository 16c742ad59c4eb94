"""``ingest preview``: what a pipeline would write for sample records (decode, transforms, mapping),
writing and committing nothing (the engine: :mod:`ingest.preview`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ingest.cli.app import (
    EXIT_CONFIG,
    EXIT_UNREACHABLE,
    ConfigOpt,
    LogLevelOpt,
    OnePipelineOpt,
    app,
    fail,
    load,
    one,
    setup_logs,
)
from ingest.errors import ConfigError, ServiceUnreachable


@app.command()
def preview(
    pipeline: OnePipelineOpt,
    config: ConfigOpt = None,
    from_file: Annotated[Optional[Path], typer.Option(
        "--from-file", help="JSONL sample: one record value per line (or, with --metadata, one record object).",
        exists=True, dir_okay=False)] = None,
    from_topic: Annotated[bool, typer.Option(
        "--from-topic", help="Read the first --limit records (default 20) of the pipeline's topics: no group "
        "joined, nothing committed.")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout", help="--from-topic: stop reading after this many "
                                             "seconds.")] = 10.0,
    metadata: Annotated[bool, typer.Option(
        "--metadata", help="Each line is {value, key, topic, partition, offset, timestamp, headers}.")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="At most this many records.")] = None,
    output: Annotated[str, typer.Option("--format", help="table (one line per record) | json")] = "table",
    log_level: LogLevelOpt = "warning",
) -> None:
    """Run decode, transforms and mapping on sample records and print the row each would give, the
    records filtered and the errors (as the DLQ would get them). Writes and commits nothing.

    Exit 0 (whatever the records gave), 2 for an invalid config or usage, 3 when --from-topic cannot
    reach the broker or the topic.
    """
    setup_logs(log_level)
    settings = load(config)
    p = one(settings, pipeline)
    if (from_file is None) == (not from_topic):
        raise fail(EXIT_CONFIG, "give the sample records: --from-file FILE.jsonl or --from-topic (one of them)")
    if output not in ("table", "json"):
        raise fail(EXIT_CONFIG, "--format must be table or json")
    from ingest.preview import preview as run_preview
    from ingest.preview import records_from_jsonl

    try:
        if from_file is not None:
            records: Any = records_from_jsonl(from_file, topic=p.topics[0], metadata=metadata, limit=limit)
        else:
            from ingest.sources.kafka_probe import sample_records

            records = sample_records(settings.kafka, list(p.topics), limit or 20, timeout_s)
        report = run_preview(settings, p, records)
    except ConfigError as exc:
        raise fail(EXIT_CONFIG, str(exc)) from None
    except ServiceUnreachable as exc:
        raise fail(EXIT_UNREACHABLE, f"unreachable: {exc}") from None
    import orjson

    if output == "json":
        typer.echo(orjson.dumps(report.as_dict(), default=str, option=orjson.OPT_INDENT_2).decode())
        return
    for kind, entries in (("row", report.rows), ("filtered", report.filtered), ("error", report.errors),
                          ("skipped", report.skipped)):
        for entry in entries:
            typer.echo(f"{kind:<8} {_where(entry)} {_rest(kind, entry, report.table)}")
    for table, entries in report.children.items():
        for entry in entries:
            if "row" in entry or "delete" in entry:
                typer.echo(f"{'row':<8} {_where(entry)} {_rest('row', entry, table)}")
            else:
                typer.echo(f"{'replace':<8} {_where(entry)} {table}: the other children of "
                           f"{orjson.dumps(entry['replaces_children_of'], default=str).decode()} are deleted")
    children = "".join(f", {sum(1 for e in entries if 'row' in e or 'delete' in e)} rows for {table}"
                       for table, entries in report.children.items())
    own = "" if "{" in report.table else f"{len(report.rows)} rows for {report.table}"
    typer.echo(f"{(own + children).lstrip(', ') or '0 rows'}, {len(report.filtered)} filtered, "
               f"{len(report.errors)} errors, {len(report.skipped)} without a row")


def _where(entry: dict[str, Any]) -> str:
    return f"{entry['topic']}[{entry['partition']}]@{entry['offset']}"


def _rest(kind: str, entry: dict[str, Any], table: str) -> str:
    import orjson

    if kind == "row":
        body = entry.get("row", entry.get("delete"))
        verb = "" if "row" in entry else "delete "
        return f"{table}: {verb}{orjson.dumps(body, default=str).decode()}"
    if kind == "filtered":
        return f"by {entry['step']}"
    if kind == "error":
        return f"{entry['stage']}/{entry['error_class']}: {entry['message']}"
    return entry["why"]

"""``ingest check`` for typed formats: the schema each topic's subject has now, and the configured
columns it lacks.

For every pipeline whose decoder knows schemas (``avro`` from a registry or an ``avro_schema`` file),
each value subject of its topics (by ``subject_strategy``) must exist in the registry, and every
``$`` path a column reads must be a field the latest schema can hold: a *required* column whose
field is missing is a problem (its records would all be dead-lettered); an optional one is a
warning (the column gets its default or NULL). A registry that cannot answer is unreachable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ingest.core.mapping.getters import _parse_path
from ingest.errors import ServiceUnreachable, TransientError


@dataclass
class SchemaReport:
    """What ``check`` prints for one pipeline: ``ok`` lines, warnings, and problems (exit 2)."""

    ok: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_schemas(pipeline: Any, decoder: Any, key_decoder: Any = None) -> SchemaReport:
    """The report for ``pipeline``'s values (``$`` sources) and, with a typed ``key_format``, its keys
    (``@key.$`` sources, subjects ``<topic>-key``); raises ServiceUnreachable when a registry cannot
    answer."""
    report = SchemaReport()
    _check(pipeline, decoder, pipeline.value_subjects(), "$", report)
    if key_decoder is not None:
        _check(pipeline, key_decoder, [f"{topic}-key" for topic in pipeline.literal_topics], "@key.$", report)
    return report


def _check(pipeline: Any, decoder: Any, subjects: list[str], prefix: str, report: SchemaReport) -> None:
    """Each subject's latest schema, and the columns whose sources (starting with ``prefix``) it lacks."""
    format_has_path = getattr(decoder, "has_path", None)
    if format_has_path is None:
        return
    # Change events (envelope debezium): the columns' $-paths read the row image, the ``after`` field.
    image = ((True, "after"),) if prefix == "$" and getattr(pipeline, "envelope", "none") == "debezium" else ()

    def has_path(schema: Any, steps: Any) -> bool:
        return bool(format_has_path(schema, (*image, *steps)))

    store = getattr(decoder, "store", None)
    if store is None:  # one schema from a file
        schema = decoder.file_schema
        _columns(pipeline, prefix, lambda steps: has_path(schema, steps), decoder.describe(None), report)
        return
    for subject in subjects:
        try:
            latest = store.latest(subject)
            parsed = None if latest is None else store.get(latest.schema_id)
        except TransientError as exc:
            raise ServiceUnreachable(f"schema registry of pipeline {pipeline.name!r}", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - InvalidRecord (a schema the format cannot use), fatal
            report.problems.append(f"pipeline {pipeline.name}: subject {subject}: {exc}")
            continue
        if latest is None:
            report.problems.append(
                f"pipeline {pipeline.name}: subject {subject} is not in the schema registry at {store.where} "
                f"(subject_strategy {pipeline.subject_strategy}): is the url or the strategy wrong?")
            continue
        what = f"subject {subject} version {latest.version} (schema id {latest.schema_id})"
        report.ok.append(f"pipeline {pipeline.name}: {what}")
        _columns(pipeline, prefix, lambda steps, s=parsed: has_path(s, steps), what, report)


def _columns(pipeline: Any, prefix: str, holds: Any, what: str, report: SchemaReport) -> None:
    """Report the columns reading a path under ``prefix`` (``$`` or ``@key.$``) that ``holds`` denies."""
    for name, spec in pipeline.sink.columns.items():
        source = spec.source or f"$.{name}"
        if not source.startswith(prefix) or (prefix == "$" and source.startswith("@")):
            continue
        if holds(_parse_path(source[len(prefix) - 1:])):
            continue
        message = f"pipeline {pipeline.name}: column {name} (source {source}) is not a field of {what}"
        if spec.required:
            report.problems.append(message + ": every record would be dead-lettered")
        else:
            report.warnings.append(message + ": it will get its default or NULL")

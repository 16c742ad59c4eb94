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


def check_schemas(pipeline: Any, decoder: Any) -> SchemaReport:
    """The report for ``pipeline``; raises ServiceUnreachable when its registry cannot answer."""
    report = SchemaReport()
    has_path = getattr(decoder, "has_path", None)
    if has_path is None:
        return report
    store = getattr(decoder, "store", None)
    if store is None:  # one schema from a file
        schema = decoder.file_schema
        _columns(pipeline, lambda steps: has_path(schema, steps), decoder.describe(None), report)
        return report
    for subject in pipeline.value_subjects():
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
        _columns(pipeline, lambda steps, s=parsed: has_path(s, steps), what, report)
    return report


def _columns(pipeline: Any, holds: Any, what: str, report: SchemaReport) -> None:
    for name, spec in pipeline.sink.columns.items():
        source = spec.source or f"$.{name}"
        if not source.startswith("$") or holds(_parse_path(source)):
            continue
        message = f"pipeline {pipeline.name}: column {name} (source {source}) is not a field of {what}"
        if spec.required:
            report.problems.append(message + ": every record would be dead-lettered")
        else:
            report.warnings.append(message + ": it will get its default or NULL")

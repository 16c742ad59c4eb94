"""``ingest check`` for typed formats: the schema each topic's subject has now, and the configured
columns it lacks.

For every pipeline whose decoder knows schemas (``avro`` from a registry or an ``avro_schema`` file),
each value subject of its topics (by ``subject_strategy``) must exist in the registry, and every
``$`` path a column reads must be a field the latest schema can hold: a *required* column whose
field is missing is a problem (its records would all be dead-lettered); an optional one is a
warning (the column gets its default or NULL). A registry that cannot answer is unreachable.

With ``transforms``, columns read the transformed value: a column's path is traced back through the
steps (:mod:`ingest.core.transforms.fields`; a field a step produced is not looked up), and every
``value.a.b`` an expression reads must be a field of the schema too (a problem: the step would fail
every record that reaches it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ingest.core.mapping.getters import _parse_path
from ingest.core.transforms.fields import column_origin, transform_problems
from ingest.errors import ServiceUnreachable, TransientError


@dataclass
class SchemaReport:
    """What ``check`` prints for one pipeline: ``ok`` lines, warnings, and problems (exit 2)."""

    ok: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_schemas(pipeline: Any, decoder: Any, key_decoder: Any = None, where: str | None = None) -> SchemaReport:
    """The report for ``pipeline``'s values (``$`` sources, and the fields its transforms read) and,
    with a typed ``key_format``, its keys (``@key.$`` sources, subjects ``<topic>-key``); raises
    ServiceUnreachable when a registry cannot answer. ``where``: the config path of the pipeline's
    transforms (``pipelines[0].transforms``) for the problems that name a step."""
    report = SchemaReport()
    _check(pipeline, decoder, pipeline.value_subjects(), "$", report,
           where or f"pipeline {pipeline.name}: transforms")
    if key_decoder is not None:
        _check(pipeline, key_decoder, [f"{topic}-key" for topic in pipeline.literal_topics], "@key.$", report)
    return report


def file_schema_problems(pipeline: Any, decoder: Any, where: str) -> list[str]:
    """The transforms' problems against a schema the pipeline declares in a file (``avro_schema``):
    checked at start-up too, since it needs no registry (empty for every other decoder)."""
    if decoder is None or getattr(decoder, "store", None) is not None or not hasattr(decoder, "file_schema"):
        return []
    format_has_path = getattr(decoder, "has_path", None)
    if format_has_path is None:
        return []
    report = SchemaReport()
    image = ((True, "after"),) if getattr(pipeline, "envelope", "none") == "debezium" else ()
    schema = decoder.file_schema
    _transforms(pipeline, "$", lambda steps: bool(format_has_path(schema, (*image, *steps))),
                decoder.describe(None), report, where)
    return report.problems


def _check(pipeline: Any, decoder: Any, subjects: list[str], prefix: str, report: SchemaReport,
           where: str = "transforms") -> None:
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
        _transforms(pipeline, prefix, lambda steps: has_path(schema, steps), decoder.describe(None), report, where)
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
        _transforms(pipeline, prefix, lambda steps, s=parsed: has_path(s, steps), what, report, where)


def _transforms(pipeline: Any, prefix: str, holds: Any, what: str, report: SchemaReport, where: str) -> None:
    """Report every field the transforms' expressions read that ``holds`` denies (values only)."""
    steps = list(getattr(pipeline, "transforms", None) or [])
    if prefix != "$" or not steps:
        return
    for problem in transform_problems(steps, where, lambda path: holds(tuple((True, p) for p in path)), what):
        report.problems.append(f"pipeline {pipeline.name}: {problem}: every record reaching it would be "
                               "dead-lettered")


def _columns(pipeline: Any, prefix: str, holds: Any, what: str, report: SchemaReport) -> None:
    """Report the columns reading a path under ``prefix`` (``$`` or ``@key.$``) that ``holds`` denies."""
    for name, spec in pipeline.sink.columns.items():
        source = spec.source or f"$.{name}"
        if not source.startswith(prefix) or (prefix == "$" and source.startswith("@")):
            continue
        path = _parse_path(source[len(prefix) - 1:])
        steps = list(getattr(pipeline, "transforms", None) or []) if prefix == "$" else []
        dropped = False
        if steps and path and path[0][0]:  # the column reads the transformed value: trace it back
            origin = column_origin(steps, str(path[0][1]))
            if origin is None:
                continue  # a field the transforms produce (or after a flatten): not in the schema
            dropped = origin == "dropped"
            path = path if dropped else ((True, origin[0]), *path[1:])
        if not dropped and holds(path):
            continue
        message = (f"pipeline {pipeline.name}: column {name} (source {source}) is "
                   + ("dropped by the transforms" if dropped else f"not a field of {what}"))
        if spec.required:
            report.problems.append(message + ": every record would be dead-lettered")
        else:
            report.warnings.append(message + ": it will get its default or NULL")

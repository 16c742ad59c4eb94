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
from ingest.errors import InvalidRecord, ServiceUnreachable, TransientError


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


def registry_schema_problems(pipeline: Any, decoder: Any, where: str) -> SchemaReport:
    """The transforms' problems against the latest schema of each value subject of a registry format
    (``report.problems``; the columns are ``ingest check``'s alone), and a warning per subject the
    registry does not hold yet (nothing to check against: no refusal). Empty for a decoder without a
    registry or a pipeline without transforms. Raises :class:`~ingest.errors.TransientError` when the
    registry cannot answer -- never a problem: an outage is not a refusal."""
    report = SchemaReport()
    store = getattr(decoder, "store", None)
    format_has_path = getattr(decoder, "has_path", None)
    if store is None or format_has_path is None or not getattr(pipeline, "transforms", None):
        return report
    image = ((True, "after"),) if getattr(pipeline, "envelope", "none") == "debezium" else ()
    for subject in pipeline.value_subjects():
        latest = store.latest(subject)
        if latest is None:
            report.warnings.append(f"pipeline {pipeline.name}: subject {subject} is not in the schema registry at "
                                   f"{store.where} yet: the transforms are not checked against it")
            continue
        try:
            parsed = store.get(latest.schema_id)
        except InvalidRecord as exc:  # a schema the format cannot use: its records' own decode reports it
            report.warnings.append(f"pipeline {pipeline.name}: subject {subject}: {exc}")
            continue
        what = f"subject {subject} version {latest.version} (schema id {latest.schema_id})"
        _transforms(pipeline, "$", lambda steps, s=parsed: bool(format_has_path(s, (*image, *steps))), what,
                    report, where)
    return report


def check_transforms_at_start(pipeline: Any, decoder: Any, where: str, log: Any) -> None:
    """``ingest run``'s start-up check of the transforms against the schemas they read (``where``: the
    config path of the list, ``pipelines[0].transforms``).

    A schema in a file (``avro_schema``) or a registry that answers: raises ConfigError listing the
    expressions reading a field the schema lacks (exit 2, before any adapter is built). A registry
    that cannot answer now: logs a warning and defers the same check to the moment the pipeline
    first fetches schemas (:meth:`~ingest.formats.registered.RegistryDecoder.defer_check`): until the
    registry answers, the polled records are held as in any registry outage (nothing decoded,
    dead-lettered or committed); a check that then finds problems stops the pipeline
    (FatalPipelineError, exit 1, the same lines). So an outage is never a false refusal, and a
    refused expression never dead-letters the records it would have failed.
    """
    from ingest.errors import ConfigError, FatalPipelineError

    problems = file_schema_problems(pipeline, decoder, where)
    if problems:
        raise ConfigError("\n".join(problems))
    if getattr(decoder, "store", None) is None or not getattr(pipeline, "transforms", None):
        return

    def report() -> list[str]:
        checked = registry_schema_problems(pipeline, decoder, where)
        for line in checked.warnings:
            log.warning(line, extra={"pipeline": pipeline.name})
        return checked.problems

    try:
        problems = report()
    except TransientError as exc:
        log.warning("schema registry cannot answer at start-up: the transforms are checked against the "
                    "subjects' schemas once it answers, before the first record is decoded",
                    extra={"pipeline": pipeline.name, "error": str(exc)})

        def deferred() -> None:
            found = report()  # TransientError: the chunk is held and this is tried again
            log.info("transforms checked against the schema registry", extra={"pipeline": pipeline.name,
                                                                              "problems": len(found)})
            if found:
                raise FatalPipelineError("\n".join(found), error_class="transform_schema")

        decoder.defer_check(deferred)
        return
    if problems:
        raise ConfigError("\n".join(problems))


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

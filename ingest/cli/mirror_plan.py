"""What ``ingest migrate`` and ``ingest check`` do with the tables of a ``columns: auto`` pipeline.

For each topic that exists now and whose table the template names from the topic alone
(:func:`ingest.mirror.router.tables_of_topics`), the table is planned from the latest schemas the
registry holds for the topic's value and key (a registry ``key_format``): created or evolved by
``migrate``, only described by ``migrate --dry-run`` and ``check``. A topic without a registered
schema, keys that are not in a registry format (their fields name the key per record), Kafka Connect
JSON (whose schema is in each record) and templates reading the records (``{source.table}``, headers)
leave the table to its first record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ingest.errors import InvalidRecord

__all__ = ["AutoTablePlan", "auto_table_plans", "describe"]


@dataclass(frozen=True)
class AutoTablePlan:
    """One topic's table: the DDL result (None when it is left to the first record, ``why``)."""

    topic: str
    table: str
    result: Any = None
    why: str = ""


def auto_table_plans(settings: Any, p: Any, routes: list[tuple[str, str | None, str | None]], sink: Any, *,
                     dry_run: bool) -> Iterator[AutoTablePlan]:
    """The plans of ``routes`` (``(topic, table, why not)`` of routable topics) of pipeline ``p``."""
    from ingest.cdc.mapper import mapper_for
    from ingest.formats.registry import build_decoder

    decoder = build_decoder(p, settings.schema_registry)
    key_decoder = build_decoder(p, settings.schema_registry, "key")
    store = getattr(decoder, "store", None)
    key_store = getattr(key_decoder, "store", None)
    mapper = mapper_for(p, decoder=decoder, key_decoder=key_decoder)
    for topic, table, _why in routes:
        if table is None:
            continue
        if store is None:
            yield AutoTablePlan(topic, table, why="each record carries its schema: made by the first record")
            continue
        if key_store is None:  # a plain JSON key names the key columns per record: only a record knows them
            yield AutoTablePlan(topic, table, why="its key comes with each record (key_format is not a registry "
                                "format): made by the first record")
            continue
        latest = store.latest(_subject(p, topic))
        if latest is None:
            yield AutoTablePlan(topic, table, why="no schema registered for the topic yet: made by the first record")
            continue
        key = key_store.latest(f"{topic}-key") if key_store is not None else None
        try:
            shape = mapper.table_shape(table, latest.schema_id, key.schema_id if key is not None else None)
        except InvalidRecord as exc:
            yield AutoTablePlan(topic, table, why=f"its schema cannot be a table: {exc.message}")
            continue
        yield AutoTablePlan(topic, table, sink.plan_auto_table(table, shape, dry_run=dry_run))


def describe(plan: AutoTablePlan, *, dry_run: bool) -> list[str]:
    """Lines for one plan: ``ok``/``warn`` and the DDL (run, or with ``dry_run`` to run)."""
    where = f"table {plan.table} (topic {plan.topic})"
    result = plan.result
    if result is None:
        return [f"ok   {where}: {plan.why}"]
    if result.action == "incompatible":
        return [f"warn {where}: incompatible with its latest schema: {result.incompatible} (its records will be "
                "dead-lettered schema_incompatible until the table is fixed)"]
    verb = {"created": "would be created" if dry_run else "created",
            "altered": "would be altered" if dry_run else "altered",
            "unchanged": "exists and takes its latest schema"}[result.action]
    return [f"ok   {where}: {verb}", *(f"       {statement};" for statement in result.statements)]


def _subject(p: Any, topic: str) -> str:
    if p.subject_strategy == "record_name":
        return str(p.record_name)
    if p.subject_strategy == "topic_record_name":
        return f"{topic}-{p.record_name}"
    return f"{topic}-value"

"""``ingest preview``: decode, transform and map sample records as the pipeline would, writing nothing.

:func:`preview` runs the pipeline's own mapper (:func:`ingest.cdc.mapper.mapper_for`: decode, the
current transforms, mapping) on records and reports, per record, the row its table would get, the
filter that dropped it, or the error that would dead-letter it (stage, class, message). Nothing is
written, nothing is committed, no service is reached (registry-backed formats excepted: their
decoders fetch schemas). The tests run the same engine.

:func:`records_from_jsonl` reads sample records from a JSONL file: by default each line is a record
value (its bytes, as they would arrive); with ``metadata=True`` each line is an object
``{"value": ..., "key": ..., "topic": ..., "partition": ..., "offset": ..., "timestamp": ...,
"headers": {...}}`` (``value`` any JSON, ``value_text`` for bytes given as text, or ``value_base64``
for exact bytes, e.g. Avro in the wire format).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.errors import ConfigError, Filtered, InvalidRecord, NoChange
from ingest.formats.registry import build_decoder
from ingest.types import DeleteRow, Record

_HIDDEN_PREFIX = "_ingest_"


@dataclass
class PreviewReport:
    """What the pipeline would do with the sample: rows by table, filtered, errors, records with no row."""

    pipeline: str
    table: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    filtered: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    #: the child tables' rows (``explode`` steps), by table; with ``replace`` each parent's entry also
    #: says its other children would be deleted
    children: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "tables": {self.table: self.rows, **self.children},
                "filtered": self.filtered, "errors": self.errors, "skipped": self.skipped}


def preview(settings: Any, p: PipelineSettings, records: Iterable[Record]) -> PreviewReport:
    """Map ``records`` with pipeline ``p``'s decoder, transforms and columns (``settings``: the whole
    configuration, for the schema registry). Raises ConfigError for settings that cannot map."""
    try:
        decoder = build_decoder(p, settings.schema_registry)
        key_decoder = build_decoder(p, settings.schema_registry, "key")
    except ValueError as exc:
        raise ConfigError(f"pipeline {p.name}: {exc}") from None
    mapper = mapper_for(p, decoder=decoder, key_decoder=key_decoder)
    table = getattr(p.sink, "table", p.name)
    report = PreviewReport(p.name, table)
    names = mapper.column_names
    explodes = [(e, list(p.explode_columns(e))) for _, e in p.explode_steps]
    for e, _ in explodes:
        report.children[e.table] = []
    for rec in records:
        where = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset}
        try:
            row, _ = mapper.map(rec)
        except InvalidRecord as exc:
            report.errors.append({**where, "stage": exc.stage, "error_class": exc.error_class,
                                  "message": exc.message})
            continue
        except Filtered as exc:
            report.filtered.append({**where, "step": exc.step})
            continue
        except NoChange as exc:
            report.skipped.append({**where, "why": str(exc)})
            continue
        # the sink's hidden bookkeeping columns (_ingest_*) are not the user's: not shown
        if p.auto_columns:  # a carrier (ingest.mirror.auto): the columns its schema gives
            from ingest.mirror.auto import carrier_values

            values = carrier_values(row)
        else:
            values = {n: v for n, v in zip(names, row, strict=False) if not n.startswith(_HIDDEN_PREFIX)}
        entry = {**where, "delete": values} if isinstance(row, DeleteRow) else {**where, "row": values}
        if p.routes_tables:  # the row's table rides at its end (ingest.mirror.router)
            report.children.setdefault(row[-1], []).append(entry)
        else:
            report.rows.append(entry)
        for (explode, child_names), family in zip(explodes, getattr(row, "families", ()), strict=False):
            if family is None:
                continue
            link, child_rows = family
            shown = report.children[explode.table]
            if explode.replace:
                shown.append({**where, "replaces_children_of": dict(zip(explode.parent, link, strict=True))})
            shown.extend({**where, "row": {n: v for n, v in zip(child_names, child, strict=False)
                                           if not n.startswith(_HIDDEN_PREFIX)}} for child in child_rows)
    return report


def records_from_jsonl(path: Path, *, topic: str, metadata: bool = False, limit: int | None = None) -> Iterator[Record]:
    """Sample records from a JSONL file (see the module docstring); offsets count lines from 0 unless
    a line gives its own. Blank lines are skipped. Raises ConfigError naming a line that is not JSON
    where JSON is needed (``metadata=True``)."""
    n = 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not line:
                continue
            if limit is not None and n >= limit:
                return
            if not metadata:
                yield Record(topic, 0, n, None, line, None)
            else:
                yield _record(line, topic, n, f"{path}:{number}")
            n += 1


def _record(line: bytes, topic: str, n: int, where: str) -> Record:
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from None
    if type(doc) is not dict:
        raise ConfigError(f"{where}: with --metadata each line is an object with value, key, topic, ...")
    if "value_base64" in doc:  # the exact bytes: a typed format's wire format, or anything not text
        try:
            value = None if doc["value_base64"] is None else base64.b64decode(doc["value_base64"], validate=True)
        except (ValueError, TypeError):
            raise ConfigError(f"{where}: value_base64 is not base64") from None
    elif "value_text" in doc:
        value = None if doc["value_text"] is None else str(doc["value_text"]).encode()
    else:
        value = None if doc.get("value") is None else orjson.dumps(doc["value"])
    key = doc.get("key")
    headers = tuple((str(k), None if v is None else str(v).encode()) for k, v in (doc.get("headers") or {}).items())
    return Record(str(doc.get("topic", topic)), int(doc.get("partition", 0)), int(doc.get("offset", n)),
                  None if key is None else (key if isinstance(key, str) else orjson.dumps(key).decode()).encode(),
                  value, None if doc.get("timestamp") is None else int(doc["timestamp"]), headers)

"""Parsing Avro schema text (pure: the text in, fastavro's parsed schema out, no I/O).

Shared by configuration (``avro_schema: FILE`` must hold a valid schema, checked when the
config is loaded) and by ``format: avro`` (:func:`ingest.formats.avro.parse_avro`, which
first gathers the schemas a registry schema references).
"""

from __future__ import annotations

import json
from typing import Any


def parse_avro_text(text: str, named: dict[str, Any] | None = None) -> Any:
    """``text`` (an Avro schema as JSON) parsed for fastavro, resolving names against ``named`` (the
    schemas it references, already parsed). Raises ValueError when it is not a usable Avro schema."""
    from fastavro import parse_schema

    try:
        return parse_schema(json.loads(text), named_schemas={} if named is None else named)
    except Exception as exc:  # noqa: BLE001 - fastavro raises SchemaParseException, KeyError, ...
        raise ValueError(f"not a valid Avro schema: {type(exc).__name__}: {exc}"[:300]) from None

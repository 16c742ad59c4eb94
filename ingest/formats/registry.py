"""The format registry: ``format:`` → its decoder class. The only place formats are told apart.

Built-in formats are registered by import path (their libraries load only when
used); a plugin adds one with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ingest.formats.base import Decoder

_formats: dict[str, Any] = {
    "json": "ingest.formats.json:JsonDecoder",
    "avro": "ingest.formats.avro:AvroDecoder",
    "json_schema": "ingest.formats.json_schema:JsonSchemaDecoder",
    "protobuf": "ingest.formats.protobuf:ProtobufDecoder",
}


def register(name: str, decoder: Any) -> None:
    """Register (or replace) a format: its decoder class (or ``module:Class``), built with the pipeline."""
    _formats[name] = decoder


def names() -> list[str]:
    return list(_formats)


def decoder_class(name: str) -> type:
    """The decoder class of ``name``. Raises KeyError for an unknown format."""
    entry = _formats[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _formats[name] = getattr(importlib.import_module(module), attr)
    return entry  # type: ignore[no-any-return]


def _format_of(pipeline: Any, field: str) -> str | None:
    """The format of ``pipeline``'s values or keys; None for raw keys."""
    if field == "value":
        return pipeline.format  # type: ignore[no-any-return]
    key_format = getattr(pipeline, "key_format", "raw")
    return None if key_format == "raw" else key_format  # type: ignore[no-any-return]


def uses_schema_registry(pipeline: Any) -> bool:
    """Whether ``pipeline``'s value or key format looks schemas up in the ``schema_registry`` section
    (a decoder class says so with a ``uses_schema_registry(pipeline, field)`` static method)."""
    for field in ("value", "key"):
        name = _format_of(pipeline, field)
        check = getattr(decoder_class(name), "uses_schema_registry", None) if name else None
        if check is not None and check(pipeline, field):
            return True
    return False


def build_decoder(pipeline: Any, schema_registry: Any = None, field: str = "value") -> Decoder | None:
    """The decoder of ``pipeline.format`` (``field="key"``: of ``key_format``, None for raw keys),
    built with the pipeline's settings -- and the ``schema_registry`` settings when its class uses a
    registry. Raises ValueError for settings the format cannot work with."""
    name = _format_of(pipeline, field)
    if name is None:
        return None
    cls = decoder_class(name)
    if hasattr(cls, "uses_schema_registry"):
        return cls(pipeline, schema_registry, field)  # type: ignore[no-any-return]
    if field == "key":
        return cls(pipeline, field)  # type: ignore[no-any-return]
    return cls(pipeline)  # type: ignore[no-any-return]

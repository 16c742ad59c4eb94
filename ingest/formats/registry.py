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


def uses_schema_registry(pipeline: Any) -> bool:
    """Whether ``pipeline``'s format looks schemas up in the ``schema_registry`` section (a decoder
    class says so with a ``uses_schema_registry(pipeline)`` static method)."""
    check = getattr(decoder_class(pipeline.format), "uses_schema_registry", None)
    return bool(check is not None and check(pipeline))


def build_decoder(pipeline: Any, schema_registry: Any = None) -> Decoder:
    """The decoder of ``pipeline.format``, built with the pipeline's settings -- and the
    ``schema_registry`` settings when its class uses a registry. Raises ValueError for settings the
    format cannot work with (an unreadable ``avro_schema``)."""
    cls = decoder_class(pipeline.format)
    if hasattr(cls, "uses_schema_registry"):
        return cls(pipeline, schema_registry)  # type: ignore[no-any-return]
    return cls(pipeline)  # type: ignore[no-any-return]

"""The format registry: ``format:`` → its decoder class. The only place formats are told apart.

Built-in formats are registered by import path (their libraries load only when
used); a plugin adds one with :func:`register`. The table itself is
:data:`ingest.config.kinds.FORMATS`, so that configuration can validate format
names without importing any decoder; this module adds building decoders.
"""

from __future__ import annotations

from typing import Any

from ingest.config.kinds import FORMATS as _formats  # noqa: F401 - the table (tests add formats to it)
from ingest.config.kinds import decoder_class, uses_schema_registry
from ingest.config.kinds import format_names as names
from ingest.config.kinds import format_of as _format_of
from ingest.config.kinds import register_format as register
from ingest.formats.base import Decoder

__all__ = ["build_decoder", "decoder_class", "names", "register", "uses_schema_registry"]


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

"""The settings-side registry: what configuration needs to know about pluggable kinds, nothing more.

Validating a configuration names two kinds of plugin points:

- a sink ``kind``: its settings class (a :class:`~ingest.config.base.SinkSettingsBase`
  subclass) validates the ``sink`` section, and whether the kind can write deletes decides
  whether a pipeline with deletes is valid;
- a ``format`` / ``key_format``: its name must be known, and its decoder class says whether
  it looks schemas up in the ``schema_registry`` section.

This module holds exactly that, by ``"module:attr"`` path or object, resolved lazily with
:mod:`importlib` on first use, so importing :mod:`ingest.config` imports no backend, driver
or runner. Its contract: it imports nothing of ingest but :mod:`ingest.config` itself
(``tests/unit/test_import_graph.py`` checks it).

The runtime registries build on it and are where plugins register:
:func:`ingest.sinks.registry.register` (settings class + backend; it passes this module the
settings class, and the backend's ``capabilities.deletes`` as a function asked only when a
pipeline with deletes is validated) and :func:`ingest.formats.registry.register` (whose
table *is* :data:`FORMATS`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest.config.base import SinkSettingsBase


def resolve(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"module:attr"`` string names (importing the module)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass
class _SinkKind:
    settings: Any  # "module:attr" or the class
    deletes: bool | Callable[[], bool]  # or a function answering it, asked when needed


_lock = threading.Lock()
_sinks: dict[str, _SinkKind] = {
    # deletes: what the backends' Capabilities declare (tests/unit/test_config_kinds.py compares them).
    "postgres": _SinkKind("ingest.sinks.postgres.settings:PostgresSinkSettings", deletes=True),
    "clickhouse": _SinkKind("ingest.sinks.clickhouse.settings:ClickHouseSinkSettings", deletes=True),
}


def register_sink(kind: str, *, settings: Any, deletes: bool | Callable[[], bool]) -> None:
    """Register (or replace) sink kind ``kind``: its settings class (or ``module:attr``) and whether it can
    write deletes (or a function without arguments answering that, called when first needed)."""
    with _lock:
        _sinks[kind] = _SinkKind(settings, deletes)


def sink_kinds() -> list[str]:
    """The registered sink kinds, built-in ones first."""
    return list(_sinks)


def sink_settings_class(kind: str) -> type[SinkSettingsBase]:
    """The settings class of ``kind``. Raises KeyError for an unknown kind."""
    entry = _sinks[kind]
    entry.settings = resolve(entry.settings)
    return entry.settings  # type: ignore[no-any-return]


def sink_deletes(kind: str) -> bool:
    """Whether sink kind ``kind`` can write deletes (its backend's ``capabilities.deletes``).
    Raises KeyError for an unknown kind."""
    entry = _sinks[kind]
    if callable(entry.deletes):
        entry.deletes = bool(entry.deletes())
    return entry.deletes


#: ``format:`` name → its decoder class or ``"module:Class"`` (the table :mod:`ingest.formats.registry`
#: serves): built-in formats by path, so their libraries load only when used.
FORMATS: dict[str, Any] = {
    "json": "ingest.formats.json:JsonDecoder",
    "avro": "ingest.formats.avro:AvroDecoder",
    "json_schema": "ingest.formats.json_schema:JsonSchemaDecoder",
    "protobuf": "ingest.formats.protobuf:ProtobufDecoder",
}


def register_format(name: str, decoder: Any) -> None:
    """Register (or replace) a format: its decoder class (or ``module:Class``), built with the pipeline."""
    FORMATS[name] = decoder


def format_names() -> list[str]:
    """The registered formats, built-in ones first."""
    return list(FORMATS)


def decoder_class(name: str) -> type:
    """The decoder class of format ``name``. Raises KeyError for an unknown format."""
    entry = FORMATS[name]
    if isinstance(entry, str):
        entry = FORMATS[name] = resolve(entry)
    return entry  # type: ignore[no-any-return]


def format_of(pipeline: Any, field: str) -> str | None:
    """The format of ``pipeline``'s values (``field="value"``) or keys (``"key"``); None for raw keys."""
    if field == "value":
        return pipeline.format  # type: ignore[no-any-return]
    key_format = getattr(pipeline, "key_format", "raw")
    return None if key_format == "raw" else key_format  # type: ignore[no-any-return]


def uses_schema_registry(pipeline: Any) -> bool:
    """Whether ``pipeline``'s value or key format looks schemas up in the ``schema_registry`` section
    (a decoder class says so with a ``uses_schema_registry(pipeline, field)`` static method)."""
    for field in ("value", "key"):
        name = format_of(pipeline, field)
        check = getattr(decoder_class(name), "uses_schema_registry", None) if name else None
        if check is not None and check(pipeline, field):
            return True
    return False

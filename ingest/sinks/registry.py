"""The sink registry: sink kind → its settings class and its backend. The only place kinds are told apart.

Built-in kinds are registered by import path, so a kind's driver is imported
only when a pipeline uses it. A plugin registers its own kind with one call to
:func:`register` (see :mod:`ingest.plugins`); the settings and the backend may
then be objects as well as paths.

Nothing outside this module branches on a sink's kind: the rest of ingest asks
the backend (:class:`ingest.sinks.base.SinkBackend`) and the settings
(:class:`ingest.config.base.SinkSettingsBase`) what it needs.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest.config.base import SinkSettingsBase
    from ingest.sinks.base import SinkBackend


@dataclass
class _Entry:
    settings: Any  # "module:attr" or the class
    backend: Any  # "module:attr" or the object


_lock = threading.Lock()
_entries: dict[str, _Entry] = {
    "postgres": _Entry("ingest.sinks.postgres.settings:PostgresSinkSettings", "ingest.sinks.postgres.backend:BACKEND"),
    "clickhouse": _Entry("ingest.sinks.clickhouse.settings:ClickHouseSinkSettings",
                         "ingest.sinks.clickhouse.backend:BACKEND"),
}


def register(kind: str, *, settings: Any, backend: Any) -> None:
    """Register (or replace) a sink kind: its settings class and its backend, as objects or ``module:attr``."""
    with _lock:
        _entries[kind] = _Entry(settings, backend)


def kinds() -> list[str]:
    """The registered sink kinds, built-in ones first."""
    return list(_entries)


def _resolve(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    module, _, attr = value.partition(":")
    return getattr(importlib.import_module(module), attr)


def settings_class(kind: str) -> type[SinkSettingsBase]:
    """The settings class of ``kind``. Raises KeyError for an unknown kind."""
    entry = _entries[kind]
    entry.settings = _resolve(entry.settings)
    return entry.settings  # type: ignore[no-any-return]


def backend(kind: str) -> SinkBackend:
    """The backend of ``kind``. Raises KeyError for an unknown kind."""
    entry = _entries[kind]
    entry.backend = _resolve(entry.backend)
    return entry.backend  # type: ignore[no-any-return]

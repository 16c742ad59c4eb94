"""The sink registry: sink kind → its settings class and its backend. The only place kinds are told apart.

Built-in kinds are registered by import path, so a kind's driver is imported
only when a pipeline uses it. A plugin registers its own kind with one call to
:func:`register` (see :mod:`ingest.plugins`); the settings and the backend may
then be objects as well as paths.

Settings classes live in the settings-side registry, :mod:`ingest.config.kinds`
(configuration finds them there without importing any backend); this module
keeps the backends and, on :func:`register`, tells that registry the settings
class and whether the backend can write deletes. :func:`kinds` and
:func:`settings_class` read it.

Nothing outside this module branches on a sink's kind: the rest of ingest asks
the backend (:class:`ingest.sinks.base.SinkBackend`) and the settings
(:class:`ingest.config.base.SinkSettingsBase`) what it needs.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from ingest.config import kinds as settings_kinds
from ingest.config.kinds import resolve as _resolve

if TYPE_CHECKING:
    from ingest.config.base import SinkSettingsBase
    from ingest.sinks.base import SinkBackend

_lock = threading.Lock()
#: kind → its backend, or ``module:attr`` naming it (its settings class: in ingest.config.kinds)
_backends: dict[str, Any] = {
    "postgres": "ingest.sinks.postgres.backend:BACKEND",
    "clickhouse": "ingest.sinks.clickhouse.backend:BACKEND",
}


def register(kind: str, *, settings: Any, backend: Any) -> None:
    """Register (or replace) a sink kind: its settings class and its backend, as objects or ``module:attr``.

    The backend stays unresolved: whether it writes deletes is asked of it only when a pipeline
    of this kind with deletes is validated."""
    with _lock:
        _backends[kind] = backend
    settings_kinds.register_sink(kind, settings=settings, deletes=functools.partial(_writes_deletes, kind))


def _writes_deletes(kind: str) -> bool:
    return backend(kind).capabilities.deletes


def kinds() -> list[str]:
    """The registered sink kinds, built-in ones first."""
    return settings_kinds.sink_kinds()


def settings_class(kind: str) -> type[SinkSettingsBase]:
    """The settings class of ``kind``. Raises KeyError for an unknown kind."""
    return settings_kinds.sink_settings_class(kind)


def backend(kind: str) -> SinkBackend:
    """The backend of ``kind``. Raises KeyError for an unknown kind."""
    entry = _backends[kind] = _resolve(_backends[kind])
    return entry  # type: ignore[no-any-return]

"""Plugins: extra sink kinds (and anything else registered the same way) without changing ingest.

A plugin is a module that registers what it adds when imported, e.g.
``ingest.sinks.registry.register("sqlite", settings=..., backend=...)``. The CLI
imports, once, before it loads the configuration:

- every module named in ``INGEST_PLUGINS`` (comma-separated ``package.module`` names);
- every entry point of group ``ingest.plugins`` of the installed distributions.

A plugin that cannot be imported is a configuration error (exit 2) naming it.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from ingest.errors import ConfigError

_loaded = False


def load_plugins() -> None:
    """Import the configured plugins (idempotent). Raises ConfigError naming a plugin that fails."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    names = [n.strip() for n in os.environ.get("INGEST_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported as a configuration error
            raise ConfigError(f"INGEST_PLUGINS: cannot import plugin {name!r}: {type(exc).__name__}: {exc}") from None
    for ep in entry_points(group="ingest.plugins"):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"entry point {ep.name!r} ({ep.value}): {type(exc).__name__}: {exc}") from None

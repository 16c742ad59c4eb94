"""The format registry: ``format:`` → its decoder class. The only place formats are told apart.

Built-in formats are registered by import path (their libraries load only when
used); a plugin adds one with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ingest.formats.base import Decoder

_formats: dict[str, Any] = {"json": "ingest.formats.json:JsonDecoder"}


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


def build_decoder(pipeline: Any) -> Decoder:
    """The decoder of ``pipeline.format``; every decoder class is built with the pipeline's settings."""
    return decoder_class(pipeline.format)(pipeline)  # type: ignore[no-any-return]

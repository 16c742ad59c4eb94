"""The settings-side registry (ingest/config/kinds.py) and the runtime sink registry built on it."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import ValidationError

from ingest.config import PipelineSettings, kinds
from ingest.sinks import registry
from ingest.sinks.base import Capabilities

SINK = {"table": "t", "conflict_key": ["id"], "columns": {"id": {"type": "bigint", "source": "@key"}}}


@pytest.fixture
def fresh_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(kinds, "_sinks", dict(kinds._sinks))
    monkeypatch.setattr(registry, "_backends", dict(registry._backends))


@pytest.mark.parametrize("kind", ["postgres", "clickhouse"])
def test_a_built_in_kind_declares_the_deletes_its_backend_has(kind: str) -> None:
    assert kinds.sink_deletes(kind) == registry.backend(kind).capabilities.deletes


def test_both_registries_name_the_same_kinds_and_settings_classes() -> None:
    assert registry.kinds() == kinds.sink_kinds() == list(registry._backends)
    for kind in registry.kinds():
        assert registry.settings_class(kind) is kinds.sink_settings_class(kind)


def test_a_plugin_kind_registered_by_path_is_imported_only_when_a_pipeline_needs_its_answer(
        fresh_registries: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """register() with a backend path: the settings class validates the sink section at once; the
    backend module is imported only when a pipeline with deletes asks whether it can delete."""
    from ingest.sinks.postgres.settings import PostgresSinkSettings

    class LikePostgres(PostgresSinkSettings):
        kind: str = "like_pg"  # type: ignore[assignment]

    plugin = types.ModuleType("like_pg_backend")
    plugin.BACKEND = types.SimpleNamespace(capabilities=Capabilities(deletes=False))  # type: ignore[attr-defined]
    registry.register("like_pg", settings=LikePostgres, backend="like_pg_backend:BACKEND")
    base = {"name": "p", "topics": ["t"], "sink": {**SINK, "kind": "like_pg", "dsn": "postgresql://u@h/d"}}
    assert isinstance(PipelineSettings.model_validate(base).sink, LikePostgres)
    assert "like_pg_backend" not in sys.modules
    monkeypatch.setitem(sys.modules, "like_pg_backend", plugin)
    with pytest.raises(ValidationError, match="sink kind 'like_pg' cannot delete rows"):
        PipelineSettings.model_validate({**base, "tombstones": "delete"})
    with pytest.raises(ValidationError, match="sink.kind must be one of 'postgres', 'clickhouse', 'like_pg'"):
        PipelineSettings.model_validate({**base, "sink": {**SINK, "kind": "nope"}})


def test_an_unknown_kind_is_a_key_error_in_both() -> None:
    for lookup in (kinds.sink_settings_class, kinds.sink_deletes, registry.settings_class, registry.backend):
        with pytest.raises(KeyError):
            lookup("nope")

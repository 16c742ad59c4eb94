"""The PostgreSQL upserts feed the table in conflict-key order (``UpsertStatements.key_order``).

A staged batch holds one row per key, so the order changes no result (the integration suites hold
the rows); what is pinned here is that both upserts -- the row path's and the columnar tier's --
sort by the key's positions in their select list, whatever the key's place among the columns, and
that a table without a conflict key is not sorted.
"""

from __future__ import annotations

import pytest

from ingest.core.mapping import Mapper
from ingest.sinks.postgres.columnar import ColumnarStatements
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.statements import UpsertStatements

COLUMNS = {"a": {"type": "text", "source": "$.a"}, "b": {"type": "bigint", "source": "$.b"},
           "c": {"type": "bigint", "source": "$.c"}}


def _cfg(**kw) -> PostgresSinkSettings:
    return PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", columns=COLUMNS, **kw)


def _columnar(cfg: PostgresSinkSettings) -> str:
    plan = Mapper(cfg.columns).columnar_plan(cfg.collapse_rule().key_index)
    assert plan is not None
    return ColumnarStatements(cfg, plan.columns).upsert.as_string(None)


@pytest.mark.parametrize(("key", "order"), [(["b"], " ORDER BY 2 "), (["c", "a"], " ORDER BY 3, 1 ")])
def test_both_upserts_sort_by_the_key_positions(key, order):
    cfg = _cfg(conflict_key=key)
    for statement in (UpsertStatements(cfg).insert_from_stage.as_string(None), _columnar(cfg)):
        assert order + "ON CONFLICT" in statement


def test_a_table_without_a_conflict_key_is_not_sorted():
    cfg = _cfg(on_conflict="none")
    assert "ORDER BY" not in UpsertStatements(cfg).insert_from_stage.as_string(None)
    assert "ORDER BY" not in _columnar(cfg)

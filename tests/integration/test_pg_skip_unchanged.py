"""The PostgreSQL upsert skips rows it would leave as they are (``sink.skip_unchanged``, issue #38).

The upsert's ``DO UPDATE`` is guarded by ``(t.cols) IS DISTINCT FROM (EXCLUDED.cols)`` over every
column the update sets -- the hidden source columns ``_ingest_stream`` / ``_ingest_offset`` and a
soft-delete column included -- on top of the ordering guard (version column or source). Checked on a
real PostgreSQL by each row's ``xmin`` (the transaction that wrote its current version): a skipped
row keeps it, an updated one gets a new one.

- a replayed batch (the same records at the same offsets) rewrites no row, whatever the column types
  (a ``json`` column has no equality operator) and the write method;
- a changed row is updated, an identical one re-sent from another offset updates its source columns
  (what ``replay-dlq``'s ``row_sources``, exactly-once and explode read);
- a soft-deleted row upserted with identical values is undeleted;
- with a version column: older skipped, equal and identical skipped, newer applied;
- ``skip_unchanged: false`` rewrites every row as before (for tables with ``ON UPDATE`` triggers).

The columnar tier and explode's children are checked in ``test_columnar_pg.py`` and ``test_explode.py``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from ingest.config.cdc import DeleteSettings
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.sink import PostgresSink
from ingest.sinks.postgres.statements import DeleteStatements, sink_table_sql
from ingest.types import DeleteRow, ImageDeleteRow

pytestmark = pytest.mark.timeout(120)

TABLE = "skip me"  # a name that needs quoting
AT = datetime(2026, 12, 5, 10, tzinfo=timezone.utc)
STREAM = 42  # the hidden stream id of every record here (one partition)
COLUMNS = {
    "id": {"type": "bigint"},
    "name": {"type": "text"},
    "amount": {"type": "numeric"},  # staged as text, cast by the upsert
    "doc": {"type": "jsonb"},
    "raw": {"type": "json"},  # no equality operator: compared as text
    "at": {"type": "timestamptz"},
}


class Table:
    """One sink table and its sink: rows written as batches, each row's ``xmin`` and values read back."""

    def __init__(self, dsn: str, *, deletes: DeleteSettings | None = None, **settings: Any) -> None:
        self.dsn = dsn
        self.cfg = PostgresSinkSettings(dsn=dsn, table=TABLE, conflict_key=["id"],
                                        columns=settings.pop("columns", COLUMNS), **settings)
        statements = sink_table_sql(self.cfg)
        if deletes is not None:
            d = DeleteStatements(self.cfg, deletes)
            statements.append(d.create_tombstones)
            if d.soft_column_ddl is not None:
                statements.append(d.soft_column_ddl)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)
        self.sink = PostgresSink(self.cfg, pool_size=1, deletes=deletes)

    def write(self, *rows: tuple[Any, ...]) -> None:
        self.sink.write(list(rows))

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(sql.replace("{t}", f'"{TABLE}"'))
            return cur.fetchall() if cur.description is not None else []

    def xmins(self) -> dict[int, int]:
        return dict(self.query("SELECT id, xmin::text::bigint FROM {t}"))

    def values(self) -> dict[int, tuple[Any, ...]]:
        cols = ", ".join(f'"{c}"::text' for c in self.cfg.columns if c != "id")
        return {r[0]: r[1:] for r in self.query(f"SELECT id, {cols} FROM {{t}}")}


def row(i: int, offset: int, name: str = "n", **over: Any) -> tuple[Any, ...]:
    """A mapped row of COLUMNS, written from ``offset`` of the one stream."""
    values = {"id": i, "name": f"{name}-{i}", "amount": Decimal("1.50"), "doc": '{"b": [1, 2.5, null], "a": "é"}',
              "raw": '[1,  "two"]', "at": AT, **over}
    return (*(values[c] for c in COLUMNS), STREAM, offset)


@pytest.fixture
def close_sinks():
    tables: list[Table] = []
    yield tables.append
    for t in tables:
        t.sink.close()


@pytest.mark.parametrize("write_method", ["copy", "values"])
def test_a_replayed_batch_rewrites_no_row(pg_dsn, close_sinks, write_method):
    t = Table(pg_dsn, write_method=write_method)
    close_sinks(t)
    batch = [row(i, 100 + i) for i in range(50)]
    t.write(*batch)
    before, values = t.xmins(), t.values()
    assert len(before) == 50
    t.write(*batch)  # a redelivery after a crash: every record again, at its offset
    assert t.xmins() == before
    assert t.values() == values
    # the same batch with one row changed: that row alone is rewritten
    t.write(*batch[:7], row(7, 107, name="changed"), *batch[8:])
    after = t.xmins()
    assert {i for i in after if after[i] != before[i]} == {7}
    assert t.values()[7][0] == "changed-7"


@pytest.mark.parametrize("column", ["name", "amount", "doc", "raw", "at"])
def test_a_change_in_any_one_column_is_written(pg_dsn, close_sinks, column):
    t = Table(pg_dsn)
    close_sinks(t)
    t.write(row(1, 10), row(2, 11))
    before = t.xmins()
    changed = {"name": "other", "amount": Decimal("1.51"), "doc": '{"a": "é", "b": [1, 2.5]}', "raw": '[1, "two"]',
               "at": AT + timedelta(microseconds=1)}[column]
    t.write(row(1, 10, **({column: changed} if column != "name" else {"name": changed})), row(2, 11))
    after = t.xmins()
    assert after[1] != before[1] and after[2] == before[2]


def test_identical_values_from_another_offset_update_the_source_columns(pg_dsn, close_sinks):
    """The source columns are among what the update sets: a record re-sent with the same values from
    another offset (another partition too) moves the row's source, which ``row_sources`` (replay-dlq),
    the explode children and the ordering guard read."""
    t = Table(pg_dsn)
    close_sinks(t)
    t.write(row(1, 10), row(2, 11))
    before = t.xmins()
    t.write(row(1, 20), row(2, 11))
    assert t.xmins()[1] != before[1] and t.xmins()[2] == before[2]
    sources = t.sink.row_sources([(1,), (2,)])
    assert (sources[(1,)].stream, sources[(1,)].offset) == (STREAM, 20)
    assert (sources[(2,)].stream, sources[(2,)].offset) == (STREAM, 11)
    # an older record of the same partition is still skipped by the ordering guard, values or not
    t.write(row(1, 15, name="late"))
    assert t.values()[1][0] == "n-1" and t.sink.row_sources([(1,)])[(1,)].offset == 20


def test_skip_unchanged_off_rewrites_every_row(pg_dsn, close_sinks):
    """For tables whose ``ON UPDATE`` trigger must see every upsert: a trigger counts the updates."""
    t = Table(pg_dsn, skip_unchanged=False)
    close_sinks(t)
    t.query("CREATE TABLE updates (n bigint)")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION count_update() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN INSERT INTO updates VALUES (NEW.id); RETURN NEW; END $$")
        conn.execute(f'CREATE TRIGGER counted BEFORE UPDATE ON "{TABLE}" FOR EACH ROW EXECUTE FUNCTION count_update()')
    batch = [row(i, 100 + i) for i in range(5)]
    t.write(*batch)
    before = t.xmins()
    t.write(*batch)
    after = t.xmins()
    assert all(after[i] != before[i] for i in before)
    assert sorted(n for (n,) in t.query("SELECT n FROM updates")) == list(range(5))


def test_skip_unchanged_on_fires_no_update_trigger_on_a_replay(pg_dsn, close_sinks):
    """The other side of the setting (the default): a replay fires no row trigger, a change does."""
    t = Table(pg_dsn)
    close_sinks(t)
    assert t.cfg.skip_unchanged is True
    t.query("CREATE TABLE updates (n bigint)")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION count_update() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN INSERT INTO updates VALUES (NEW.id); RETURN NEW; END $$")
        conn.execute(f'CREATE TRIGGER counted BEFORE UPDATE ON "{TABLE}" FOR EACH ROW EXECUTE FUNCTION count_update()')
    batch = [row(i, 100 + i) for i in range(5)]
    t.write(*batch)
    t.write(*batch)
    t.write(row(3, 103, name="changed"))
    assert t.query("SELECT n FROM updates") == [(3,)]


# --------------------------------------------------------------------------- soft deletes


def _delete(i: int, offset: int) -> DeleteRow:
    return DeleteRow((i, None, None, None, None, None, STREAM, offset))


@pytest.mark.parametrize("soft_type", ["timestamptz", "boolean"])
def test_a_soft_deleted_row_upserted_with_identical_values_is_undeleted(pg_dsn, close_sinks, soft_type):
    deletes = DeleteSettings(mode="soft", soft_column="gone", soft_column_type=soft_type)
    t = Table(pg_dsn, deletes=deletes)
    close_sinks(t)
    live = "gone IS NULL" if soft_type == "timestamptz" else "NOT gone"
    t.write(row(1, 10), row(2, 11))
    t.write(_delete(1, 12))
    assert t.query(f"SELECT id FROM {{t}} WHERE {live} ORDER BY id") == [(2,)]
    t.write(row(1, 13))  # the values the row holds, from a later record: undeleted
    assert t.query(f"SELECT id FROM {{t}} WHERE {live} ORDER BY id") == [(1,), (2,)]
    # A row marked deleted behind ingest's back, then its very record replayed (every column the
    # upsert sets identical, the sources too): the upsert still undeletes it -- the soft column is
    # compared like the others. The untouched row is not rewritten.
    t.query(f"UPDATE {{t}} SET gone = {'now()' if soft_type == 'timestamptz' else 'true'} WHERE id = 1 RETURNING id")
    before = t.xmins()
    t.write(row(1, 13), row(2, 11))
    assert t.query(f"SELECT id FROM {{t}} WHERE {live} ORDER BY id") == [(1,), (2,)]
    after = t.xmins()
    assert after[1] != before[1] and after[2] == before[2]


def test_with_hard_deletes_a_replay_rewrites_no_row_and_a_deleted_key_comes_back(pg_dsn, close_sinks):
    t = Table(pg_dsn, deletes=DeleteSettings(mode="hard"))
    close_sinks(t)
    t.write(row(1, 10), row(2, 11))
    before = t.xmins()
    t.write(row(1, 10), row(2, 11))
    assert t.xmins() == before
    t.write(_delete(1, 12))
    t.write(row(1, 13), row(2, 11))
    assert sorted(t.xmins()) == [1, 2] and t.xmins()[2] == before[2]


def test_a_replayed_soft_delete_with_its_image_rewrites_nothing(pg_dsn, close_sinks):
    """``delete_with_image`` (an upsert and a delete of one key in a batch) is guarded too: replayed, the
    row it marked deleted is left as it is (boolean mark: identical); its first write marks it, even a
    row whose values it repeats."""
    t = Table(pg_dsn, deletes=DeleteSettings(mode="soft", soft_column="gone", soft_column_type="boolean"))
    close_sinks(t)
    t.write(row(1, 10))
    image = ImageDeleteRow(row(1, 11, name="last"))
    t.write(image)
    assert t.query("SELECT name, gone FROM {t}") == [("last-1", True)]
    before = t.xmins()
    t.write(image)
    assert t.xmins() == before
    assert t.query("SELECT name, gone FROM {t}") == [("last-1", True)]
    # the mark is compared like the values: a live row whose values and source the image repeats is marked
    t.write(row(2, 12))
    t.write(ImageDeleteRow(row(2, 12)))
    assert t.query("SELECT id, gone FROM {t} ORDER BY id") == [(1, True), (2, True)]


# --------------------------------------------------------------------------- version column

VERSIONED = {**COLUMNS, "v": {"type": "bigint"}}


def vrow(i: int, v: int, offset: int, name: str = "n") -> tuple[Any, ...]:
    base = row(i, offset, name=name)
    return (*base[:len(COLUMNS)], v, *base[len(COLUMNS):])


def test_the_version_guard_and_the_distinct_guard_together(pg_dsn, close_sinks):
    t = Table(pg_dsn, columns=VERSIONED, version_column="v")
    close_sinks(t)
    t.write(vrow(1, 5, 10), vrow(2, 5, 11))
    x0 = t.xmins()
    t.write(vrow(1, 4, 12, name="older"))  # an older version, other values: skipped
    assert t.xmins() == x0 and t.values()[1][0] == "n-1"
    t.write(vrow(1, 5, 10), vrow(2, 5, 11))  # the same version, identical (a replay): skipped
    assert t.xmins() == x0
    t.write(vrow(1, 5, 13))  # the same version and values from another offset: the source moves
    x1 = t.xmins()
    assert x1[1] != x0[1] and x1[2] == x0[2]
    assert t.sink.row_sources([(1,)])[(1,)].offset == 13
    t.write(vrow(1, 6, 14, name="newer"), vrow(2, 5, 11))  # a newer version: applied; the other skipped
    x2 = t.xmins()
    assert x2[1] != x1[1] and x2[2] == x0[2]
    assert t.values()[1][0] == "newer-1" and t.values()[1][5] == "6"

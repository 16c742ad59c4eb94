"""The in-batch collapse rule (ingest/core/collapse.py), held to the sink's semantics by a
differential property test -- the one test that owns the rule.

Reference: apply every record of a batch one by one, in consumption order, to a table with the
sink's semantics (``ON CONFLICT DO UPDATE`` guarded by ``EXCLUDED.v >= t.v`` when there is a
version column; ``DO NOTHING``; plain INSERT), starting from any existing rows. The collapse
writes only each group's first candidate, and falls back to the next candidate when one is
poison: the table must end the same as the reference with the poison records left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.core.collapse import CollapseRule, collapse
from ingest.types import Failure, Item, Record

KEY, VERSION, POS = 0, 1, 2  # row = (key, version, position in the batch)


def _items(rows: Sequence[tuple[int, int]], failed: set[int] = frozenset()) -> list[Item]:
    out = []
    for pos, (key, version) in enumerate(rows):
        rec = Record("t", 0, pos, str(key).encode(), b"{}", None)
        if pos in failed:
            out.append(Item(rec, None, Failure("map", "invalid_value", "x"), 1, 10))
        else:
            out.append(Item(rec, (key, version, pos), None, 1, 10))
    return out


def _reference(table: dict[Any, tuple], rows: Sequence[tuple], rule: CollapseRule) -> dict[Any, tuple] | list:
    """The table after applying ``rows`` one by one with the sink's semantics."""
    if rule.key_index is None:
        return [*table.get(None, []), *rows]
    out = dict(table)
    for row in rows:
        key = tuple(row[i] for i in rule.key_index)
        old = out.get(key)
        if old is None:
            out[key] = row
        elif rule.keep == "last" and (rule.version_index is None or row[rule.version_index] >= old[rule.version_index]):
            out[key] = row
    return out


def _collapsed(table: dict[Any, tuple], items: list[Item], rule: CollapseRule, poison: set[int]) -> dict | list:
    """The table after writing one candidate per group (falling back past poison candidates)."""
    failed, groups = collapse(items, rule)
    assert all(it.failure is not None for it in failed)
    written = []
    for group in groups:
        for candidate in group:
            if candidate.row[POS] not in poison:
                written.append(candidate.row)
                break
    return _reference(table, written, rule)


RULES = st.one_of(
    st.just(CollapseRule(None)),
    st.builds(CollapseRule, st.just((KEY,)), st.sampled_from(["last", "first"]), st.sampled_from([None, VERSION])),
)


@settings(max_examples=400, deadline=None)
@given(rule=RULES, rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=30),
       existing=st.dictionaries(st.integers(0, 4), st.integers(0, 3), max_size=5), data=st.data())
def test_collapse_writes_what_applying_every_record_would(rule: CollapseRule, rows, existing, data) -> None:
    failed = data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)), max_size=len(rows) // 3)) if rows else set()
    poison = data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)), max_size=len(rows) // 3)) if rows else set()
    items = _items(rows, failed)
    if rule.key_index is None:
        table: dict = {None: [(-1, -1, -1)]}
    else:
        table = {(k,): (k, v, -1) for k, v in existing.items()}
    good = [it.row for it in items if it.row is not None and it.row[POS] not in poison]
    assert _collapsed(table, items, rule, poison) == _reference(table, good, rule)


def test_groups_keep_every_record_of_their_key_in_preference_order() -> None:
    items = _items([(1, 5), (1, 3), (2, 0), (1, 5), (2, 1)])
    _, groups = collapse(items, CollapseRule((KEY,), "last", VERSION))
    assert [[it.row[POS] for it in g] for g in groups] == [[3, 0, 1], [4, 2]]
    _, groups = collapse(items, CollapseRule((KEY,), "last", None))
    assert [[it.row[POS] for it in g] for g in groups] == [[3, 1, 0], [4, 2]]
    _, groups = collapse(items, CollapseRule((KEY,), "first", VERSION))
    assert [[it.row[POS] for it in g] for g in groups] == [[0, 1, 3], [2, 4]]
    failed, groups = collapse(items, CollapseRule(None))
    assert failed == [] and [[it.row[POS] for it in g] for g in groups] == [[0], [1], [2], [3], [4]]


def test_failed_items_are_set_aside_in_order() -> None:
    items = _items([(1, 0), (2, 0), (1, 1)], failed={0, 2})
    failed, groups = collapse(items, CollapseRule((KEY,), "last", VERSION))
    assert [it.record.offset for it in failed] == [0, 2]
    assert [[it.row[POS] for it in g] for g in groups] == [[1]]


# -- deletes (ingest.cdc): a DeleteRow is a candidate like any row --------------------------------

def _change_items(rows: Sequence[tuple[int, int, bool]]) -> list[Item]:
    from ingest.types import DeleteRow

    out = []
    for pos, (key, version, deleted) in enumerate(rows):
        rec = Record("t", 0, pos, str(key).encode(), None if deleted else b"{}", None)
        row = DeleteRow((key, version, pos)) if deleted else (key, version, pos)
        out.append(Item(rec, row, None, 1, 10))
    return out


def _apply_changes(table: dict[int, tuple[int, bool]], rows: Sequence[tuple], versioned: bool) -> dict[int, tuple]:
    """Apply rows one by one as the PostgreSQL sink with deletes does: a row or a tombstone per key
    (``(version, deleted)``); a record applies when it is not older than what the key holds."""
    from ingest.types import DeleteRow

    out = dict(table)
    for row in rows:
        old = out.get(row[KEY])
        if old is None or not versioned or row[VERSION] >= old[0]:
            out[row[KEY]] = (row[VERSION], type(row) is DeleteRow)
    return out


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), max_size=30),
       existing=st.dictionaries(st.integers(0, 4), st.tuples(st.integers(0, 3), st.booleans()), max_size=5),
       versioned=st.booleans())
def test_collapse_with_deletes_leaves_what_applying_every_change_would(rows, existing, versioned) -> None:
    """Upserts then a delete of a key leave it deleted, a delete then an upsert leave it present; with a
    version the highest wins whichever kind it is, and nothing older than a tombstone applies."""
    rule = CollapseRule((KEY,), "last", VERSION if versioned else None)
    items = _change_items(rows)
    _, groups = collapse(items, rule)
    written = [group[0].row for group in groups]
    assert _apply_changes(existing, written, versioned) == _apply_changes(existing, [it.row for it in items],
                                                                          versioned)


def _apply_soft(table: dict[int, tuple], rows: Sequence[tuple], versioned: bool) -> dict[int, tuple]:
    """Soft deletes one by one: ``key -> (version, values position, deleted)``; a delete marks the row the
    key holds (keeping its values), a key without a row keeps only its tombstone (``values`` None)."""
    from ingest.types import DeleteRow, ImageDeleteRow

    out = dict(table)
    for row in rows:
        old = out.get(row[KEY])
        if old is not None and versioned and row[VERSION] < old[0]:
            continue
        if type(row) is ImageDeleteRow:  # the sink writes the carried values, marked deleted
            out[row[KEY]] = (row[VERSION], row[POS], True)
        elif isinstance(row, DeleteRow):
            out[row[KEY]] = (row[VERSION], old[1] if old is not None else None, True)
        else:
            out[row[KEY]] = (row[VERSION], row[POS], False)
    return out


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), max_size=30),
       existing=st.dictionaries(st.integers(0, 4), st.tuples(st.just(0), st.integers(-9, -1), st.booleans()),
                                max_size=5),
       versioned=st.booleans())
def test_soft_deletes_keep_the_values_applying_every_change_would(rows, existing, versioned) -> None:
    """merge_deletes: a delete winning over an upsert of its batch carries that upsert's values.

    The table's rows have the lowest version: the collapse cannot see them, so a batch upsert older
    than the table's row (and a delete newer than both) is the documented limit, not tested here."""
    from ingest.types import DeleteRow

    rule = CollapseRule((KEY,), "last", VERSION if versioned else None, merge_deletes=True)
    items = []
    for pos, (key, version, deleted) in enumerate(rows):
        rec = Record("t", 0, pos, str(key).encode(), None if deleted else b"{}", None)
        # a delete row holds only its key and version (the position column is filler: None)
        items.append(Item(rec, DeleteRow((key, version, None)) if deleted else (key, version, pos), None, 1, 10))
    _, groups = collapse(items, rule)
    written = [group[0].row for group in groups]
    assert _apply_soft(existing, written, versioned) == _apply_soft(existing, [it.row for it in items], versioned)

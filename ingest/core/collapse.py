"""The in-batch collapse rule: which of a batch's records of one row is written.

A multi-row upsert may not touch one row twice (PostgreSQL refuses; ClickHouse
would keep both until a merge), and only one record per row can end up there
anyway. So the records of a batch are grouped by the sink's key, and each group
is ordered by preference -- the record the sink would keep had every record
been applied one by one, in consumption order, with the sink's semantics:

- ``keep="last"`` (``ON CONFLICT DO UPDATE``, ReplacingMergeTree): the newest
  record wins. With a version column, "newest" is the highest version (an
  update applies only when ``EXCLUDED.v >= t.v``), ties broken by consumption
  order, the later winning; without one, simply the last consumed;
- ``keep="first"`` (``ON CONFLICT DO NOTHING``): the first consumed wins;
- no key (append-only tables): every record is its own group.

Only a group's first candidate is written; when it turns out to be poison the
next one is (:func:`ingest.core.isolation.write_groups_isolating`), so a poison
record never takes the good records of its row down with it. A written
candidate *settles* itself and every candidate after it in its group (they would
have been overwritten, or ignored, by it).

``tests/unit/test_collapse.py`` holds this rule to the sequential semantics with
a differential property test; whoever extends the rule (deletes, a columnar
fast path) extends that test.

Pure logic, no I/O.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ingest.types import DeleteRow, ImageDeleteRow, Item

__all__ = ["CollapseRule", "collapse"]


@dataclass(frozen=True, slots=True)
class CollapseRule:
    """How a sink collapses the records of one row (see the module docstring).

    ``key_index``: the row positions of the sink's key columns (``None``: append-only, no
    collapse). ``version_index``: the row position of the version column, or ``None``.
    """

    key_index: tuple[int, ...] | None
    keep: Literal["last", "first"] = "last"
    version_index: int | None = None
    #: soft deletes: a group whose winner is a delete with an upsert behind it writes that upsert's
    #: values marked deleted (an :class:`~ingest.types.ImageDeleteRow`), as applying both would
    merge_deletes: bool = False


def collapse(items: Sequence[Item], rule: CollapseRule) -> tuple[list[Item], list[list[Item]]]:
    """Split a batch into the items that already failed (decode / map) and the groups to write.

    Returns ``(failed, groups)``: failed items in batch order; one group per row, groups in
    order of their first record, each group's candidates in order of preference.
    """
    failed: list[Item] = []
    if rule.key_index is None:
        groups_list = []
        for item in items:
            if item.failure is not None:
                failed.append(item)
            else:
                groups_list.append([item])
        return failed, groups_list
    key_of = operator.itemgetter(*rule.key_index)
    groups: dict[Any, list[Item]] = {}
    for item in items:
        if item.failure is not None:
            failed.append(item)
            continue
        key = key_of(item.row)
        group = groups.get(key)
        if group is None:
            groups[key] = [item]
        else:
            group.append(item)
    if rule.keep == "first":
        return failed, list(groups.values())
    vi = rule.version_index
    if vi is None:
        ordered = [group[::-1] if len(group) > 1 else group for group in groups.values()]
    else:
        def version(item: Item) -> Any:
            return item.row[vi]  # type: ignore[index]

        # Latest first, then a stable sort by version: the highest version first, ties latest first.
        ordered = [sorted(group[::-1], key=version, reverse=True) if len(group) > 1 else group
                   for group in groups.values()]
    if rule.merge_deletes:
        ordered = [_merged(group, groups[key_of(group[0].row)], vi)
                   if len(group) > 1 and type(group[0].row) is DeleteRow else group
                   for group in ordered]
    return failed, ordered


def _merged(ordered: list[Item], consumed: list[Item], vi: int | None) -> list[Item]:
    """A soft delete winning its group: with the values the key's row held just before it in the batch.

    Applies the group's records one by one (``consumed``: consumption order) with the sink's rule (a
    record not older than the key's state applies); a delete keeps the values of the state it marks.
    When the winning delete ends up with values, it carries them (an ImageDeleteRow: the upsert's
    values, the delete's key, version and source -- its non-NULL values); otherwise it marks whatever
    the table holds. The table's own row is not known here: a batch's upsert older than the table's
    row but not than the delete still lends its values (see the README's CDC limits).
    """
    values: tuple[Any, ...] | None = None
    version: Any = None
    for item in consumed:
        row = item.row
        if vi is not None and version is not None and row[vi] < version:  # type: ignore[index]
            continue
        version = row[vi] if vi is not None else None  # type: ignore[index]
        if not isinstance(row, DeleteRow):
            values = row
    delete = ordered[0]
    if values is None:
        return ordered
    row = ImageDeleteRow(d if d is not None else u for d, u in zip(delete.row, values))  # type: ignore[arg-type]
    return [Item(delete.record, row, None, delete.epoch, delete.size_bytes), *ordered[1:]]

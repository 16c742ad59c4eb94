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

from ingest.types import Item

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
        return failed, [group[::-1] if len(group) > 1 else group for group in groups.values()]

    def version(item: Item) -> Any:
        return item.row[vi]  # type: ignore[index]

    # Latest first, then a stable sort by version: the highest version first, ties latest first.
    return failed, [sorted(group[::-1], key=version, reverse=True) if len(group) > 1 else group
                    for group in groups.values()]

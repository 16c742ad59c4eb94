"""Child tables of ``explode`` steps in ClickHouse: written with their parent, replaced by marking.

ClickHouse has no transactions across tables, so "atomic" means what it means for every ClickHouse
write here: a batch's inserts are retried until they all landed, and the records' offsets are
committed only after the last of them; a crash in between replays the records, and rewriting rows
that did land is harmless (ReplacingMergeTree keeps one row per key, the insert tokens drop
retried inserts). A reader can see a parent's new children before the parent row itself: the child
inserts go first and the parent row last. A parent row ClickHouse refuses on its own (a constraint)
after its children landed is dead-lettered with them in place: no transaction can take them back.

For the batch's parents (FamilyRows whose step applied), per child table:

1. parents whose row in the table is newer than the record (a late writer: a higher stored
   ``_version``, the record offset, read with ``FINAL``) are left out: they change no child;
2. with ``replace``, the children the table holds for those parents (``FINAL``, deleted rows hidden)
   that the new arrays no longer hold get a delete marker: their key and link values, each other
   column's zero value, ``_ingest_deleted = 1`` and the parent record's version, so
   ``ReplacingMergeTree(_version, _ingest_deleted)`` hides them (``SELECT ... FINAL``);
3. the new child rows (one per child key; a later parent's claim wins) and the markers go in one
   insert, with the batch's insert token extended by the table's name.

Versions order the records of one partition (the record offset), as the parent table's do: a child
moved to a parent in another partition is ordered by offsets that do not compare. Keyed topics
keep an order and its items in one partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ingest.sinks.clickhouse.settings import DELETED_COLUMN, ClickHouseSinkSettings


def _quote(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _tuple_of(names: Sequence[str]) -> str:
    return "tuple(" + ", ".join(_quote(n) for n in names) + ")"


class ChildTable:
    """One explode step's child table in ClickHouse: its queries (composed once) and its batch write."""

    def __init__(self, slot: int, parent: ClickHouseSinkSettings, explode: Any) -> None:
        """``slot``: the step's position among the pipeline's explode steps (its place in ``families``)."""
        self.slot = slot
        self.replace: bool = explode.replace
        cfg = parent.child_table(explode.table, dict(explode.columns), list(explode.conflict_key))
        self.settings = cfg
        names = list(cfg.columns)
        types = cfg.ch_types
        self.columns = [*names, DELETED_COLUMN]
        self.types = [t.ddl for t in types.values()] + ["UInt8"]
        self.key_index = tuple(names.index(k) for k in cfg.order_by)
        links = list(explode.parent)
        self._links = links
        self._link_index = tuple(names.index(c) for c in links)
        self._version_at = names.index(cfg.version_column or "")
        self._filler = cfg.delete_filler()
        parent_names = list(parent.columns)
        self._parent_key_index = tuple(parent_names.index(k) for k in parent.order_by)
        self._parent_version_at = parent_names.index(parent.version_column or "")
        ptypes = parent.ch_types
        table = f"{_quote(cfg.database)}.{_quote(cfg.table)}"
        parent_table = f"{_quote(parent.database)}.{_quote(parent.table)}"
        link_types = ", ".join(types[c].ddl for c in links)
        parent_key_types = ", ".join(ptypes[k].ddl for k in parent.order_by)
        #: the stored versions of the batch's parents
        self.parent_versions = (
            f"SELECT {', '.join(_quote(k) for k in parent.order_by)}, {_quote(parent.version_column or '')} "
            f"FROM {parent_table} FINAL WHERE {_tuple_of(parent.order_by)} IN {{keys:Array(Tuple({parent_key_types}))}}")
        #: the live children of the batch's parents: their key, then their link values
        self.existing = (
            f"SELECT {', '.join(_quote(k) for k in cfg.order_by)}, {', '.join(_quote(c) for c in links)} "
            f"FROM {table} FINAL WHERE {_tuple_of(links)} IN {{links:Array(Tuple({link_types}))}}")

    def rows(self, query: Any, rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The child table's insert for the batch's parent ``rows`` (new children and delete markers,
        each with the ``_ingest_deleted`` flag last); ``query(sql, parameters) -> result rows`` reads
        the tables. Empty when no parent's step applied."""
        slot = self.slot
        families = []
        for row in rows:
            family = getattr(row, "families", None)
            if family is not None and family[slot] is not None:
                families.append((row, *family[slot]))
        if not families:
            return []
        key_at, version_at = self._parent_key_index, self._parent_version_at
        stored = {tuple(r[:-1]): r[-1] for r in query(self.parent_versions, {
            "keys": [tuple(row[i] for i in key_at) for row, _, _ in families]})}
        current = [(row, link, children) for row, link, children in families
                   if stored.get(tuple(row[i] for i in key_at), -1) <= row[version_at]]
        children: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        for _, _, child_rows in current:
            for child in child_rows:
                key = tuple(child[i] for i in self.key_index)
                children.pop(key, None)  # a later parent's claim wins, in its place in the batch
                children[key] = (*child, 0)
        out = list(children.values())
        if self.replace and current:
            version = {link: row[version_at] for row, link, _ in current}
            width = len(self.key_index)
            for found in query(self.existing, {"links": list(version)}):
                key, link = tuple(found[:width]), tuple(found[width:])
                if key in children or link not in version:
                    continue
                marker = list(self._filler)
                for i, value in zip(self.key_index, key, strict=True):
                    marker[i] = value
                for i, value in zip(self._link_index, link, strict=True):
                    marker[i] = value
                marker[self._version_at] = version[link]
                out.append((*marker, 1))
        return out

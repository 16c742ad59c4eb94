"""Child tables of ``explode`` steps: their rows written in the parent's transaction.

An ``explode`` transform step (``ingest.core.transforms``) turns one record into its parent row and
one child row per element of an array; the mapper hands the sink a :class:`~ingest.types.FamilyRow`
(the parent row carrying, per explode step, the parent link values and the child rows). The sink
writes the parent rows as usual (the upsert returning the sources of the parents its ordering guard let
through, those it left unchanged included: children follow only those parents, so a late writer whose
parent row the guard skips adds and deletes no child, while a parent replayed unchanged still gets the
children its record makes), then, per child table and in the same transaction:

1. the batch's child rows are COPYed into the child table's stage (one row per child key: when two
   parents of a batch claim one child key, the later parent in the batch wins);
2. with ``replace`` (the default), the children of the batch's parents that are not in the stage
   are deleted -- so the child table holds exactly the latest parent's elements; a parent whose
   array is empty loses all its children;
3. the staged rows are upserted (``ON CONFLICT (child key) DO UPDATE``), with the parent table's
   guards: a record older than the row, from the row's own partition, does not overwrite it, and
   (``skip_unchanged``) a child row the update would leave as it is is not rewritten;
4. the stage is emptied (several pieces may share one transaction: exactly-once savepoints).

The delete of step 2 has the same guard: a late writer (a lane finishing after its partition moved
away, a replayed dead letter) never deletes children that a newer record of the same partition
wrote. Because the parent and its children commit together, a crash can never leave an order with
part of its items, and the record's offset is committed only after that transaction.

Every name comes from config and is composed with :class:`psycopg.sql.Identifier`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from ingest.core.dialects import pg_base_type
from ingest.sinks.postgres.settings import OFFSET_COLUMN, STREAM_COLUMN, PostgresSinkSettings
from ingest.sinks.postgres.statements import UpsertStatements, stage_name, table_ident


class ChildTable:
    """One explode step's child table: its SQL (composed once) and how to write a batch's families."""

    def __init__(self, slot: int, parent: PostgresSinkSettings, explode: Any) -> None:
        """``slot``: the step's position among the pipeline's explode steps (its place in ``families``)."""
        self.slot = slot
        self.replace: bool = explode.replace
        cfg = parent.child_table(explode.table, dict(explode.columns), list(explode.conflict_key))
        self.settings = cfg
        self.sql = UpsertStatements(cfg)
        names = list(cfg.columns)
        self.key_index = tuple(names.index(k) for k in cfg.conflict_key)
        parent_names = list(parent.columns)
        #: where the parent row holds its record's stream and offset (the guard of the delete)
        self.parent_source = (parent_names.index(STREAM_COLUMN), parent_names.index(OFFSET_COLUMN))
        links = list(explode.parent)
        table = table_ident(cfg.db_schema, cfg.table)
        stage = sql.Identifier(stage_name(cfg.db_schema, cfg.table))
        arrays = sql.SQL(", ").join(
            [sql.SQL("%s::{}[]").format(sql.SQL(pg_base_type(cfg.columns[c].type)[1])) for c in links]
            + [sql.SQL("%s::bigint[]"), sql.SQL("%s::bigint[]")])
        aliases = sql.SQL(", ").join([sql.Identifier(f"l{i}") for i in range(len(links))]
                                     + [sql.Identifier("s"), sql.Identifier("o")])
        matches = sql.SQL(" AND ").join(
            sql.SQL("c.{} = p.{}").format(sql.Identifier(c), sql.Identifier(f"l{i}")) for i, c in enumerate(links))
        kept = sql.SQL(" AND ").join(
            sql.SQL("n.{k} = c.{k}").format(k=sql.Identifier(k)) for k in cfg.conflict_key)
        s, o = sql.Identifier(STREAM_COLUMN), sql.Identifier(OFFSET_COLUMN)
        #: the children of the batch's parents that their arrays no longer hold (guarded like the upsert)
        self.delete_stale = sql.SQL(
            "DELETE FROM {t} AS c USING unnest({arrays}) AS p({aliases}) WHERE {matches}"
            " AND (c.{s} IS DISTINCT FROM p.s OR c.{o} IS NULL OR c.{o} <= p.o)"
            " AND NOT EXISTS (SELECT 1 FROM {stage} AS n WHERE {kept})").format(
                t=table, arrays=arrays, aliases=aliases, matches=matches, s=s, o=o, stage=stage, kept=kept)

    def write(self, cur: psycopg.Cursor[Any], rows: Sequence[tuple[Any, ...]]) -> int:
        """Stage, replace and upsert the children of ``rows`` (the batch's parent rows, FamilyRows or
        not) inside the caller's transaction; returns the child rows written. The stage is emptied."""
        slot, key_index = self.slot, self.key_index
        children: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        parents: list[tuple[tuple[Any, ...], Any, Any]] = []
        stream_at, offset_at = self.parent_source
        for row in rows:
            families = getattr(row, "families", None)
            family = families[slot] if families is not None else None
            if family is None:  # the step did not apply to this record: its children stay as they are
                continue
            link, child_rows = family
            parents.append((link, row[stream_at], row[offset_at]))
            for child in child_rows:
                key = tuple(child[i] for i in key_index)
                children.pop(key, None)  # a later parent's claim wins, in its place in the batch
                children[key] = child
        if not parents:
            return 0
        if children:
            with cur.copy(self.sql.copy_stage) as copy:
                copy.set_types(self.sql.copy_types)
                as_text = self.sql.numeric_as_text
                for child in children.values():
                    if as_text:
                        child = tuple(str(v) if i in as_text and v is not None else v for i, v in enumerate(child))
                    copy.write_row(child)
        if self.replace:
            columns = [list(values) for values in zip(*(link for link, _, _ in parents), strict=True)]
            cur.execute(self.delete_stale, [*columns, [s for _, s, _ in parents], [o for _, _, o in parents]])
        if children:
            cur.execute(self.sql.insert_from_stage)
            cur.execute(self.sql.clear_stage)
        return len(children)

"""The SQL of one PostgreSQL sink table, composed once: the stage, COPY, the guarded upsert, multi-row VALUES.

The upsert's update is guarded twice (:meth:`UpsertStatements._conflict_clause`): by order (the
version column, else the row's source: an older record never overwrites a newer row) and, with
``sink.skip_unchanged`` (the default), by change (``(t.cols) IS DISTINCT FROM (EXCLUDED.cols)`` over
everything it sets): a row it would leave as it is is not rewritten.

Every name comes from config and is composed with :class:`psycopg.sql.Identifier`;
column types are the normalised forms of :func:`ingest.core.dialects.pg_base_type`
(letters, digits, spaces and a numeric modifier only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from ingest.config.cdc import DeleteSettings
from ingest.core.dialects import pg_base_type
from ingest.sinks.postgres.settings import (
    OFFSET_COLUMN,
    SOURCE_COLUMNS,
    STREAM_COLUMN,
    PostgresSinkSettings,
)


#: The shared stage's column that says which routed table a staged row goes to.
ROUTE_COLUMN = "_ingest_route"


def table_ident(schema: str, table: str) -> sql.Composable:
    return sql.Identifier(schema, table)


def stage_name(schema: str, table: str) -> str:
    """A stable temp-table name per target table (identifier-safe, <= 63 bytes)."""
    digest = hashlib.sha1(f"{schema}.{table}".encode()).hexdigest()[:16]
    return f"ingest_stage_{digest}"


#: psycopg type names for binary COPY, by normalised column base type.
_COPY_TYPE: dict[str, str] = {
    "smallint": "int2", "integer": "int4", "bigint": "int8", "numeric": "numeric", "real": "float4",
    "double precision": "float8", "text": "text", "boolean": "bool", "timestamptz": "timestamptz",
    "timestamp": "timestamp", "date": "date", "time": "time", "interval": "interval", "uuid": "uuid",
    "bytea": "bytea",
}


def stage_value(column: str, full_type: str, staged_as_text: bool) -> sql.Composable:
    """The stage's (``s``) column ``column`` as the table's value: cast to ``full_type`` where it is
    staged as text (json/jsonb, numeric read as text), else as it is."""
    value = sql.SQL("s.{}").format(sql.Identifier(column))
    return sql.SQL("{}::{}").format(value, sql.SQL(full_type)) if staged_as_text else value


@dataclass(frozen=True, slots=True)
class Also:
    """An assignment the upsert's update makes besides ``column = EXCLUDED.column`` of the row's columns
    (the soft-delete column's), and when it changes the stored row ``t`` (for the distinct guard)."""

    assign: sql.Composable
    changes: sql.Composable


def _comparable(cfg: PostgresSinkSettings, alias: str, column: str) -> sql.Composable:
    """``alias.column`` as the distinct guard compares it: a ``json`` column as its text (the type has no
    equality operator; its text is the stored value, exactly as written), any other column as it is."""
    value = sql.SQL("{}.{}").format(sql.SQL(alias), sql.Identifier(column))
    base = pg_base_type(cfg.columns[column].type)[0]
    return sql.SQL("{}::text").format(value) if base == "json" else value


def _changes(cfg: PostgresSinkSettings, columns: list[str], also: Sequence[Also]) -> sql.Composable:
    """The distinct guard: the update would change the row -- one of ``columns`` (what it sets from
    ``EXCLUDED``) differs, ``NULL`` and a value differing, or one of ``also``'s assignments changes it."""
    stored = sql.SQL(", ").join(_comparable(cfg, "t", c) for c in columns)
    incoming = sql.SQL(", ").join(_comparable(cfg, "EXCLUDED", c) for c in columns)
    parts = [sql.SQL("({}) IS DISTINCT FROM ({})").format(stored, incoming), *(a.changes for a in also)]
    return sql.SQL("({})").format(sql.SQL(" OR ").join(parts))


class UpsertStatements:
    """SQL for one target table, composed once."""

    def __init__(self, cfg: PostgresSinkSettings, deletes: DeleteStatements | None = None, *,
                 shared_stage: str | None = None, route: int | None = None) -> None:
        """``deletes``: the table's records can delete: the stage gains the delete flag, the upsert
        skips delete rows and keys with a newer tombstone (and undeletes a soft-deleted row).

        Tables a pipeline routes to (without deletes) share one stage per session, whose rows carry
        the number of the table they go to (:data:`ROUTE_COLUMN`): ``shared_stage`` names it, and
        ``route`` is this table's number (its upsert reads only its rows); ``route=None`` with a
        ``shared_stage`` gives the shared stage's own statements (create, COPY with the number, clear)."""
        self.columns = list(cfg.columns)
        target = table_ident(cfg.db_schema, cfg.table)
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        stage = sql.Identifier(shared_stage or stage_name(cfg.db_schema, cfg.table))
        # The stage is filled with binary COPY (≈1.5x faster than text here). Columns whose binary
        # wire format differs from what the mapper produces (json/jsonb: the mapper emits JSON
        # text; varchar(n): checked on insert) are staged as text and cast by the INSERT.
        # numeric columns too, unless a statement other than the upsert compares them (a conflict
        # key, the version column, a table that deletes): psycopg's binary numeric dumper builds
        # Decimal.as_tuple() per value (≈1.4 µs here, most of a 7-column row's COPY cost), while
        # the Decimal's text and PostgreSQL's cast cost ≈0.2 µs; the value and its rounding to the
        # column's scale are the same (numeric_in parses the exact decimal text the Decimal holds).
        compared = set(cfg.conflict_key) | ({cfg.version_column} if cfg.version_column else set())
        stage_types: list[str] = []
        select_exprs: list[sql.Composable] = []
        self.copy_types: list[str] = []
        #: row positions of the numeric columns staged as text: the sink writes ``str(value)`` there
        self.numeric_as_text: tuple[int, ...] = ()
        for i, (c, spec) in enumerate(cfg.columns.items()):
            base, full = pg_base_type(spec.type)
            numeric_text = base == "numeric" and deletes is None and c not in compared
            staged = "text" if base in ("json", "jsonb", "varchar") or numeric_text else full
            stage_types.append(staged)
            self.copy_types.append(_COPY_TYPE.get(base, "text") if staged != "text" else "text")
            select_exprs.append(stage_value(c, full, base in ("json", "jsonb") or numeric_text))
            if numeric_text:
                self.numeric_as_text += (i,)
        stage_columns = list(cfg.columns)
        if deletes is not None:
            stage_columns += [DELETED_FLAG, IMAGE_FLAG]
            stage_types += ["boolean", "boolean"]
            self.copy_types += ["bool", "bool"]
        if shared_stage is not None:
            stage_columns.append(ROUTE_COLUMN)
            stage_types.append("integer")
            self.copy_types.append("int4")
        col_defs = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in zip(stage_columns, stage_types)
        )
        self.create_stage = sql.SQL(
            "CREATE TEMP TABLE IF NOT EXISTS {stage} ({defs}) ON COMMIT DELETE ROWS"
        ).format(stage=stage, defs=col_defs)
        self.copy_stage = sql.SQL("COPY {stage} ({cols}) FROM STDIN (FORMAT BINARY)").format(
            stage=stage, cols=sql.SQL(", ").join(sql.Identifier(c) for c in stage_columns))
        # Several pieces may share one transaction (exactly-once savepoints): empty the stage after each.
        self.clear_stage = sql.SQL("DELETE FROM {stage}").format(stage=stage)
        select = sql.SQL(", ").join(select_exprs)
        conflict = self._conflict_clause(cfg, deletes.undelete if deletes is not None else ())
        where = deletes.upsert_filter if deletes is not None else sql.SQL("")
        if route is not None:
            where = sql.SQL(" WHERE s.{} = {}").format(sql.Identifier(ROUTE_COLUMN), sql.Literal(int(route)))
        self.insert_from_stage = sql.SQL(
            "INSERT INTO {t} AS t ({cols}) SELECT {sel} FROM {stage} AS s{where}{order}{conflict}").format(
                t=target, cols=cols, sel=select, stage=stage, conflict=conflict, order=self.key_order(cfg),
                where=where)
        #: explode's parents: the sources of the staged rows the upsert applied or found unchanged (see
        #: :meth:`_sources_of_applied`); None for a table without source columns
        self.applied_sources = (self._sources_of_applied(cfg, self.insert_from_stage, target, stage,
                                                         dict(zip(self.columns, select_exprs)), where)
                                if cfg.tracks_sources and cfg.on_conflict == "update" else None)
        self._insert_values_head = sql.SQL("INSERT INTO {t} AS t ({cols}) VALUES ").format(t=target, cols=cols)
        self._conflict = conflict
        self._row_placeholder = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(self.columns)))

    @staticmethod
    def key_order(cfg: PostgresSinkSettings) -> sql.Composable:
        """`` ORDER BY`` the conflict key's positions in the select list (the converted values), or nothing
        for a table without one. A staged batch holds one row per key, so the order changes no result;
        it makes the upsert walk the key's index in order instead of at random (measured on the bench
        stream, 5000-row batches into a 66k-key table: 33.0 -> 27.3 ms per upsert, median of 80)."""
        if cfg.on_conflict == "none" or not cfg.conflict_key:
            return sql.SQL("")
        columns = list(cfg.columns)
        return sql.SQL(" ORDER BY {}").format(sql.SQL(", ").join(
            sql.Literal(columns.index(k) + 1) for k in cfg.conflict_key))

    @staticmethod
    def _conflict_clause(cfg: PostgresSinkSettings, also: Sequence[Also] = ()) -> sql.Composable:
        """`` ON CONFLICT (key) DO UPDATE SET col = EXCLUDED.col, ...`` (plus ``also``'s assignments) with
        its guards, ANDed: the ordering guard (the version column, else the row's source), and with
        ``skip_unchanged`` the distinct guard -- the update runs only where it changes the row, judged on
        everything it sets (the source columns too: an identical record from another offset moves the
        row's source; ``also``: the soft-delete column, so an upsert of a soft-deleted row undeletes it).
        ``DO NOTHING`` for ``on_conflict: nothing`` or a table of key columns only; nothing without a key."""
        if cfg.on_conflict == "none":
            return sql.SQL("")
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in cfg.conflict_key)
        if cfg.on_conflict == "nothing":
            return sql.SQL(" ON CONFLICT ({keys}) DO NOTHING").format(keys=keys)
        updates = [c for c in cfg.columns if c not in cfg.conflict_key]
        if not updates:
            return sql.SQL(" ON CONFLICT ({keys}) DO NOTHING").format(keys=keys)
        assignments = sql.SQL(", ").join(
            [sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in updates] + [a.assign for a in also])
        clause = sql.SQL(" ON CONFLICT ({keys}) DO UPDATE SET {set}").format(keys=keys, set=assignments)
        guards: list[sql.Composable] = []
        if cfg.version_column:
            # The version orders records, across partitions too.
            v = sql.Identifier(cfg.version_column)
            guards.append(sql.SQL("(t.{v} IS NULL OR EXCLUDED.{v} >= t.{v})").format(v=v))
        elif cfg.tracks_sources:
            # Offsets order the records of one partition only: an older record of the row's own
            # partition never overwrites it (a late writer, a replayed dead letter); records of
            # other partitions apply in arrival order.
            s, o = sql.Identifier(STREAM_COLUMN), sql.Identifier(OFFSET_COLUMN)
            guards.append(sql.SQL("(t.{s} IS DISTINCT FROM EXCLUDED.{s} OR t.{o} IS NULL "
                                  "OR EXCLUDED.{o} >= t.{o})").format(s=s, o=o))
        if cfg.skip_unchanged:
            guards.append(_changes(cfg, updates, also))
        if not guards:
            return clause
        return sql.SQL("{clause} WHERE {guards}").format(clause=clause, guards=sql.SQL(" AND ").join(guards))

    @staticmethod
    def _sources_of_applied(cfg: PostgresSinkSettings, upsert: sql.Composable, target: sql.Composable,
                            stage: sql.Composable, values: dict[str, sql.Composable],
                            where: sql.Composable) -> sql.Composable:
        """``upsert`` (from the stage), returning ``(_ingest_stream, _ingest_offset)`` of each staged row the
        ordering guard let through: the rows it inserted or updated (``RETURNING``) and, with
        ``skip_unchanged``, the rows the distinct guard skipped -- found as the rows whose stored source was
        the staged row's already (the statement's one snapshot is taken before the upsert; the ordering
        guard skips a row only when its stored source is newer, so such a row was skipped because the
        update would have left it as it was). Explode writes the children of exactly these parents, as it
        did when every such row was rewritten: a parent replayed unchanged still gets its children (a new
        explode step, a changed child column). ``values``: each column's staged value (:func:`stage_value`)."""
        s, o = sql.Identifier(STREAM_COLUMN), sql.Identifier(OFFSET_COLUMN)
        returning = sql.SQL("{} RETURNING t.{s}, t.{o}").format(upsert, s=s, o=o)
        if not cfg.skip_unchanged:
            return returning
        match = sql.SQL(" AND ").join(
            [sql.SQL("t.{} = {}").format(sql.Identifier(k), values[k]) for k in cfg.conflict_key]
            + [sql.SQL("t.{s} = s.{s} AND t.{o} = s.{o}").format(s=s, o=o)])
        return sql.SQL("WITH applied AS ({returning}) SELECT {s}, {o} FROM applied UNION ALL "
                       "SELECT s.{s}, s.{o} FROM {stage} AS s JOIN {t} AS t ON {match}{where}").format(
            returning=returning, s=s, o=o, stage=stage, t=target, match=match, where=where)

    def insert_values(self, n_rows: int) -> sql.Composable:
        return sql.Composed(
            [self._insert_values_head, sql.SQL(", ").join([self._row_placeholder] * n_rows), self._conflict]
        )


def row_sources_query(cfg: PostgresSinkSettings, n_keys: int) -> sql.Composable:
    """``SELECT key..., _ingest_stream, _ingest_offset`` of the rows with ``n_keys`` given keys (typed placeholders)."""
    keys = list(cfg.conflict_key)
    types = [pg_base_type(cfg.columns[k].type)[1] for k in keys]
    one = sql.SQL("({})").format(sql.SQL(", ").join(
        sql.SQL("{}::{}").format(sql.Placeholder(), sql.SQL(t)) for t in types))
    return sql.SQL("SELECT {keys}, {s}, {o} FROM {t} WHERE ({keys}) IN (VALUES {values})").format(
        keys=sql.SQL(", ").join(sql.Identifier(k) for k in keys), s=sql.Identifier(STREAM_COLUMN),
        o=sql.Identifier(OFFSET_COLUMN), t=table_ident(cfg.db_schema, cfg.table),
        values=sql.SQL(", ").join([one] * n_keys))


#: The stage columns that mark a delete row (:class:`ingest.types.DeleteRow`) among the upserts, and
#: a soft delete that carries its row's values (:class:`ingest.types.ImageDeleteRow`).
DELETED_FLAG, IMAGE_FLAG = "_ingest_deleted", "_ingest_image"


def tombstone_table_name(cfg: PostgresSinkSettings, deletes: DeleteSettings) -> str:
    """The tombstone table of a sink table: ``deletes.tombstone_table``, else ``<table>_ingest_deleted``."""
    return deletes.tombstone_table or f"{cfg.table}_ingest_deleted"


class DeleteStatements:
    """The SQL of a table whose records can delete (``ingest.cdc``), composed once.

    A batch's rows (one per key, collapsed) are staged with a ``_ingest_deleted`` flag. Then, in
    the batch's transaction:

    - upserts skip keys whose tombstone is newer than the record (a stale upsert must not bring a
      deleted row back); a soft-deleted row that is upserted again is undeleted;
    - deletes remove the row (``hard``) or set the soft column (``soft``) only when the delete is not
      older than the row -- by the version column, or without one by the row's source: a record of
      the row's own partition at an older offset is older, other partitions apply in arrival order;
    - every delete's key, version and source go to the tombstone table (the newest kept), where
      they guard the key for ``tombstone_retention_s``.
    """

    def __init__(self, cfg: PostgresSinkSettings, deletes: DeleteSettings) -> None:
        target = table_ident(cfg.db_schema, cfg.table)
        self.tombstones = table_ident(cfg.db_schema, tombstone_table_name(cfg, deletes))
        self.retention_s = deletes.tombstone_retention_s
        keys = list(cfg.conflict_key)
        #: the columns a delete row carries besides its key: the version and the hidden source columns
        self.order_columns = [c for c in ([cfg.version_column] if cfg.version_column else [])
                              + [c for c in (STREAM_COLUMN, OFFSET_COLUMN) if c in cfg.columns]]
        self.tombstone_columns = keys + self.order_columns
        ident = sql.Identifier
        flag = ident(DELETED_FLAG)
        key_match = sql.SQL(" AND ").join(sql.SQL("t.{k} = s.{k}").format(k=ident(k)) for k in keys)
        d_match = sql.SQL(" AND ").join(sql.SQL("d.{k} = s.{k}").format(k=ident(k)) for k in keys)
        not_older = self._not_older(cfg, "s", "t")
        #: extra condition of the upsert's SELECT from the stage (``s``): not a delete, no newer tombstone
        self.upsert_filter = sql.SQL(" WHERE NOT s.{flag} AND NOT EXISTS (SELECT 1 FROM {tomb} d WHERE {m} AND {newer})"
                                     ).format(flag=flag, tomb=self.tombstones, m=d_match,
                                              newer=self._newer(cfg, "d", "s"))
        soft = deletes.mode == "soft"
        self.soft_column = deletes.soft_column if soft else None
        stage = sql.Identifier(stage_name(cfg.db_schema, cfg.table))
        if soft:
            col = ident(deletes.soft_column)
            mark = sql.SQL("now()") if deletes.soft_column_type == "timestamptz" else sql.SQL("true")
            live = (sql.SQL("t.{c} IS NULL") if deletes.soft_column_type == "timestamptz"
                    else sql.SQL("NOT t.{c}")).format(c=col)
            sets = sql.SQL(", ").join([sql.SQL("{c} = {m}").format(c=col, m=mark)]
                                      + [sql.SQL("{c} = s.{c}").format(c=ident(c)) for c in self.order_columns])
            self.delete = sql.SQL("UPDATE {t} AS t SET {sets} FROM {stage} AS s WHERE s.{flag} AND NOT s.{image} "
                                  "AND {km} AND {live} AND {ok}").format(t=target, sets=sets, stage=stage, flag=flag,
                                                                         image=ident(IMAGE_FLAG), km=key_match,
                                                                         live=live, ok=not_older)
            # A soft delete with its row's values (an upsert of the key came before it in the batch):
            # the row is written as that upsert would have, marked deleted. Its values are the staged
            # ones as the upsert reads them (json/jsonb are staged as text).
            cols = sql.SQL(", ").join(ident(c) for c in cfg.columns)
            values = sql.SQL(", ").join(stage_value(c, full, base in ("json", "jsonb"))
                                        for c, (base, full) in ((c, pg_base_type(spec.type))
                                                                for c, spec in cfg.columns.items()))
            marked = Also(sql.SQL("{c} = EXCLUDED.{c}").format(c=col),
                          sql.SQL("t.{c} IS DISTINCT FROM EXCLUDED.{c}").format(c=col))
            self.delete_with_image = sql.SQL(
                "INSERT INTO {t} AS t ({cols}, {c}) SELECT {values}, {m} FROM {stage} AS s WHERE s.{image} "
                "AND NOT EXISTS (SELECT 1 FROM {tomb} d WHERE {dm} AND {newer}){conflict}").format(
                t=target, cols=cols, values=values, c=col, m=mark, stage=stage, image=ident(IMAGE_FLAG),
                tomb=self.tombstones, dm=d_match, newer=self._newer(cfg, "d", "s"),
                conflict=UpsertStatements._conflict_clause(cfg, [marked]))
            #: ``ON CONFLICT DO UPDATE SET`` of the upsert gains ``soft = DEFAULT``: an upsert undeletes
            #: (a change whenever the stored row is marked: the column is not at its default, NULL / false)
            deleted = (sql.SQL("t.{c} IS NOT NULL") if deletes.soft_column_type == "timestamptz"
                       else sql.SQL("t.{c} IS DISTINCT FROM false")).format(c=col)
            self.undelete: tuple[Also, ...] = (Also(sql.SQL("{c} = DEFAULT").format(c=col), deleted),)
            soft_type = "timestamptz" if deletes.soft_column_type == "timestamptz" else "boolean NOT NULL DEFAULT false"
            self.soft_column_ddl = sql.SQL("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c} {ty}").format(
                t=target, c=col, ty=sql.SQL(soft_type))
        else:
            self.delete = sql.SQL("DELETE FROM {t} AS t USING {stage} AS s WHERE s.{flag} AND {km} AND {ok}").format(
                t=target, stage=stage, flag=flag, km=key_match, ok=not_older)
            self.undelete = ()
            self.soft_column_ddl = None
            self.delete_with_image = None
        cols = sql.SQL(", ").join(ident(c) for c in self.tombstone_columns)
        updates = sql.SQL(", ").join([sql.SQL("{c} = EXCLUDED.{c}").format(c=ident(c)) for c in self.order_columns]
                                     + [sql.SQL("deleted_at = now()")])
        self.record_tombstones = sql.SQL(
            "INSERT INTO {tomb} AS t ({cols}) SELECT {cols} FROM {stage} WHERE {flag} "
            "ON CONFLICT ({keys}) DO UPDATE SET {updates} WHERE {ok}").format(
            tomb=self.tombstones, cols=cols, stage=stage, flag=flag,
            keys=sql.SQL(", ").join(ident(k) for k in keys), updates=updates,
            ok=self._not_older(cfg, "EXCLUDED", "t"))
        self.expire = sql.SQL("DELETE FROM {tomb} WHERE deleted_at < now() - make_interval(secs => {s})").format(
            tomb=self.tombstones, s=sql.Literal(self.retention_s))
        defs = [sql.SQL("{} {} NOT NULL").format(ident(k), sql.SQL(pg_base_type(cfg.columns[k].type)[1]))
                for k in keys]
        defs += [sql.SQL("{} {}").format(ident(c), sql.SQL(pg_base_type(cfg.columns[c].type)[1]))
                 for c in self.order_columns]
        defs += [sql.SQL("deleted_at timestamptz NOT NULL DEFAULT now()"),
                 sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(ident(k) for k in keys))]
        self.create_tombstones = sql.SQL("CREATE TABLE IF NOT EXISTS {tomb} ({defs})").format(
            tomb=self.tombstones, defs=sql.SQL(", ").join(defs))

    @staticmethod
    def _not_older(cfg: PostgresSinkSettings, new: str, old: str) -> sql.Composable:
        """``new`` (a staged delete, or a tombstone's new values) is not older than ``old`` (the row / tombstone)."""
        n, o = sql.Identifier(new) if new != "EXCLUDED" else sql.SQL("EXCLUDED"), sql.Identifier(old)
        if cfg.version_column:
            v = sql.Identifier(cfg.version_column)
            return sql.SQL("({o}.{v} IS NULL OR {n}.{v} >= {o}.{v})").format(n=n, o=o, v=v)
        s, off = sql.Identifier(STREAM_COLUMN), sql.Identifier(OFFSET_COLUMN)
        return sql.SQL("({o}.{s} IS DISTINCT FROM {n}.{s} OR {o}.{off} IS NULL OR {n}.{off} >= {o}.{off})").format(
            n=n, o=o, s=s, off=off)

    @staticmethod
    def _newer(cfg: PostgresSinkSettings, tomb: str, rec: str) -> sql.Composable:
        """The tombstone ``tomb`` is newer than the staged record ``rec`` (which must then not be written)."""
        d, r = sql.Identifier(tomb), sql.Identifier(rec)
        if cfg.version_column:
            v = sql.Identifier(cfg.version_column)
            return sql.SQL("{d}.{v} > {r}.{v}").format(d=d, r=r, v=v)
        s, off = sql.Identifier(STREAM_COLUMN), sql.Identifier(OFFSET_COLUMN)
        return sql.SQL("{d}.{s} = {r}.{s} AND {d}.{off} > {r}.{off}").format(d=d, r=r, s=s, off=off)


def sink_table_sql(cfg: PostgresSinkSettings) -> list[sql.Composable]:
    """``CREATE SCHEMA`` / ``CREATE TABLE IF NOT EXISTS`` of a sink table (the key as its primary key, key
    and required columns NOT NULL), and the hidden source columns added to a table made before them."""
    cols = []
    for name, spec in cfg.columns.items():
        not_null = spec.required or name in cfg.conflict_key
        cols.append(
            sql.SQL("{} {}{}").format(
                sql.Identifier(name), sql.SQL(pg_base_type(spec.type)[1]), sql.SQL(" NOT NULL" if not_null else "")
            )
        )
    if cfg.conflict_key:
        cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in cfg.conflict_key)))
    table = sql.Identifier(cfg.db_schema, cfg.table)
    statements: list[sql.Composable] = [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(cfg.db_schema)),
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(table, sql.SQL(", ").join(cols)),
    ]
    if cfg.tracks_sources:  # tables made before ingest kept row sources get the columns (NULL: unknown)
        statements += [sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} bigint").format(table, sql.Identifier(name))
                       for name in SOURCE_COLUMNS]
    return statements

"""DDL for mirrored tables: read a table's shape from the catalog, create it, evolve it -- serialised
per table, idempotent, and safe against other processes doing the same at the same moment.

Entry points: :func:`ensure_postgres` and :func:`ensure_clickhouse` take the wanted shape (the union
of a batch's schemas) and an evolution mode, and return a :class:`DdlResult`: what was done
(``created``, ``altered``, ``unchanged``) with the statements run, or ``incompatible`` with the
differences (:class:`ingest.mirror.evolve.Incompatible`; nothing is run). ``dry_run=True`` reads the
catalog, plans, and returns the statements as text without running them (``ingest migrate
--dry-run``, ``ingest check``). :func:`read_postgres_shape` / :func:`read_clickhouse_shape` read a
table's shape (None: no such table).

Names reach SQL only quoted: :class:`psycopg.sql.Identifier` for PostgreSQL, backquotes
(:func:`ingest.core.dialects.ch_quote_ident`) for ClickHouse; column types only from the type map,
each checked by the repo's own type parser before it is written into a statement.

PostgreSQL
----------
Each attempt is one transaction: ``pg_advisory_xact_lock(k)`` with ``k`` a stable 64-bit hash of
(schema, table) (:func:`lock_key`: BLAKE2b of ``ingest.mirror``, the schema and the table), then the
catalog is read *inside the lock*, the plan made and its statements run (``CREATE SCHEMA IF NOT EXISTS``,
``CREATE TABLE IF NOT EXISTS ... PRIMARY KEY``, one ``ALTER TABLE`` with every ``ADD COLUMN IF NOT
EXISTS`` / ``ALTER COLUMN ... TYPE`` / ``DROP NOT NULL``), then the catalog is read again. Two ingest
processes therefore never interleave DDL on one table. A process that does not take the lock (an
older ``ingest migrate``, a person) can still win a race: a duplicate-object error (SQLSTATE 23505,
42P06, 42P07, 42701, 42710) rolls the attempt back and the next attempt re-reads and re-plans -- a CREATE
that loses a race is a success. The connection must be idle (not inside a transaction): each attempt
commits before the function returns.

ClickHouse
----------
ClickHouse has no advisory lock. DDL on one table is serialised inside the process (a lock per
database and table), and made safe across processes by re-planning: read the catalog, plan, run the
statements one by one, read again, until the plan is empty. ``CREATE TABLE IF NOT EXISTS`` and a
``MODIFY COLUMN`` to a type the column already has are no-ops; an ``ADD COLUMN`` that another process
ran first (DUPLICATE_COLUMN), a table or database created first (TABLE_ALREADY_EXISTS,
DATABASE_ALREADY_EXISTS) send the loop round again, and when the catalog read again still
needs that statement it was no race: the server's error is raised. The table is the one the ClickHouse sink and
``ingest migrate`` create: ``ReplacingMergeTree(version)`` (``ReplacingMergeTree(version,
_ingest_deleted)`` with deletes) ``ORDER BY`` the key, with ``non_replicated_deduplication_window``;
the version column (default ``_version UInt64``, fed from the Kafka offset) is added when the shape
lacks it. An existing keyed table whose engine is not that ``ReplacingMergeTree`` -- versioned by
another column or by insertion order, or without the delete mark a table with deletes needs -- is
``incompatible`` (:meth:`ClickHouseTable.engine_refusal`): its merges would keep rows by a rule the
records were not written for. A keyless (append-only) table is ``MergeTree ORDER BY tuple()``. The key is read back from
``system.columns.is_in_sorting_key``; columns come in their table order; ``MATERIALIZED`` and
``ALIAS`` columns are not part of a shape (nothing writes them).

Errors: a service that cannot answer raises :class:`~ingest.errors.TransientError` (retry later); a
statement the server refuses raises :class:`~ingest.errors.MigrationError` naming it. Races never
surface; more than :data:`MAX_ROUNDS` lost races in a row raise ``TransientError``.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ingest.core.dialects import ch_type, pg_base_type
from ingest.drivers.postgres import classify as classify_pg
from ingest.errors import MigrationError, TransientError
from ingest.mirror.evolve import Change, Evolve, Incompatible, Plan, plan
from ingest.mirror.names import CLICKHOUSE, POSTGRES
from ingest.mirror.shape import Column, Shape
from ingest.mirror.types import normalize_type, split_nullable
from ingest.sinks.clickhouse.errors import classify as classify_ch
from ingest.sinks.clickhouse.errors import error_code
from ingest.core.dialects import ch_quote_ident as quote_ident

__all__ = [
    "MAX_ROUNDS", "ClickHouseTable", "DdlResult", "clickhouse_statements", "clickhouse_tables", "ensure_clickhouse",
    "engine_arguments", "ensure_postgres", "lock_key", "postgres_statements", "postgres_tables",
    "read_clickhouse_shape", "read_clickhouse_table", "read_postgres_shape",
]

#: Attempts (lost races included) before giving up with a TransientError.
MAX_ROUNDS = 8

Action = Literal["created", "altered", "unchanged", "incompatible"]


@dataclass(frozen=True)
class DdlResult:
    """What :func:`ensure_postgres` / :func:`ensure_clickhouse` did (or, ``dry_run``, would do).

    ``statements``: the SQL run (or to run), as text; ``shape``: the table's shape afterwards (for a
    dry run: as it would be; for ``incompatible``: as it is); ``incompatible``: the differences when
    ``action`` is ``incompatible``. ``created`` means this call ran the CREATE: in PostgreSQL, under the
    lock, only the call that found no table; in ClickHouse another process's ``CREATE TABLE IF NOT
    EXISTS`` may have run first (both then say ``created``).
    """

    table: str
    action: Action
    statements: tuple[str, ...]
    shape: Shape | None
    incompatible: Incompatible | None = None
    dry_run: bool = False
    #: ClickHouse: the existing table's ``engine_full`` as read (None: no table, or PostgreSQL)
    engine: str | None = None


def _action(p: Plan | Incompatible) -> Action:
    if isinstance(p, Incompatible):
        return "incompatible"
    return "created" if p.create else ("altered" if p.changes else "unchanged")


_SAFE_DEFAULT = re.compile(r"^(\[\]|NULL|-?\d+(\.\d+)?)$")


def _default_sql(default: str | None) -> str:
    if default is None:
        return ""
    if not _SAFE_DEFAULT.match(default):
        raise ValueError(f"column default {default!r} is not one ingest writes (only [], NULL or a number)")
    return f" DEFAULT {default}"


# =========================================================================== PostgreSQL


def lock_key(schema: str, table: str) -> int:
    """The advisory lock key of a table: a signed 64-bit integer, the same in every process and run."""
    digest = hashlib.blake2b(b"ingest.mirror\x00" + schema.encode() + b"\x00" + table.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)


def read_postgres_shape(conn: psycopg.Connection[Any], schema: str, table: str) -> Shape | None:
    """The shape of ``schema.table`` from the catalog (columns in ``attnum`` order, types as
    :func:`ingest.mirror.types.normalize_type` spells them, the primary key), or None when there is no
    such table. Raises psycopg errors as they come."""
    row = conn.execute(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')", (schema, table)).fetchone()
    if row is None:
        return None
    oid = row[0]
    cols = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid) "
        "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", (oid,)).fetchall()
    key = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisprimary ORDER BY array_position(i.indkey::int2[], a.attnum)",
        (oid,)).fetchall()
    columns = tuple(Column(name, normalize_type(t, POSTGRES), not notnull, default)
                    for name, t, notnull, default in cols)
    return Shape(POSTGRES, columns, tuple(k for (k,) in key))


def postgres_tables(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """The names of the tables in ``schema`` (to seed a :class:`ingest.mirror.names.NameGuard`)."""
    rows = conn.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY c.oid", (schema,)).fetchall()
    return [r[0] for r in rows]


def _pg_type(t: str) -> sql.SQL:
    pg_base_type(t)  # ValueError for anything but a type of the dialect: never arbitrary text into SQL
    return sql.SQL(t)


def _pg_column(shape: Shape, c: Column) -> sql.Composed:
    return sql.SQL("{} {}{}{}").format(sql.Identifier(c.name), _pg_type(c.type),
                                       sql.SQL("" if c.nullable else " NOT NULL"), sql.SQL(_default_sql(c.default)))


def postgres_statements(schema: str, table: str, p: Plan) -> list[sql.Composed]:
    """The statements of a plan for ``schema.table``: CREATE SCHEMA + CREATE TABLE for a create, one
    ALTER TABLE with every change otherwise (none for an empty plan)."""
    target = sql.Identifier(schema, table)
    shape = p.shape
    if p.create:
        parts = [_pg_column(shape, c) for c in shape.columns]
        if shape.key:
            parts.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, shape.key))))
        return [sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(target, sql.SQL(", ").join(parts))]
    actions = [_pg_action(shape, ch) for ch in p.changes]
    if not actions:
        return []
    return [sql.SQL("ALTER TABLE {} {}").format(target, sql.SQL(", ").join(actions))]


def _pg_action(shape: Shape, ch: Change) -> sql.Composed:
    name = sql.Identifier(ch.column.name)
    if ch.kind == "add":
        return sql.SQL("ADD COLUMN IF NOT EXISTS {}").format(_pg_column(shape, ch.column))
    if ch.kind == "widen":
        return sql.SQL("ALTER COLUMN {} TYPE {}").format(name, _pg_type(ch.column.type))
    return sql.SQL("ALTER COLUMN {} DROP NOT NULL").format(name)


#: SQLSTATEs of a DDL that lost a race: the object exists now (unique_violation on a catalog index,
#: duplicate_schema, duplicate_table, duplicate_column, duplicate_object).
_PG_LOST_RACE = (pg_errors.UniqueViolation, pg_errors.DuplicateSchema, pg_errors.DuplicateTable,
                 pg_errors.DuplicateColumn, pg_errors.DuplicateObject)


def ensure_postgres(conn: psycopg.Connection[Any], schema: str, table: str, wanted: Shape,
                    mode: Evolve = "add_columns", *, dry_run: bool = False,
                    extra_columns: Iterable[Column] = ()) -> DdlResult:
    """Make ``schema.table`` fit ``wanted`` under ``mode`` (see the module docstring).

    ``conn``: an idle connection (ValueError otherwise); blocks while another process holds the
    table's DDL lock. ``extra_columns``: columns the pipeline manages that the table must have too.
    Raises TransientError (connection lost, too many lost races) or MigrationError (a statement refused).
    """
    if wanted.dialect != POSTGRES:
        raise ValueError("a PostgreSQL table needs a postgres shape")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("ensure_postgres needs a connection that is not inside a transaction")
    wanted = wanted.with_columns(extra_columns)
    try:
        if dry_run:
            existing = read_postgres_shape(conn, schema, table)
            if not conn.autocommit:
                conn.rollback()
            p = plan(existing, wanted, mode)
            if isinstance(p, Incompatible):
                return DdlResult(table, "incompatible", (), existing, p, dry_run=True)
            text = tuple(s.as_string(conn) for s in postgres_statements(schema, table, p))
            return DdlResult(table, _action(p), text, p.shape, dry_run=True)
        return _ensure_postgres(conn, schema, table, wanted, mode)
    except (TransientError, MigrationError):
        raise
    except psycopg.Error as exc:
        raise _pg_error(exc, schema, table) from exc


def _ensure_postgres(conn: psycopg.Connection[Any], schema: str, table: str, wanted: Shape,
                     mode: Evolve) -> DdlResult:
    ran: list[str] = []
    first: Action | None = None
    for _ in range(MAX_ROUNDS):
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema, table),))
                existing = read_postgres_shape(conn, schema, table)
                p = plan(existing, wanted, mode)
                if isinstance(p, Incompatible):
                    return DdlResult(table, "incompatible", tuple(ran), existing, p)
                statements = postgres_statements(schema, table, p)
                for stmt in statements:
                    conn.execute(stmt)
                text = [s.as_string(conn) for s in statements]
                after = read_postgres_shape(conn, schema, table) if statements else existing
        except _PG_LOST_RACE:
            continue  # someone else created it first: read again, plan again
        if text and first is None:
            first = _action(p)
        ran += text
        again = plan(after, wanted, mode)
        if isinstance(again, Plan) and again.empty:
            return DdlResult(table, first or "unchanged", tuple(ran), after)
    raise TransientError(f"table {schema}.{table}: DDL did not settle after {MAX_ROUNDS} rounds (lost races)")


def _pg_error(exc: psycopg.Error, schema: str, table: str) -> Exception:
    err = classify_pg(exc)
    if isinstance(err, TransientError):
        return err
    return MigrationError(f"table {schema}.{table}: the database refused the DDL: {err}")


# =========================================================================== ClickHouse


@dataclass(frozen=True)
class ClickHouseTable:
    """Where and how a mirrored ClickHouse table is made: ``database``, ``table``, the ``version_column``
    of ``ReplacingMergeTree`` (added as ``UInt64`` when the shape lacks it), ``deletes`` (the
    ``_ingest_deleted UInt8`` column and ``ReplacingMergeTree(version, _ingest_deleted)``, ClickHouse
    23.2+), ``deduplication_window`` (``non_replicated_deduplication_window``; None: no ``SETTINGS``,
    for servers that lack it)."""

    table: str
    database: str = "default"
    version_column: str = "_version"
    deletes: bool = False
    deduplication_window: int | None = 1000
    #: the version column's type when the sink adds it (a shape's own version column keeps its type)
    version_type: str = "UInt64"

    def managed_columns(self, shape: Shape) -> tuple[Column, ...]:
        """The columns the sink adds to a keyed table: the version column (unless the shape has it)
        and, with deletes, ``_ingest_deleted``."""
        if not shape.key:
            return ()
        out = [] if shape.column(self.version_column) else [Column(self.version_column, self.version_type, False)]
        if self.deletes:
            out.append(Column(_DELETED, "UInt8", False))
        return tuple(out)

    def engine_refusal(self, engine_full: str) -> str | None:
        """Why an existing keyed table of engine ``engine_full`` (``system.tables.engine_full``) is not
        made as this one is (None: it is): it must be a ``ReplacingMergeTree`` versioned by
        ``version_column`` and, with deletes, marked by ``_ingest_deleted``. A table versioned by another
        column keeps, on merge and with ``FINAL``, the row of the highest value *there*, not of the
        version the records carry: writing into it would look right until the first merge."""
        name, args = engine_arguments(engine_full)
        if not name.endswith("ReplacingMergeTree"):
            return f"its engine is {name}, not ReplacingMergeTree({_quote(self.version_column)}): ingest never " \
                   "writes a keyed table it cannot version"
        args = [a for a in args if not a.startswith("'")]  # a Replicated engine's path and replica name
        version = args[0] if args else None
        if version != self.version_column:
            by = f"column {version!r}" if version else "insertion order"
            return f"it is versioned by {by}, not by {self.version_column!r} (ReplacingMergeTree" \
                   f"({_quote(self.version_column)}) as this pipeline makes it): re-create it, or version the " \
                   "pipeline as the table is"
        if self.deletes and (len(args) < 2 or args[1] != _DELETED):
            return f"its ReplacingMergeTree has no {_DELETED!r} mark: the pipeline's deletes would not hide rows"
        return None


_quote = quote_ident
#: The delete mark of a keyed table with deletes (``ReplacingMergeTree(version, _ingest_deleted)``).
_DELETED = "_ingest_deleted"


def engine_arguments(engine_full: str) -> tuple[str, list[str]]:
    """``(engine name, its arguments)`` of ``system.tables.engine_full``: ``ReplacingMergeTree(`v`, d)
    ORDER BY ...`` → ``("ReplacingMergeTree", ["v", "d"])``; backquoted names unquoted, string literals
    kept with their quotes."""
    match = re.match(r"\s*(\w+)", engine_full)
    name = match.group(1) if match else ""
    rest = engine_full[match.end():] if match else ""
    if not rest.startswith("("):
        return name, []
    args: list[str] = []
    current: list[str] = []
    quote: str | None = None
    i = 1
    while i < len(rest):
        ch = rest[i]
        if quote is not None:
            if ch == "\\" and i + 1 < len(rest):
                i += 1
                current.append(rest[i] if quote == "`" else ch + rest[i])
            elif ch == quote:
                quote = None
                if ch == "'":
                    current.append(ch)
            else:
                current.append(ch)
        elif ch in "`'":
            quote = ch
            if ch == "'":
                current.append(ch)
        elif ch in ",)":
            if current or ch == ",":
                args.append("".join(current).strip())
            current = []
            if ch == ")":
                break
        else:
            current.append(ch)
        i += 1
    return name, args


def _ch_ddl_type(shape: Shape, c: Column) -> str:
    # ch_type: ValueError for a type outside the dialect (never arbitrary text into SQL); its ddl
    # spelling is what the server gets (JSON is created as String, as the sink does)
    return ch_type(shape.ddl_type(c)).ddl


def _ch_column(shape: Shape, c: Column) -> str:
    return f"{_quote(c.name)} {_ch_ddl_type(shape, c)}{_default_sql(c.default)}"


def clickhouse_statements(where: ClickHouseTable, p: Plan) -> list[str]:
    """The statements of a plan: CREATE DATABASE + CREATE TABLE for a create, one ALTER TABLE per
    change otherwise (each one idempotent or recognisably a lost race)."""
    target = f"{_quote(where.database)}.{_quote(where.table)}"
    shape = p.shape
    if p.create:
        cols = ",\n    ".join(_ch_column(shape, c) for c in shape.columns)
        if shape.key:
            version = _quote(where.version_column) + (f", {_quote('_ingest_deleted')}" if where.deletes else "")
            order_by = ", ".join(_quote(k) for k in shape.key)
            engine = f"ReplacingMergeTree({version})\nORDER BY ({order_by})"
            if where.deduplication_window is not None:
                engine += f"\nSETTINGS non_replicated_deduplication_window = {int(where.deduplication_window)}"
        else:
            engine = "MergeTree\nORDER BY tuple()"
        return [f"CREATE DATABASE IF NOT EXISTS {_quote(where.database)}",
                f"CREATE TABLE IF NOT EXISTS {target} (\n    {cols}\n)\nENGINE = {engine}"]
    out = []
    for ch in p.changes:
        if ch.kind == "add":
            out.append(f"ALTER TABLE {target} ADD COLUMN {_ch_column(shape, ch.column)}")
        else:
            out.append(f"ALTER TABLE {target} MODIFY COLUMN {_quote(ch.column.name)} {_ch_ddl_type(shape, ch.column)}")
    return out


def _split_key(sorting_key: str) -> list[str]:
    """``a, `b c`, d`` → ['a', 'b c', 'd'] (backquoted names unescaped)."""
    out: list[str] = []
    i, n = 0, len(sorting_key)
    while i < n:
        while i < n and sorting_key[i] in " ,()":
            i += 1
        if i >= n:
            break
        if sorting_key[i] == "`":
            j, buf = i + 1, []
            while j < n and sorting_key[j] != "`":
                if sorting_key[j] == "\\" and j + 1 < n:
                    j += 1
                buf.append(sorting_key[j])
                j += 1
            out.append("".join(buf))
            i = j + 1
        else:
            j = i
            while j < n and sorting_key[j] not in ",":
                j += 1
            out.append(sorting_key[i:j].strip())
            i = j
    return out


def clickhouse_tables(client: Any, database: str) -> list[str]:
    """The names of the tables in ``database`` (to seed a :class:`ingest.mirror.names.NameGuard`)."""
    return [r[0] for r in client.query("SELECT name FROM system.tables WHERE database = %(db)s",
                                       parameters={"db": database}).result_rows]


def read_clickhouse_shape(client: Any, database: str, table: str) -> Shape | None:
    """The shape of ``database.table`` from ``system.tables`` / ``system.columns`` (clickhouse-connect
    client), or None when there is no such table. Raises the client's errors as they come."""
    found = read_clickhouse_table(client, database, table)
    return found[0] if found is not None else None


def read_clickhouse_table(client: Any, database: str, table: str) -> tuple[Shape, str] | None:
    """``(shape, engine_full)`` of ``database.table`` (see :func:`read_clickhouse_shape`), or None."""
    where = {"db": database, "t": table}
    rows = client.query("SELECT sorting_key, engine_full FROM system.tables WHERE database = %(db)s AND name = %(t)s",
                        parameters=where).result_rows
    if not rows:
        return None
    cols = client.query(
        "SELECT name, type, default_kind, default_expression, is_in_sorting_key FROM system.columns "
        "WHERE database = %(db)s AND table = %(t)s", parameters=where).result_rows
    columns = []
    in_key = []
    for name, type_text, default_kind, default_expr, sorting in cols:
        if default_kind in ("MATERIALIZED", "ALIAS", "EPHEMERAL"):
            continue
        base, nullable = split_nullable(str(type_text))
        columns.append(Column(name, normalize_type(base, CLICKHOUSE), nullable,
                              str(default_expr) if default_kind == "DEFAULT" and default_expr != "" else None))
        if sorting:
            in_key.append(name)
    order = _split_key(str(rows[0][0] or ""))
    key = sorted(in_key, key=lambda k: order.index(k) if k in order else len(order))
    return Shape(CLICKHOUSE, tuple(columns), tuple(key)), str(rows[0][1] or "")


#: ClickHouse error codes of a DDL that may have lost a race: DUPLICATE_COLUMN (ILLEGAL_COLUMN on
#: servers before about 19.x, which say "column with this name already exists" with code 44),
#: TABLE_ALREADY_EXISTS, DATABASE_ALREADY_EXISTS. It was a lost race when the catalog, read again, no
#: longer needs the statement; when it still does, the error is raised as it is.
_CH_LOST_RACE = frozenset({15, 44, 57, 82})


class KeyedLocks:
    """One lock per key, made on first use: DDL on one table never holds up another's. Thread-safe."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Any, threading.Lock] = {}

    def __call__(self, key: Any) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())


#: ClickHouse has no advisory lock: a table's DDL is serialised in the process
_ch_lock = KeyedLocks()


def _ch_plan(client: Any, where: ClickHouseTable, wanted: Shape, mode: Evolve,
             ) -> tuple[Shape | None, str | None, Plan | Incompatible]:
    """``(existing shape, its engine_full, plan)`` of ``where`` for ``wanted`` (managed columns
    included): Incompatible when the columns cannot take it or the engine is not ``where``'s."""
    found = read_clickhouse_table(client, where.database, where.table)
    existing, engine = found if found is not None else (None, None)
    refusal = where.engine_refusal(engine) if existing is not None and existing.key and engine is not None else None
    if refusal is not None:
        return existing, engine, Incompatible((refusal,))
    return existing, engine, plan(existing, wanted, mode)


def ensure_clickhouse(client: Any, where: ClickHouseTable, wanted: Shape, mode: Evolve = "add_columns", *,
                      dry_run: bool = False) -> DdlResult:
    """Make ``where.database``.``where.table`` fit ``wanted`` (plus the version / deletes columns of
    :meth:`ClickHouseTable.managed_columns`) under ``mode`` (see the module docstring). ``client``: a
    clickhouse-connect client. Blocks while another thread of this process runs DDL on the table.
    Raises TransientError (the server does not answer, too many lost races) or MigrationError."""
    if wanted.dialect != CLICKHOUSE:
        raise ValueError("a ClickHouse table needs a clickhouse shape")
    wanted = wanted.with_columns(where.managed_columns(wanted))
    name = f"{where.database}.{where.table}"
    try:
        if dry_run:
            existing, engine, p = _ch_plan(client, where, wanted, mode)
            if isinstance(p, Incompatible):
                return DdlResult(where.table, "incompatible", (), existing, p, dry_run=True, engine=engine)
            return DdlResult(where.table, _action(p), tuple(clickhouse_statements(where, p)), p.shape, dry_run=True,
                             engine=engine)
        with _ch_lock((where.database, where.table)):
            ran: list[str] = []
            first: Action | None = None
            failed: tuple[str, Exception] | None = None
            for _ in range(MAX_ROUNDS):
                existing, engine, p = _ch_plan(client, where, wanted, mode)
                if isinstance(p, Incompatible):
                    return DdlResult(where.table, "incompatible", tuple(ran), existing, p, engine=engine)
                if p.empty:
                    return DdlResult(where.table, first if (first and ran) else "unchanged", tuple(ran), existing,
                                     engine=engine)
                statements = clickhouse_statements(where, p)
                if failed is not None and failed[0] in statements:
                    raise failed[1]  # not a lost race after all: the catalog still lacks what it refused
                failed = None
                if first is None:
                    first = _action(p)
                for stmt in statements:
                    try:
                        client.command(stmt)
                    except Exception as exc:  # noqa: BLE001 - a lost race, or translated below
                        if error_code(exc) in _CH_LOST_RACE:
                            failed = (stmt, exc)
                            break  # someone else did it first: read again, plan again
                        raise
                    ran.append(stmt)
            raise TransientError(f"table {name}: DDL did not settle after {MAX_ROUNDS} rounds (lost races)")
    except (TransientError, MigrationError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - driver errors, translated at this boundary
        err = classify_ch(exc)
        if isinstance(err, TransientError):
            raise err from exc
        raise MigrationError(f"table {name}: ClickHouse refused the DDL: {err}") from exc


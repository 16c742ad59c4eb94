"""The sanitiser: a rendered table name (or a schema's field name) → an identifier, by fixed rules.

Names are always quoted when they reach SQL (PostgreSQL: :class:`psycopg.sql.Identifier`; ClickHouse:
backquotes, :func:`ingest.core.dialects.ch_quote_ident`), so almost any text can be a name.
The rules only remove what would be *ambiguous* or *impossible*, and refuse instead of guessing:

1. ``.`` becomes ``_`` (tables only): a dotted topic such as ``shop.public.orders`` never reads as
   ``schema.table``; the table's schema (PostgreSQL) or database (ClickHouse) comes from the config.
   Every other character is kept as it is: case, spaces, quotes, backquotes, unicode. Nothing is
   normalised (NFC and NFD spellings are two names).
2. Refused (reason ``empty_name``): the empty name.
3. Refused (reason ``control_character``): NUL and every other control character (Unicode category
   Cc: C0, DEL, C1), lone surrogates (Cs: not encodable in UTF-8) and the line / paragraph separators
   (Zl, Zp). They cannot be stored (NUL) or make logs and ``psql`` output lie.
4. Refused (reason ``too_long``) -- a longer name is never truncated, since two long names would become
   one table:

   - PostgreSQL: more than 63 bytes of UTF-8 (``NAMEDATALEN - 1``; PostgreSQL itself would cut the
     name silently). A table whose derived tables must fit too (the tombstone table
     ``<table>_ingest_deleted`` of a table with deletes) passes their suffixes: the longest
     must fit as well.
   - ClickHouse: a table is stored as files named after it, escaped (every byte but ``[A-Za-z0-9_]``
     becomes ``%XX``), and the server refuses a name whose escaped form leaves no room for its
     metadata file name in the file system's 255-byte ``NAME_MAX``: at most
     ``min(255 - len('.sql.detached'), 255 - len(escaped database) - 42)`` escaped bytes
     (ClickHouse's ``computeMaxTableNameLength``; 206 for database ``default``). The check here
     is that, on the escaped length. Column names are stored as file names too (``<column>.bin``,
     ``<column>.size0.mrk2``, ...): at most :data:`CH_MAX_COLUMN_ESCAPED` escaped bytes.
5. Refused (reason ``reserved_name``): ingest's own tables -- ``ingest_offsets``,
   ``ingest_lane_offsets``, the DLQ table (``dlq.table``, default ``ingest_dlq``), any tombstone table
   (a name ending in ``_ingest_deleted``), and any name given in ``Reserved.tables`` (a configured
   ``deletes.tombstone_table``). Compared after folding (rule 6). Columns: a field name starting with
   ``_ingest_`` is refused (ingest's hidden columns) and so is the ClickHouse version column.
6. Case (reason ``case_collision``, :class:`NameGuard`): PostgreSQL folds *unquoted* names to lower
   case (ASCII letters only, in a UTF-8 database). ingest quotes, so ``Orders`` and ``orders`` would be
   two tables -- but anyone who writes ``select * from Orders`` reaches ``orders``, and a source whose
   names are case-insensitive (MySQL on macOS or Windows, SQL Server's default collation) means one
   table by both. So for PostgreSQL two names that differ only in ASCII case are a collision: the
   first spelling the guard sees (or finds in the catalog) owns the name, a second spelling is
   refused. ClickHouse folds no identifier and is case-sensitive throughout: no collision there.

Every refusal raises :class:`~ingest.mirror.errors.Unroutable` with its reason (a field name that
cannot be a column raises :class:`~ingest.mirror.errors.SchemaIncompatible`, reason ``bad_column_name``);
the record is dead-lettered with class ``unroutable`` / ``schema_incompatible``. Pure: no I/O.
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

from ingest.mirror.errors import SchemaIncompatible, Unroutable

__all__ = [
    "CH_MAX_COLUMN_ESCAPED", "CLICKHOUSE", "DIALECTS", "NAME_MAX", "PG_MAX_BYTES", "POSTGRES", "NameGuard",
    "Reserved", "ch_escaped", "ch_max_table_name", "check_column", "fold", "sanitize_table",
]

POSTGRES = "postgres"
CLICKHOUSE = "clickhouse"
DIALECTS = (POSTGRES, CLICKHOUSE)

#: PostgreSQL's identifier limit in bytes (``NAMEDATALEN - 1``).
PG_MAX_BYTES = 63
#: The file-name limit ClickHouse computes table name lengths from (Linux ``NAME_MAX``).
NAME_MAX = 255
#: ClickHouse: the longest escaped column name accepted: ``NAME_MAX`` less room for the longest
#: suffix a column's files get (``.size0.null.mrk2``-like, nested types add more): a margin of 55.
CH_MAX_COLUMN_ESCAPED = 200
_CH_CREATE_SUFFIX = len(".sql.detached")
_CH_DROPPED_EXTRA = 1 + 1 + 36 + len(".sql")  # ./metadata_dropped/{db}.{table}.{uuid}.sql

#: ingest's fixed tables (``ingest.sinks.postgres.exactly_once``)
OWN_TABLES = ("ingest_offsets", "ingest_lane_offsets")
TOMBSTONE_SUFFIX = "_ingest_deleted"
HIDDEN_COLUMN_PREFIX = "_ingest_"

_REFUSED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def fold(name: str, dialect: str) -> str:
    """The name as the sink would take it unquoted: PostgreSQL lower-cases ASCII letters; ClickHouse
    keeps it."""
    if dialect == POSTGRES:
        return name.translate(_ASCII_LOWER)
    return name


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ch_escaped(name: str) -> str:
    """ClickHouse's ``escapeForFileName``: ``[A-Za-z0-9_]`` kept, every other byte of UTF-8 as ``%XX``."""
    out = []
    for b in name.encode("utf-8", "surrogatepass"):
        c = chr(b)
        out.append(c if (c.isascii() and (c.isalnum() or c == "_")) else f"%{b:02X}")
    return "".join(out)


def ch_max_table_name(database: str) -> int:
    """The longest escaped table name ClickHouse accepts in ``database`` (see rule 4)."""
    return max(0, min(NAME_MAX - _CH_CREATE_SUFFIX, NAME_MAX - len(ch_escaped(database)) - _CH_DROPPED_EXTRA))


@dataclass(frozen=True)
class Reserved:
    """The names no routed table may take (rule 5): ``dlq_table`` and any of ``tables``, besides
    ingest's fixed tables and the tombstone suffix."""

    dlq_table: str = "ingest_dlq"
    tables: frozenset[str] = field(default_factory=frozenset)

    def why(self, name: str, dialect: str) -> str | None:
        """Why ``name`` is reserved, or None when it is free."""
        folded = fold(name, dialect)
        if folded in {fold(t, dialect) for t in OWN_TABLES}:
            return "one of ingest's offsets tables"
        if folded == fold(self.dlq_table, dialect):
            return "the DLQ table"
        if folded.endswith(TOMBSTONE_SUFFIX):
            return f"a tombstone table name (ending in {TOMBSTONE_SUFFIX!r})"
        if folded in {fold(t, dialect) for t in self.tables}:
            return "a table ingest manages (a configured tombstone table)"
        return None


def _bad_character(name: str) -> tuple[int, str] | None:
    for i, ch in enumerate(name):
        if unicodedata.category(ch) in _REFUSED_CATEGORIES:
            return i, ch
    return None


def sanitize_table(rendered: str, dialect: str, *, database: str = "default",
                   reserved: Reserved | None = None, suffixes: Iterable[str] = ()) -> str:
    """The table identifier for a rendered name, by rules 1-5 of the module docstring.

    ``dialect``: :data:`POSTGRES` or :data:`CLICKHOUSE`; ``database``: the ClickHouse database (its
    length shortens the limit); ``suffixes``: names derived by appending (e.g. ``("_ingest_deleted",)``
    for a PostgreSQL table with deletes) that must fit as well. Raises :class:`Unroutable`.
    Rule 6 is the :class:`NameGuard`'s.
    """
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}")
    if not rendered:
        raise Unroutable("empty_name", "the table template rendered an empty name")
    bad = _bad_character(rendered)
    if bad is not None:
        raise Unroutable("control_character", f"table name {rendered!r} has a control character "
                                              f"U+{ord(bad[1]):04X} at position {bad[0]}")
    name = rendered.replace(".", "_")
    longest = max((len(s.encode("utf-8")) for s in suffixes), default=0)
    if dialect == POSTGRES:
        size = len(name.encode("utf-8"))
        if size + longest > PG_MAX_BYTES:
            extra = f" (with its derived suffix, {size + longest})" if longest else ""
            raise Unroutable("too_long", f"table name {_short(name)} is {size} bytes{extra}; PostgreSQL "
                                         f"names hold at most {PG_MAX_BYTES}")
    else:
        size = len(ch_escaped(name))
        limit = ch_max_table_name(database)
        if size + longest > limit:
            raise Unroutable("too_long", f"table name {_short(name)} is {size} bytes as a "
                                         f"ClickHouse file name; database {database!r} allows {limit}")
    why = (reserved or Reserved()).why(name, dialect)
    if why is not None:
        raise Unroutable("reserved_name", f"table name {name!r} is {why}")
    return name


def check_column(name: str, dialect: str, *, reserved: Iterable[str] = ()) -> str:
    """A schema's field name as a column name: kept as it is (dots too: a column is never qualified),
    refused by rules 2-5 with :class:`SchemaIncompatible` (reason ``bad_column_name``). ``reserved``:
    more names the sink manages (the ClickHouse version column)."""
    def refuse(why: str) -> SchemaIncompatible:
        return SchemaIncompatible("bad_column_name", f"field {_short(name)} cannot be a column: {why}")

    if not name:
        raise refuse("the name is empty")
    bad = _bad_character(name)
    if bad is not None:
        raise refuse(f"control character U+{ord(bad[1]):04X} at position {bad[0]}")
    if dialect == POSTGRES and len(name.encode("utf-8")) > PG_MAX_BYTES:
        raise refuse(f"{len(name.encode('utf-8'))} bytes; PostgreSQL names hold at most {PG_MAX_BYTES}")
    if dialect == CLICKHOUSE and len(ch_escaped(name)) > CH_MAX_COLUMN_ESCAPED:
        raise refuse(f"{len(ch_escaped(name))} bytes as a ClickHouse file name; at most {CH_MAX_COLUMN_ESCAPED}")
    if name.startswith(HIDDEN_COLUMN_PREFIX) or name in set(reserved):
        raise refuse("the name is reserved for ingest's own columns")
    return name


def _short(name: str) -> str:
    return repr(name) if len(name) <= 80 else repr(name[:60] + "…") + f" ({len(name)} characters)"


class NameGuard:
    """Rule 6: the first spelling of a name owns it; a second spelling that the sink folds to the same
    name is refused. Thread-safe; one per sink (schema or database), kept for the run.

    ``existing``: names already in the catalog (they own their folded name from the start).
    """

    def __init__(self, dialect: str, existing: Iterable[str] = ()) -> None:
        self.dialect = dialect
        self._owners: dict[str, str] = {}
        self._lock = threading.Lock()
        for name in existing:
            self._owners.setdefault(fold(name, dialect), name)

    def claim(self, name: str) -> str:
        """``name`` when it is the first spelling of its folded form (or that same spelling again);
        raises :class:`Unroutable` (``case_collision``) for another spelling."""
        key = fold(name, self.dialect)
        with self._lock:
            owner = self._owners.setdefault(key, name)
        if owner != name:
            raise Unroutable("case_collision", f"table name {name!r} differs from the existing {owner!r} only in "
                                               "case; PostgreSQL folds unquoted names, so they would be confused")
        return name

    def claim_existing(self, name: str) -> None:
        """A name found in the catalog: it owns its folded form unless a spelling already does."""
        with self._lock:
            self._owners.setdefault(fold(name, self.dialect), name)

    def known(self) -> dict[str, str]:
        """Folded name → the spelling that owns it (a copy)."""
        with self._lock:
            return dict(self._owners)

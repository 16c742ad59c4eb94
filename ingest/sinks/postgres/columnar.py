"""Writing an Arrow batch (:mod:`ingest.core.mapping.columnar`) into a PostgreSQL sink table.

One transaction per batch, two statements: the table's columns are written as CSV by Arrow's
C writer (:func:`csv_bytes`, on whichever thread plans the batch) and sent in one
``COPY ... FROM STDIN (FORMAT csv)`` into a temporary stage, then one
``INSERT ... SELECT ... ORDER BY <key> ON CONFLICT`` applies them with the table's own conflict clause (the
one the row path uses, guards included: :meth:`UpsertStatements._conflict_clause`). The stage is
``ON COMMIT DELETE ROWS``: the commit (or a rollback) empties it by truncation, so no ``DELETE``
runs and no dead rows pile up in a table that autovacuum never visits (temporary tables are
not vacuumed; a ``DELETE`` per batch made each later ``DELETE`` and upsert scan more pages).

The stage holds each column as the columnar tier stages it, and the ``SELECT`` converts:

- ``int``: ``int8``, assigned to the column (its range was checked per batch);
- ``text``: ``text``, assigned (a ``varchar(n)`` column checks its length on assignment, as on
  the row path);
- ``numeric``: a JSON number's shortest round-trip digits as ``text`` (Arrow's CSV writer writes
  the digits ``float_decimal`` keeps, or the plan made the text), cast to the column's ``numeric``
  type as the row path's text stage does;
- ``timestamp``: ``int8`` microseconds since the epoch (from epoch milliseconds or ISO 8601 text),
  added to the epoch as an interval (exact for the range the tier accepts, ``|us| < 2**53``; an
  interval of microseconds only adds them, whatever the session's time zone);
- ``json``: the row mapper's JSON text, cast to the column's ``json`` / ``jsonb`` type as the row
  path's stage does;
- ``float``: ``float8`` (Arrow writes the shortest digits that round-trip, which ``float8in`` reads
  back bit for bit); ``bool``: ``boolean``, assigned.

Every value is quoted (``quoting_style="all_valid"``): an unquoted empty field is NULL, a quoted
one the empty string, and no line can be a lone ``\\.``. Every name is composed with
:class:`psycopg.sql.Identifier`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import sql

from ingest.core.dialects import pg_base_type
from ingest.core.mapping.columnar import StagedColumn
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.statements import (DELETED_FLAG, IMAGE_FLAG, ROUTE_COLUMN, UpsertStatements, stage_name,
                                               table_ident)

_STAGE_TYPE = {"int": "int8", "text": "text", "numeric": "text", "timestamp": "int8", "float": "float8",
               "bool": "boolean", "json": "text"}


class ColumnarStatements:
    """The SQL of the columnar write for one table, composed once.

    With ``row_stage`` (a table whose records delete: :class:`~ingest.sinks.postgres.statements.DeleteStatements`)
    the CSV also holds the row path's two flag columns, and instead of the upsert, :attr:`transfer` moves
    the staged rows -- converted by the same expressions -- into the row path's stage, where the row
    path's own statements (upsert, delete, tombstones) apply them."""

    def __init__(self, cfg: PostgresSinkSettings, columns: Sequence[StagedColumn],
                 row_stage: UpsertStatements | None = None, *,
                 shared_stage: str | None = None, route: int | None = None) -> None:
        """Tables a pipeline routes to share one stage per session whose rows carry the number of their
        table (:data:`~ingest.sinks.postgres.statements.ROUTE_COLUMN`): ``shared_stage`` names it,
        ``route`` is this table's number (its upsert reads only its rows)."""
        if [c.name for c in columns] != list(cfg.columns):
            raise ValueError("the columnar plan's columns are not the sink's")
        if any(c.kind not in _STAGE_TYPE for c in columns):
            raise ValueError("the columnar plan stages a column PostgreSQL's columnar write does not take")
        target = table_ident(cfg.db_schema, cfg.table)
        stage = sql.Identifier(shared_stage or stage_name(cfg.db_schema, cfg.table) + "_c")
        ident = sql.Identifier
        flags = [DELETED_FLAG, IMAGE_FLAG] if row_stage is not None else []
        staged = [(c.name, _STAGE_TYPE[c.kind]) for c in columns] + [(f, "boolean") for f in flags]
        if shared_stage is not None:
            staged.append((ROUTE_COLUMN, "int4"))
        defs = sql.SQL(", ").join(sql.SQL("{} {}").format(ident(name), sql.SQL(kind)) for name, kind in staged)
        self.create_stage = sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {stage} ({defs}) ON COMMIT DELETE ROWS").format(
            stage=stage, defs=defs)
        names = sql.SQL(", ").join(ident(c.name) for c in columns)
        self.copy_stage = sql.SQL("COPY {stage} ({names}) FROM STDIN (FORMAT csv)").format(
            stage=stage, names=sql.SQL(", ").join(ident(name) for name, _ in staged))
        selects = []
        for c in columns:
            full = pg_base_type(cfg.columns[c.name].type)[1]
            if c.kind in ("numeric", "json"):
                selects.append(sql.SQL("{}::{}").format(ident(c.name), sql.SQL(full)))
            elif c.kind == "timestamp":
                epoch = sql.SQL("'epoch'::timestamptz" if c.aware else "'epoch'::timestamp")
                selects.append(sql.SQL("{} + {} * interval '1 microsecond'").format(epoch, ident(c.name)))
            else:
                selects.append(ident(c.name))
        where = (sql.SQL(" WHERE {} = {}").format(ident(ROUTE_COLUMN), sql.Literal(int(route)))
                 if route is not None else sql.SQL(""))
        #: deletes: the staged rows into the row path's stage (its columns: the table's types, json as text)
        self.transfer = None
        if row_stage is not None:
            row_names = sql.SQL(", ").join(ident(n) for n in [c.name for c in columns] + flags)
            row_selects = [ident(c.name) if c.kind == "json" else e for c, e in zip(columns, selects)]
            self.transfer = sql.SQL("INSERT INTO {rows} ({names}) SELECT {sel} FROM {stage}{where}").format(
                rows=sql.Identifier(stage_name(cfg.db_schema, cfg.table)), names=row_names, stage=stage,
                sel=sql.SQL(", ").join(row_selects + [ident(f) for f in flags]), where=where)
        conflict = UpsertStatements._conflict_clause(cfg)
        self.upsert = sql.SQL("INSERT INTO {t} AS t ({names}) SELECT {sel} FROM {stage}{where}{order}{conflict}").format(
            t=target, names=names, sel=sql.SQL(", ").join(selects), stage=stage, conflict=conflict, where=where,
            order=UpsertStatements.key_order(cfg))


def routed_csv(parts: Sequence[tuple[int, Any]]) -> bytes:
    """The CSV of routed parts -- ``(table number, pyarrow.Table)`` -- each row ending with its table's
    number, for one COPY into a shared stage (:class:`ColumnarStatements` with ``shared_stage``)."""
    import pyarrow as pa

    out = []
    for route, table in parts:
        numbered = table.append_column(ROUTE_COLUMN, pa.array([route] * table.num_rows, pa.int32()))
        out.append(memoryview(csv_bytes(numbered)))
    return b"".join(out)


def csv_bytes(table: Any) -> Any:
    """``table`` as CSV without a header, every value quoted (a pyarrow Buffer)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    sink = pa.BufferOutputStream()
    pcsv.write_csv(table, sink, pcsv.WriteOptions(include_header=False, quoting_style="all_valid"))
    return sink.getvalue()

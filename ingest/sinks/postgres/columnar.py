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
from ingest.sinks.postgres.statements import UpsertStatements, stage_name, table_ident

_STAGE_TYPE = {"int": "int8", "text": "text", "numeric": "text", "timestamp": "int8", "float": "float8",
               "bool": "boolean", "json": "text"}


class ColumnarStatements:
    """The SQL of the columnar write for one table, composed once."""

    def __init__(self, cfg: PostgresSinkSettings, columns: Sequence[StagedColumn]) -> None:
        if [c.name for c in columns] != list(cfg.columns):
            raise ValueError("the columnar plan's columns are not the sink's")
        if any(c.kind not in _STAGE_TYPE for c in columns):
            raise ValueError("the columnar plan stages a column PostgreSQL's columnar write does not take")
        target = table_ident(cfg.db_schema, cfg.table)
        stage = sql.Identifier(stage_name(cfg.db_schema, cfg.table) + "_c")
        ident = sql.Identifier
        defs = sql.SQL(", ").join(sql.SQL("{} {}").format(ident(c.name), sql.SQL(_STAGE_TYPE[c.kind]))
                                  for c in columns)
        self.create_stage = sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {stage} ({defs}) ON COMMIT DELETE ROWS").format(
            stage=stage, defs=defs)
        names = sql.SQL(", ").join(ident(c.name) for c in columns)
        self.copy_stage = sql.SQL("COPY {stage} ({names}) FROM STDIN (FORMAT csv)").format(stage=stage, names=names)
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
        conflict = UpsertStatements._conflict_clause(cfg)
        self.upsert = sql.SQL("INSERT INTO {t} AS t ({names}) SELECT {sel} FROM {stage}{order}{conflict}").format(
            t=target, names=names, sel=sql.SQL(", ").join(selects), stage=stage, conflict=conflict,
            order=UpsertStatements.key_order(cfg))


def csv_bytes(table: Any) -> Any:
    """``table`` as CSV without a header, every value quoted (a pyarrow Buffer)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    sink = pa.BufferOutputStream()
    pcsv.write_csv(table, sink, pcsv.WriteOptions(include_header=False, quoting_style="all_valid"))
    return sink.getvalue()

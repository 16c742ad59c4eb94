"""A source table whose schema changes mid-stream, as Debezium's JSON converter (with schemas) writes it.

For the ``columns: auto`` tests (PostgreSQL and ClickHouse): :class:`Evolving` makes a table's change
events in any of the schemas below (one partition, keyed ``{"id": ...}``) and keeps the model of the
table as a sink holds it -- each row with the fields its last event's schema carried.
"""

from __future__ import annotations

from typing import Any

from harness.debezium import Field, encode_event, encode_key

KEY = (Field("id", "int64", optional=False),)
V1 = (Field("id", "int64", optional=False), Field("label", "string"), Field("qty", "int32"))
V2 = (*V1, Field("note", "string"))  # a field appears
V3 = (Field("id", "int64", optional=False), Field("label", "string"), Field("note", "string"))  # qty is gone
V4 = (Field("id", "int64", optional=False), Field("label", "string"), Field("qty", "string"),
      Field("note", "string"))  # qty comes back as text: an integer column cannot hold it


class Evolving:
    """A source table whose schema changes: events and the model of the table as the sink holds it."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.rows: dict[int, dict[str, Any]] = {}
        self.lsn = 1000

    def upserts(self, fields: tuple[Field, ...], ids: range, make: Any) -> list[tuple[bytes, bytes, int, None]]:
        out = []
        for i in ids:
            self.lsn += 1
            after = {"id": i, **make(i)}
            op = "u" if i in self.rows else "c"
            out.append((encode_key({"id": i}, fields=KEY, schemas=True, table=self.table),
                        encode_event(op, None, after, fields=fields, lsn=self.lsn, ts_ms=self.lsn, schemas=True,
                                     table=self.table), 0, None))
            names = {f.name for f in fields}
            self.rows[i] = {k: v for k, v in after.items() if k in names}  # what the schema carries
        return out

    def deletes(self, fields: tuple[Field, ...], ids: list[int]) -> list[tuple[bytes, bytes | None, int, None]]:
        out: list[tuple[bytes, bytes | None, int, None]] = []
        for i in ids:
            self.lsn += 1
            key = encode_key({"id": i}, fields=KEY, schemas=True, table=self.table)
            out.append((key, encode_event("d", {"id": i}, None, fields=fields, lsn=self.lsn, ts_ms=self.lsn,
                                          schemas=True, table=self.table), 0, None))
            out.append((key, None, 0, None))
            del self.rows[i]
        return out

"""Evolution: from the table that exists to the shape a batch wants -- a plan, or why there is none.

:func:`plan` compares the existing table's shape (read from the catalog, :mod:`ingest.mirror.ddl`)
with the wanted shape (the union of the batch's schemas, :func:`ingest.mirror.shape.union`) under an
evolution mode and returns a :class:`Plan` (possibly empty) or an :class:`Incompatible` naming every
difference that stops it. Pure: the DDL is :mod:`ingest.mirror.ddl`'s.

Modes (``evolve:``)
-------------------
- ``off``: the table is created when missing, and never altered: anything a plan would have to do is
  a difference.
- ``add_columns`` (the default with ``columns: auto``): a wanted column the table lacks is added,
  **nullable** -- rows written before it have no value -- whatever the schema says of the field
  (ClickHouse: ``Nullable(T)``, or ``Array(T) DEFAULT []``). A column of the table the batch does not
  write is left as it is and written as NULL (or its default).
- ``add_and_widen``: as ``add_columns``, and a column whose type must grow is widened, along this
  list only:

  ===============  =========================================================================
  PostgreSQL       ``smallint`` → ``integer`` → ``bigint``; ``real`` → ``double precision``;
                   ``varchar(n)`` → ``varchar(m)`` (m > n) or ``text``; ``numeric(p,s)`` →
                   ``numeric(q,s)`` (q > p, the same scale) or ``numeric``;
                   NOT NULL → nullable (``DROP NOT NULL``)
  ClickHouse       ``IntN`` → ``IntM``, ``UIntN`` → ``UIntM`` (M > N), ``UIntN`` → ``IntM`` (M > N);
                   ``Float32`` → ``Float64``; ``Decimal(P, S)`` → ``Decimal(Q, S)`` (Q > P);
                   the same inside ``Array``; ``T`` → ``Nullable(T)``
  ===============  =========================================================================

What needs no change in any mode: a column that already holds every wanted value (a ``bigint``
column for an ``int`` field, ``text`` for ``varchar``, ``numeric(12,2)`` for ``decimal(10,2)``, a
nullable column for a required field): see :func:`ingest.mirror.types.accepts`.

Incompatible, in every mode (each listed in :attr:`Incompatible.differences`):

- **the key changes**: the table's key columns (PostgreSQL primary key, ClickHouse sorting key;
  compared as sets) differ from the wanted key -- a keyed table for keyless records too;
- **a type changes or narrows**: neither does the column hold the wanted type nor is the change on
  the widening list (``bigint`` → ``text``, ``numeric(10,2)`` → ``numeric(10,4)``, a ``timestamptz``
  for a ``timestamp`` field), or it is on the list and the mode is not ``add_and_widen``;
- **a NOT NULL column loses its value**: the wanted column may be null, or the field has
  disappeared, and the column has no default (widened to nullable under ``add_and_widen``, except a
  key column, which never may be null);
- **a ClickHouse key column would change type** (the server cannot alter a sorting key column).

The incompatible table's records are dead-lettered with class ``schema_incompatible`` while the other
tables flow; once the operator has altered the table, ``replay-dlq --error-class schema_incompatible``
writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.names import CLICKHOUSE
from ingest.mirror.shape import Column, Shape
from ingest.mirror.types import accepts, widening

__all__ = ["EVOLVE_MODES", "Change", "Evolve", "Incompatible", "Plan", "plan"]

Evolve = Literal["off", "add_columns", "add_and_widen"]
EVOLVE_MODES: tuple[str, ...] = ("off", "add_columns", "add_and_widen")


@dataclass(frozen=True, slots=True)
class Change:
    """One step of a plan: ``add`` a column, ``widen`` its type, or ``relax`` its NOT NULL. ``column`` is
    the column as it will be; ``old`` as it was (None for ``add``)."""

    kind: Literal["add", "widen", "relax"]
    column: Column
    old: Column | None = None

    def describe(self) -> str:
        c, o = self.column, self.old
        if self.kind == "add":
            return f"add column {c.name!r} {c.type}{'' if c.nullable else ' NOT NULL'}"
        if self.kind == "widen":
            assert o is not None
            return f"widen column {c.name!r} from {o.type} to {c.type}"
        return f"let column {c.name!r} hold NULL"


@dataclass(frozen=True)
class Plan:
    """What to do: ``create`` the table with ``shape``, or apply ``changes`` (in order) to the existing
    table, after which its shape is ``shape``. An empty plan (no create, no changes) means the table
    fits as it is."""

    create: bool
    changes: tuple[Change, ...]
    shape: Shape

    @property
    def empty(self) -> bool:
        return not self.create and not self.changes


@dataclass(frozen=True)
class Incompatible:
    """The table cannot take the wanted shape under the mode: every reason, one line each."""

    differences: tuple[str, ...]

    def __str__(self) -> str:
        return "; ".join(self.differences)

    def error(self, table: str) -> SchemaIncompatible:
        """The error a record bound for ``table`` is dead-lettered with."""
        return SchemaIncompatible("incompatible_table", f"table {table!r}: {self}")


def plan(existing: Shape | None, wanted: Shape, mode: Evolve = "add_columns") -> Plan | Incompatible:
    """The plan from ``existing`` (None: no table yet) to ``wanted`` under ``mode`` (see the module
    docstring), or :class:`Incompatible`. Both shapes must be of one dialect (ValueError otherwise)."""
    if mode not in EVOLVE_MODES:
        raise ValueError(f"unknown evolve mode {mode!r}")
    if existing is None:
        return Plan(True, (), wanted)
    if existing.dialect != wanted.dialect:
        raise ValueError("shapes of different dialects")
    dialect = wanted.dialect
    problems: list[str] = []
    changes: list[Change] = []
    if set(existing.key) != set(wanted.key):
        problems.append(f"the key changes from {list(existing.key) or 'none'} to {list(wanted.key) or 'none'}")
    widen_ok = mode == "add_and_widen"
    final: dict[str, Column] = {c.name: c for c in existing.columns}
    for w in wanted.columns:
        e = existing.column(w.name)
        if e is None:
            if mode == "off":
                problems.append(f"column {w.name!r} is missing (evolve is off)")
                continue
            if dialect == CLICKHOUSE and w.type.startswith("Array("):
                added = Column(w.name, w.type, False, w.default or "[]", w.from_key)
            else:  # rows written before it have no value
                added = Column(w.name, w.type, True, w.default, w.from_key)
            changes.append(Change("add", added))
            final[w.name] = added
            continue
        now = e
        if not accepts(e.type, w.type, dialect):
            new_type = widening(e.type, w.type, dialect)
            is_key = w.name in existing.key
            if new_type is None:
                problems.append(f"column {w.name!r} is {e.type}, the schema now needs {w.type}: not a widening")
            elif not widen_ok:
                problems.append(f"column {w.name!r} is {e.type} and must widen to {w.type}: needs evolve "
                                f"add_and_widen (it is {mode})")
            elif dialect == CLICKHOUSE and is_key:
                problems.append(f"column {w.name!r} is part of the ClickHouse sorting key and cannot widen "
                                f"from {e.type} to {w.type}")
            else:
                now = Column(e.name, new_type, e.nullable, e.default, e.from_key)
                changes.append(Change("widen", now, e))
        if w.nullable and not now.nullable and now.default is None:
            now = _relax(now, changes, problems, existing, mode, "the schema now allows null in it")
        final[w.name] = now
    for e in existing.columns:
        if wanted.column(e.name) is None and not e.nullable and e.default is None:
            final[e.name] = _relax(e, changes, problems, existing, mode, "its field is gone")
    if problems:
        return Incompatible(tuple(problems))
    if mode == "off" and changes:
        return Incompatible(tuple(f"{c.describe()} (evolve is off)" for c in changes))
    shape = Shape(dialect, tuple(final[c.name] for c in existing.columns) +
                  tuple(c.column for c in changes if c.kind == "add"), existing.key)
    return Plan(False, tuple(changes), shape)


def _relax(col: Column, changes: list[Change], problems: list[str], existing: Shape, mode: str, why: str) -> Column:
    """``col`` made nullable (a ``relax`` change, under add_and_widen), or a problem recorded."""
    if col.name in existing.key:
        if why == "its field is gone":
            return col  # reported as a key change
        problems.append(f"key column {col.name!r} would have to hold NULL ({why})")
        return col
    if mode != "add_and_widen":
        problems.append(f"column {col.name!r} is NOT NULL without a default and {why}: needs evolve "
                        f"add_and_widen to let it hold NULL (it is {mode})")
        return col
    if existing.dialect == CLICKHOUSE and col.type.startswith("Array("):
        problems.append(f"column {col.name!r} is an Array, which ClickHouse cannot make Nullable, and {why}")
        return col
    relaxed = Column(col.name, col.type, True, col.default, col.from_key)
    for i, ch in enumerate(changes):  # a widened column is relaxed in the same step's column
        if ch.column.name == col.name and ch.kind == "widen":
            changes[i] = Change("widen", relaxed, ch.old)
            changes.append(Change("relax", relaxed, col))
            return relaxed
    changes.append(Change("relax", relaxed, col))
    return relaxed

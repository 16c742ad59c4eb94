"""The errors of routing a record to a table and fitting a table to a schema.

::

    InvalidRecord (ingest.errors)
    ├── Unroutable           no table can be named for the record: DLQ stage ``route``, class ``unroutable``
    └── SchemaIncompatible   the record's schema cannot be written into its table as it is: DLQ stage
                             ``schema``, class ``schema_incompatible``
    ValueError
    └── TemplateError        a ``sink.table`` template that does not parse (config time, with a position)

Both record errors carry ``reason``, a short machine-readable word (``missing_header``,
``too_long``, ``case_collision``, ``type_changed``, ...), and a message for a human. Neither is ever
retried: the record is dead-lettered, and ``replay-dlq --error-class unroutable`` (or
``schema_incompatible``) writes it once the cause is fixed (a header added, the table altered by hand).
"""

from __future__ import annotations

from ingest.errors import InvalidRecord


class Unroutable(InvalidRecord):
    """The record's table cannot be resolved: a part of the template is missing, or the rendered name
    cannot be a table (see :mod:`ingest.mirror.names`). Never written anywhere but the DLQ."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__("route", "unroutable", message)
        self.reason = reason


class SchemaIncompatible(InvalidRecord):
    """The record's schema cannot become (or fit) its table: a field the sink cannot name, two schemas
    of one batch disagreeing on a column, or a table whose existing shape the evolution mode cannot
    reach (:class:`ingest.mirror.evolve.Incompatible`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__("schema", "schema_incompatible", message)
        self.reason = reason


class TemplateError(ValueError):
    """A table template that does not parse. ``position`` is the 0-based index in ``template`` of the
    character at fault; the message shows it."""

    def __init__(self, template: str, position: int, why: str) -> None:
        super().__init__(f"table template {template!r}, at position {position}: {why}")
        self.template = template
        self.position = position
        self.why = why

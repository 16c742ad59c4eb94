"""Mirroring many topics into many tables (issue #36): the pure core and the DDL.

Modules, each with its contract in its docstring:

- :mod:`~ingest.mirror.errors`   the errors a routed record can meet: :class:`Unroutable` (DLQ class
  ``unroutable``), :class:`SchemaIncompatible` (DLQ class ``schema_incompatible``), and
  :class:`TemplateError` (config time);
- :mod:`~ingest.mirror.template` ``sink.table`` as a template: parsed once, rendered per record;
- :mod:`~ingest.mirror.names`    a rendered name → a table identifier (the sanitiser), and the guard
  that refuses a second spelling of one name;
- :mod:`~ingest.mirror.types`    the type map: Avro / Protobuf / JSON Schema / Kafka Connect types →
  PostgreSQL and ClickHouse column types;
- :mod:`~ingest.mirror.shape`    a table's shape (columns, key) from a schema; the union of a batch's shapes;
- :mod:`~ingest.mirror.evolve`   the plan from an existing table's shape to a wanted one, or what makes
  them incompatible;
- :mod:`~ingest.mirror.ddl`      reading shapes from the catalogs, CREATE / ALTER, serialised per table.

Nothing here is wired into the pipeline yet: the multi-table batch comes next.
"""

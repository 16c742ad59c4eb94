"""The PostgreSQL sink (``sink.kind: postgres``): one package for everything PostgreSQL-specific.

- :mod:`.settings`: its settings;
- :mod:`.statements`: the SQL, composed once per table;
- :mod:`.sink`: the adapter (COPY → stage → upsert, or multi-row VALUES);
- :mod:`.exactly_once`: offsets stored in the batch transaction;
- :mod:`.schema`: ``migrate``'s DDL;
- :mod:`.backend`: the :class:`~ingest.sinks.base.SinkBackend` the registry names.

Driver errors are translated in one place, :mod:`ingest.drivers.postgres` (shared with
the PostgreSQL DLQ table).
"""

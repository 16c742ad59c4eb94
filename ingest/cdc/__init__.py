"""Change data capture: records that delete rows (tombstones, Debezium change events).

- :mod:`ingest.cdc.debezium`: unwraps Debezium's envelope (with or without the JSON converter's
  schema part) and converts its encodings (base64 decimals, MicroTimestamp, dates as days);
- :mod:`ingest.cdc.mapper`: maps such records to rows and :class:`~ingest.types.DeleteRow` rows,
  which collapse, route and commit like any row; the sinks write them (PostgreSQL: DELETE or a soft
  delete plus a tombstone table; ClickHouse: ``ReplacingMergeTree(version, _ingest_deleted)``).
"""

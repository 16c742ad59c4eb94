"""The ClickHouse sink (``sink.kind: clickhouse``): settings, the adapter, its error table, Arrow
inserts, ``migrate``'s DDL and the backend the registry names."""

"""ingest: Kafka -> PostgreSQL / ClickHouse batch ingestion.

Layout (each module has one job):

- ``config``      frozen pydantic-settings models (YAML + ``INGEST_`` env overrides)
- ``errors``      the exception tree: TransientError | PermanentError | InvalidRecord
- ``types``       Record, Item, Batch: the values that flow through the pipeline
- ``core/``       pure logic, no I/O, time passed in: batcher, offsets, mapping, routing
- ``sources/``    the Kafka consumer adapter
- ``sinks/``      one file per database backend
- ``dlq/``        dead-letter queue backends
- ``runner``      the pipeline loop and its commit ordering
- ``cli``         the composition root: the only place that reads config and builds adapters
"""

__version__ = "0.1.0"

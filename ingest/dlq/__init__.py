"""Dead-letter queue backends.

A DLQ backend implements :class:`ingest.dlq.base.DeadLetterQueue`: ``put`` makes
entries durable before it returns, and is idempotent per (pipeline, topic,
partition, offset): a record dead-lettered again after a crash stays one entry
(its ``attempts`` counter grows).
"""

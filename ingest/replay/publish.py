"""``replay-dlq --to topic``: republishing dead-lettered records to their original partition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka import Producer

from ingest.config import KafkaSettings
from ingest.dlq.base import DlqRow
from ingest.dlq.postgres import REPLAYS_HEADER
from ingest.errors import TransientError
from ingest.types import REPLAY_OF_HEADER


def republish_headers(row: DlqRow) -> list[tuple[str, bytes]]:
    """Original headers (minus old replay markers) plus the replay count and the original position
    (kept from an earlier replay: a record replayed twice still stands for the first one)."""
    rec = row.record
    kept = [(k, v) for k, v in rec.headers if k not in (REPLAYS_HEADER, REPLAY_OF_HEADER)]
    topic, partition, offset = rec.source_position
    return kept + [  # type: ignore[return-value]
        (REPLAYS_HEADER, str(row.replays + 1).encode()),
        (REPLAY_OF_HEADER, f"{topic}/{partition}/{offset}".encode()),
    ]


class TopicPublisher:
    """Republishes DLQ rows and waits for every acknowledgement (an idempotent producer, acks=all)."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 30.0) -> None:
        self._producer = Producer({**kafka.client_config(), "enable.idempotence": True, "acks": "all"})
        self._timeout_s = timeout_s

    def __call__(self, rows: Sequence[DlqRow]) -> None:
        """Raises TransientError when a record was not acknowledged (nothing is marked then)."""
        errors: list[Any] = []
        for row in rows:
            rec = row.record
            topic, partition, _ = rec.source_position
            kwargs: dict[str, Any] = {"key": rec.key, "value": rec.value, "partition": partition,
                                      "headers": republish_headers(row),
                                      "on_delivery": lambda err, _m: errors.append(err) if err else None}
            if rec.timestamp_ms is not None:
                kwargs["timestamp"] = rec.timestamp_ms
            while True:
                try:
                    self._producer.produce(topic, **kwargs)
                    break
                except BufferError:
                    self._producer.poll(0.1)
            self._producer.poll(0)
        if self._producer.flush(self._timeout_s) or errors:
            raise TransientError(f"republish failed: {errors[0].str() if errors else 'not acknowledged in time'}")

    def close(self) -> None:
        self._producer.flush(self._timeout_s)

"""Holding polled records while the decoder's schema registry cannot answer. Owned by the pipeline thread.

A registry-backed decoder resolves the schemas a polled chunk names before the chunk is mapped
(``decoder.prepare``). When the registry is down, slow, rate-limiting or refusing credentials,
that raises :class:`~ingest.errors.TransientError`, and the records are *held*:

- they are kept in poll order, untracked (nothing of them or after them is committed), while the
  pipeline keeps polling (it stays in its group; records that still arrive join the hold) with
  every partition paused (:attr:`Flow.held <ingest.runner.flow.Flow>`);
- the chunk is tried again after a full-jitter exponential backoff of the pipeline's ``retry``
  settings; when ``retry.max_attempts`` run out the TransientError goes up and the pipeline stops
  without committing them (the supervisor, or the operator, restarts it);
- records of a partition revoked or lost meanwhile are dropped (its next owner reads them again);
- nothing is ever dead-lettered because the registry was unavailable.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

from ingest.config import RetrySettings
from ingest.errors import TransientError
from ingest.runner.flow import Flow
from ingest.types import Partition, Record

log = logging.getLogger(__name__)


class DecodeHold:
    """Records waiting for their schemas; see the module docstring."""

    def __init__(self, pipeline: str, prepare: Callable[[Sequence[Record]], None], retry: RetrySettings,
                 flow: Flow, *, rng: random.Random | None = None,
                 on_error: Callable[[TransientError], None] | None = None) -> None:
        """``on_error`` hears every TransientError that holds (or keeps holding) records; it must not raise."""
        self._pipeline = pipeline
        self._on_error = on_error
        self._prepare = prepare
        self._retry = retry
        self._flow = flow
        self._rng = rng or random.Random()
        self._held: list[Record] = []
        self._attempts = 0
        self._next_try_ms = 0

    @property
    def active(self) -> bool:
        """Records are held (the partitions are paused for them)."""
        return bool(self._held)

    @property
    def held(self) -> int:
        return len(self._held)

    def admit(self, records: list[Record], now_ms: int) -> list[Record]:
        """The records ready to map: ``records`` (after any held ones) once their schemas are known;
        nothing while the registry cannot answer. Raises TransientError when retries ran out."""
        if self._held:
            self._held.extend(records)
            if now_ms < self._next_try_ms:
                return []
            records = self._held
        if not records:
            return records
        try:
            self._prepare(records)
        except TransientError as exc:
            if self._on_error is not None:
                self._on_error(exc)
            self._attempts += 1
            if not self._held:
                self._held = list(records)
            self._flow.held = True
            limit = self._retry.max_attempts
            if limit and self._attempts >= limit:  # still held: nothing of them may be committed now
                raise TransientError(f"gave up after {self._attempts} attempts: {exc}",
                                     error_class=exc.error_class) from exc
            backoff_ms = self._backoff_ms()
            self._next_try_ms = now_ms + backoff_ms
            log.warning("schema registry unavailable: holding records, partitions paused",
                        extra={"pipeline": self._pipeline, "held": len(self._held), "attempt": self._attempts,
                               "retry_in_ms": backoff_ms, "error": str(exc)})
            return []
        except BaseException:  # e.g. FatalPipelineError: the records stay held, so none is committed
            if not self._held:
                self._held = list(records)
            self._flow.held = True
            raise
        if self._held:
            log.info("schema registry answers again: resuming",
                     extra={"pipeline": self._pipeline, "held": len(self._held), "attempts": self._attempts})
            self._release()
        return records

    def forget(self, partitions: Sequence[Partition]) -> None:
        """Drop the held records of partitions this member no longer owns."""
        if self._held:
            gone = set(partitions)
            self._held = [r for r in self._held if Partition(r.topic, r.partition) not in gone]
            if not self._held:
                self._release()

    def _release(self) -> None:
        self._held = []
        self._attempts = 0
        self._next_try_ms = 0
        self._flow.held = False

    def _backoff_ms(self) -> int:
        """Full jitter: uniform in [0, min(max, initial * 2^(attempt-1))]."""
        cap = min(self._retry.max_backoff_ms, self._retry.initial_backoff_ms * 2 ** (self._attempts - 1))
        return int(self._rng.uniform(0, cap))

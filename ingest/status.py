"""What ``GET /status`` answers: per pipeline, its state, partitions, dead letters and last error.

Kafka Connect answers "is it running, and why not" at ``/connectors/<name>/status``; this is
ingest's answer, on the operations port next to ``/metrics``. One :class:`StatusBoard` per
process (held by :class:`ingest.metrics.Metrics`), one :class:`PipelineStatus` per pipeline.

Threads: the pipeline thread writes (:meth:`PipelineStatus.set_state`, ``set_partitions``,
``set_dead_lettered``, ``error``, ``stopped``); the HTTP thread reads (:meth:`StatusBoard.snapshot`).
Every method takes one short lock and never blocks on anything else; none raises.

States (:data:`STATES`), as the pipeline thread sees them at its last loop turn:

- ``starting``  built, no partition assigned yet;
- ``running``   consuming and writing;
- ``paused``    every partition paused by backpressure (too many records or bytes in flight);
- ``held``      records wait for their schemas while the schema registry cannot answer
  (:mod:`ingest.runner.hold`); partitions paused, nothing committed past them;
- ``draining``  stopping: flushing, waiting for the lanes, final commit;
- ``stopped``   ended cleanly (a signal, ``--until-idle``);
- ``failed``    ended by an error: ``error_class`` and ``error`` say which.

Every message that leaves through here passes :func:`ingest.redact.scrub` (configured secrets
masked) and is cut to :data:`MAX_MESSAGE` characters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ingest.redact import scrub

STATES = ("starting", "running", "paused", "held", "draining", "stopped", "failed")
MAX_MESSAGE = 2000


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """One assigned partition: the committed offset (next to read), the log end as last seen, the lag."""

    topic: str
    partition: int
    committed: int | None
    log_end: int | None
    lag: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "committed": self.committed,
                "log_end": self.log_end, "lag": self.lag}


def error_class_of(exc: BaseException) -> str:
    """The class an error reports itself as (``error_class`` attribute), else its type's name."""
    value = getattr(exc, "error_class", None)
    return value if isinstance(value, str) and value else type(exc).__name__


def _clean(message: str) -> str:
    text = scrub(str(message))
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…"


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


class PipelineStatus:
    """The status of one pipeline. Writers: its pipeline thread. Reader: :meth:`snapshot` (any thread)."""

    def __init__(self, name: str, on_state: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``on_state(old, new)`` is called (under no lock of ours) on every change of state."""
        self.name = name
        self._on_state = on_state
        self._clock = clock
        self._lock = threading.Lock()
        self._state = "starting"
        self._since_s = clock()
        self._partitions: tuple[PartitionStatus, ...] = ()
        self._dead: dict[tuple[str, str], int] = {}
        self._last_error: dict[str, Any] | None = None
        self._stop_error: tuple[str, str] | None = None

    @property
    def state(self) -> str:
        return self._state

    def set_state(self, state: str) -> None:
        """Enter ``state`` (one of :data:`STATES`; ValueError otherwise). Cheap when unchanged."""
        if state == self._state:
            return
        if state not in STATES:
            raise ValueError(f"unknown pipeline state {state!r}")
        with self._lock:
            old, self._state, self._since_s = self._state, state, self._clock()
        if self._on_state is not None:
            self._on_state(old, state)

    def set_partitions(self, partitions: Iterable[PartitionStatus]) -> None:
        """Replace the partition table (the currently assigned partitions)."""
        rows = tuple(sorted(partitions, key=lambda p: (p.topic, p.partition)))
        with self._lock:
            self._partitions = rows

    def set_dead_lettered(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Records dead-lettered since start, by ``(stage, error_class)`` (a copy is kept)."""
        copy = dict(counts)
        with self._lock:
            self._dead = copy

    def error(self, error_class: str, message: str) -> None:
        """Remember the last error seen (retried or not); the message is scrubbed of secrets."""
        entry = {"error_class": error_class, "message": _clean(message), "at": _iso(self._clock())}
        with self._lock:
            self._last_error = entry

    def stopped(self, error: BaseException | None) -> None:
        """The pipeline ended: ``stopped``, or ``failed`` with ``error``'s class and scrubbed message."""
        if error is None:
            self.set_state("stopped")
            return
        cls, message = error_class_of(error), _clean(str(error))
        with self._lock:
            self._stop_error = (cls, message)
        self.error(cls, message)
        self.set_state("failed")

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy; see the README's ``/status`` section for the shape."""
        with self._lock:
            state, since = self._state, self._since_s
            partitions, dead, last, stop = self._partitions, dict(self._dead), self._last_error, self._stop_error
        by_class: dict[str, int] = {}
        for (_stage, cls), n in dead.items():
            by_class[cls] = by_class.get(cls, 0) + n
        lags = [p.lag for p in partitions if p.lag is not None]
        return {
            "state": state,
            "since": _iso(since),
            "error_class": stop[0] if stop else None,
            "error": stop[1] if stop else None,
            "lag": sum(lags) if lags else None,
            "partitions": [p.as_dict() for p in partitions],
            "dead_lettered": {"total": sum(dead.values()), "by_class": by_class,
                              "by_stage_and_class": {f"{s}/{c}": n for (s, c), n in sorted(dead.items())}},
            "last_error": dict(last) if last else None,
        }


class StatusBoard:
    """Every pipeline's :class:`PipelineStatus`, in registration order."""

    def __init__(self, on_state: Callable[[str, str, str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``on_state(pipeline, old, new)`` is called on every state change of any pipeline."""
        self._on_state = on_state
        self._clock = clock
        self._pipelines: dict[str, PipelineStatus] = {}
        self._lock = threading.Lock()

    def pipeline(self, name: str) -> PipelineStatus:
        """The status of ``name``, created (state ``starting``) on first use."""
        with self._lock:
            status = self._pipelines.get(name)
            if status is None:
                hook = self._on_state
                status = PipelineStatus(
                    name, (lambda old, new: hook(name, old, new)) if hook is not None else None, self._clock)
                self._pipelines[name] = status
            return status

    def snapshot(self) -> dict[str, Any]:
        """``{"ok": every pipeline running (not failed/stopped/held/paused...), "pipelines": {name: ...}}``.

        ``ok`` is True only when every pipeline is ``running`` (a paused pipeline is healthy but slowed;
        the caller reads the state for that); False with no pipelines.
        """
        with self._lock:
            items = list(self._pipelines.items())
        pipelines = {name: s.snapshot() for name, s in items}
        ok = bool(pipelines) and all(p["state"] == "running" for p in pipelines.values())
        return {"ok": ok, "at": _iso(self._clock()), "pipelines": pipelines}

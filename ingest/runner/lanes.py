"""Worker lanes: where batches are written, each lane strictly in order.

The pipeline thread hands each flushed batch to one lane with
:meth:`LanePool.submit` and collects :class:`~ingest.runner.writer.Completion`\\ s with
:meth:`LanePool.completed`. One key always goes to the same lane and a lane
writes its batches in FIFO order, so one key is always written in order.

:class:`ThreadedLanes` runs one thread per lane (writes wait on the database
with the GIL released, so lanes overlap with decoding). Tests drive the
pipeline loop with a deterministic pool instead (``tests/unit/runner_fakes.py``):
the pool is the seam that makes the loop checkable step by step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Protocol

from ingest.errors import TransientError
from ingest.scheduler import WriteScheduler
from ingest.types import Item
from ingest.runner.writer import BatchWriter, Completion, PreparedBatch


class LanePool(Protocol):
    """The lanes of one pipeline. ``submit`` and ``completed`` are called by the pipeline thread only."""

    def start(self) -> None:
        """Start the lanes. Called once, before the first ``submit``."""
        ...

    def submit(self, lane: int, items: list[Item], reason: str) -> None:
        """Queue one batch for ``lane`` (FIFO per lane). Never blocks, never raises."""
        ...

    def completed(self, timeout_s: float | None = None) -> list[Completion]:
        """Every completion reported since the last call; when there is none yet, wait up to
        ``timeout_s`` for the first (``None`` or 0: do not wait). Never raises."""
        ...

    def halt(self) -> None:
        """The pipeline failed or aborts: batches still queued are dropped, not written (they are
        not committed either; a restart reads them again). Thread-safe, idempotent."""
        ...

    def close(self, timeout_s: float | None) -> None:
        """Stop every lane after its current batch; wait up to ``timeout_s`` (``None``: do not wait)."""
        ...


class Lane(threading.Thread):
    """A worker thread that writes its batches in FIFO order and reports completions.

    With a write scheduler, each batch first waits for a slot of its database
    (priority with aging); a lane never holds more than one.
    """

    def __init__(self, index: int, pipeline: str, writer: BatchWriter, completions: queue.SimpleQueue[Completion],
                 halt: threading.Event, scheduler: WriteScheduler | None = None, priority: int = 0) -> None:
        super().__init__(name=f"{pipeline}-lane-{index}", daemon=True)
        self.index = index
        self._pipeline = pipeline
        self._writer = writer
        self._completions = completions
        self._scheduler = scheduler
        self._priority = priority
        self._halt = halt
        self.inbox: queue.SimpleQueue[tuple[PreparedBatch, str] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.inbox.get()
            if job is None:
                return
            batch, reason = job
            if self._halt.is_set():
                continue
            slot = self._slot if self._scheduler is not None else None
            completion = self._writer.handle(self.index, batch, reason, slot)
            if completion.error is not None:
                # Stop this lane (and its siblings) before the next queued batch: writing later
                # batches past a failed one would, with exactly-once, move the lane offset past it.
                self._halt.set()
            self._completions.put(completion)

    @contextlib.contextmanager
    def _slot(self) -> Iterator[float]:
        """This lane's write slot; a pipeline that failed while the lane waited does not write."""
        assert self._scheduler is not None
        with self._scheduler.slot(self._pipeline, self._priority) as waited_s:
            if self._halt.is_set():
                raise TransientError("pipeline halted while waiting for a write slot", error_class="halted")
            yield waited_s


class ThreadedLanes:
    """One :class:`Lane` thread per lane; see :class:`LanePool`."""

    def __init__(self, pipeline: str, lanes: int, writer: BatchWriter, *,
                 scheduler: WriteScheduler | None = None, priority: int = 0) -> None:
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._halt = threading.Event()
        self._writer = writer
        self._lanes = [Lane(i, pipeline, writer, self._completions, self._halt, scheduler, priority)
                       for i in range(lanes)]

    def start(self) -> None:
        for lane in self._lanes:
            lane.start()

    def submit(self, lane: int, items: list[Item], reason: str) -> None:
        """Queue a batch for ``lane``, planned here (the caller's thread) while the lane writes."""
        self._lanes[lane].inbox.put((self._writer.prepare(items), reason))

    def completed(self, timeout_s: float | None = None) -> list[Completion]:
        out: list[Completion] = []
        try:
            out.append(self._completions.get(timeout=timeout_s) if timeout_s else self._completions.get_nowait())
            while True:
                out.append(self._completions.get_nowait())
        except queue.Empty:
            return out

    def halt(self) -> None:
        self._halt.set()

    def close(self, timeout_s: float | None) -> None:
        for lane in self._lanes:
            lane.inbox.put(None)
        if timeout_s is not None:
            for lane in self._lanes:
                lane.join(timeout=max(0.1, timeout_s))

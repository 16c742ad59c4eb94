"""``--until-idle``: when a batch run is finished.

A batch user means "the group has drained the topics", not "my partitions were
quiet": a member killed a moment earlier may still hold partitions in the
group (until the broker expires it), and those are not drained by anyone yet.
So a run is finished when

1. this member is *locally idle*: it has been assigned partitions, holds some,
   nothing is in flight, it is not paused by backpressure, and no record arrived
   for ``idle_s``; and then
2. the source reports no *backlog*: on every partition of the subscribed topics
   the group's committed offset has reached the log end (checked by reading,
   not from the reported high watermark alone, which some brokers report low).

While 1 holds and 2 does not, the check is repeated (at most once a second);
after ``drain_timeout_s`` of such waiting the member gives up: the run fails,
and the summary names the partitions left and how far behind they are. Any
new record ends the wait (the member is busy again).

Time is passed in; the source is the only I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ingest.errors import TransientError
from ingest.sources.base import Backlog, Source

log = logging.getLogger(__name__)

#: Re-check the group's backlog at most this often while waiting.
RECHECK_MS = 1000
#: How long one backlog check may take against the broker.
CHECK_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of a check: keep running, finished (drained), or gave up (``failed``)."""

    done: bool
    failed: bool = False
    #: gave up: the partitions the group had not finished at the last successful check
    backlog: tuple[Backlog, ...] = ()


KEEP_RUNNING = Verdict(False)
DRAINED = Verdict(True)


class DrainWatch:
    """Decides when an ``--until-idle`` run is finished; see the module docstring."""

    def __init__(self, pipeline: str, idle_s: float, drain_timeout_s: float | None = None) -> None:
        self._pipeline = pipeline
        self.idle_ms = int(idle_s * 1000)
        self.drain_timeout_ms = int((drain_timeout_s if drain_timeout_s is not None else 10 * idle_s) * 1000)
        self._waiting_since_ms: int | None = None
        self._next_check_ms = 0
        self._last: tuple[Backlog, ...] = ()

    def busy(self) -> None:
        """The member is not idle (records arrived, a rebalance, backpressure): the wait starts over."""
        self._waiting_since_ms = None
        self._next_check_ms = 0

    def check(self, now_ms: int, source: Source) -> Verdict:
        """Called while the member is locally idle; asks the source for the group's backlog."""
        if self._waiting_since_ms is None:
            self._waiting_since_ms = now_ms
        if now_ms >= self._next_check_ms:
            self._next_check_ms = now_ms + RECHECK_MS
            try:
                backlog = tuple(source.backlog(CHECK_TIMEOUT_S))
            except TransientError as exc:
                log.warning("until-idle: cannot read the group's offsets; will retry",
                            extra={"pipeline": self._pipeline, "error": str(exc)})
            else:
                if not backlog:
                    return DRAINED
                if backlog != self._last:
                    log.info("until-idle: waiting for the group to drain",
                             extra={"pipeline": self._pipeline, "backlog": describe(backlog)})
                self._last = backlog
        if now_ms - self._waiting_since_ms >= self.drain_timeout_ms:
            return Verdict(True, True, self._last)
        return KEEP_RUNNING


def describe(backlog: tuple[Backlog, ...] | list[Backlog]) -> str:
    """``t[0] 12 behind, t[3] 1 behind`` (partitions in order)."""
    return ", ".join(f"{b.partition} {b.behind} behind" for b in sorted(backlog, key=lambda b: b.partition))

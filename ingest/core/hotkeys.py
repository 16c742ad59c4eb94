"""Hot-key and hot-lane detection in bounded memory.

Records are routed to lanes by key hash, so one very frequent key pins its
lane and caps the pipeline at one lane's throughput. To notice it without a
dict of every key, each lane keeps a :class:`HeavyHitters` sketch: the
*Space-Saving* algorithm (Metwally, Agrawal, El Abbadi, "Efficient
Computation of Frequent and Top-k Elements in Data Streams", ICDT 2005) with
``capacity`` counters.

Space-Saving monitors at most ``capacity`` keys, each with a count and an
error. A monitored key's count is incremented; a new key, when all counters
are in use, takes over the counter with the smallest count ``m``: its count
becomes ``m + n`` and its error ``m`` (it may have occurred up to ``m`` times
before, unseen). The counts always sum to the stream total ``N``, so the
smallest count is ``<= N / capacity``, which gives, for every key (weighted
adds included):

- every key whose true count is ``> N / capacity`` is monitored;
- a monitored key's ``count >= true count >= count - error``;
- ``error <= N / capacity``.

Counters are grouped in buckets by count (``{count: {key: None}}``) and the
smallest count is tracked, so an add is O(1) (a weighted add whose counter
leaves the smallest bucket empty rescans the <= ``capacity`` bucket counts).
Memory is O(``capacity``) however many distinct keys the stream has.

Shares are reported as the guaranteed lower bound ``(count - error) / N``:
never above the true share, so evenly spread keys are never reported hot,
while a key with true share ``s`` reports at least ``s - 1 / capacity``.

:class:`LaneLoad` keeps, per lane and per interval, records, bytes and one
sketch; :meth:`LaneLoad.report` turns them and the current per-lane backlog
into a :class:`LoadReport` (hot keys, hot lane). The caller calls
:meth:`LaneLoad.reset` to start the next interval.

Pure logic: no I/O, no clock. Not thread-safe: owned by one pipeline thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "HOT_KEY_MIN_RECORDS",
    "HOT_LANE_MIN_BACKLOG",
    "UNKEYED_LABEL",
    "HeavyHitters",
    "HotKey",
    "LaneLoad",
    "LaneStats",
    "LoadReport",
    "key_label",
]

UNKEYED_LABEL = "<unkeyed>"
"""How records without a key (``None``) are shown; they are counted as one key of their own, distinct from every ``bytes`` key."""

HOT_KEY_MIN_RECORDS = 100
"""A lane must have seen at least this many records in the interval before one of its keys can be reported hot (a lane with 3 records of one key is noise, not a hot key)."""

HOT_LANE_MIN_BACKLOG = 100
"""The total backlog must be at least this many before a lane holding most of it is reported hot (2 of 3 queued records is not a hot lane)."""


def key_label(key: bytes | None, max_len: int = 64) -> str:
    """Return a printable label for a key (logs): ``"<unkeyed>"`` for ``None``, else the bytes decoded as UTF-8 with backslash escapes, cut to ``max_len`` characters plus ``"..."``. Never raises."""
    if key is None:
        return UNKEYED_LABEL
    text = key.decode("utf-8", errors="backslashreplace")
    return text if len(text) <= max_len else text[:max_len] + "..."


class HeavyHitters:
    """Space-Saving heavy-hitters sketch over ``capacity`` counters (see the module docstring for its guarantees)."""

    __slots__ = ("capacity", "_counts", "_errors", "_buckets", "_min", "_total")

    def __init__(self, capacity: int = 64) -> None:
        """Create an empty sketch.

        Raises:
            ValueError: if ``capacity`` is < 1.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._counts: dict[Hashable, int] = {}  # monitored key -> estimated count
        self._errors: dict[Hashable, int] = {}  # monitored key -> max overestimate
        self._buckets: dict[int, dict[Hashable, None]] = {}  # count -> keys with that count (insertion-ordered set)
        self._min = 0  # smallest count among monitored keys (meaningful when any)
        self._total = 0

    def __len__(self) -> int:
        """Return the number of monitored keys (``<= capacity``)."""
        return len(self._counts)

    def add(self, key: bytes | None, n: int = 1) -> None:
        """Count ``n`` occurrences of ``key`` (``None``: the records without a key). O(1) for ``n == 1``.

        Raises:
            ValueError: if ``n`` is negative (nothing is changed). ``n == 0`` is a no-op.
        """
        if n <= 0:
            if n < 0:
                raise ValueError(f"n must be >= 0, got {n}")
            return
        self._total += n
        counts = self._counts
        old = counts.get(key)
        if old is None:
            if len(counts) < self.capacity:
                counts[key] = n
                self._errors[key] = 0
                self._bucket_add(n, key)
                if len(counts) == 1 or n < self._min:
                    self._min = n
                return
            # Evict a key with the smallest count; the new key inherits it as its error.
            old = self._min
            bucket = self._buckets[old]
            victim = next(iter(bucket))
            del bucket[victim]
            del counts[victim]
            del self._errors[victim]
            self._errors[key] = old
        else:
            bucket = self._buckets[old]
            del bucket[key]
        new = old + n
        counts[key] = new
        self._bucket_add(new, key)
        if not bucket:
            del self._buckets[old]
            if old == self._min:
                # Everything else is >= old and nothing is left at old; the moved key is at old + n.
                self._min = new if n == 1 else min(self._buckets)

    def _bucket_add(self, count: int, key: Hashable) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            self._buckets[count] = {key: None}
        else:
            bucket[key] = None

    def top(self, k: int) -> list[tuple[bytes | None, int, int]]:
        """Return up to ``k`` monitored keys as ``(key, estimated count, max overestimate error)``, highest count first.

        Ties are ordered by smaller error, then by when the key was first
        monitored. The true count of each key is in ``[count - error, count]``.
        ``k <= 0`` returns ``[]``. O(capacity log capacity). Never raises.
        """
        if k <= 0:
            return []
        errors = self._errors
        ranked = sorted(self._counts.items(), key=lambda kv: (-kv[1], errors[kv[0]]))
        return [(key, count, errors[key]) for key, count in ranked[:k]]  # type: ignore[misc]  # keys are bytes | None

    def total(self) -> int:
        """Return the sum of ``n`` over all :meth:`add` calls since creation or :meth:`reset`. Never raises."""
        return self._total

    def estimate(self, key: bytes | None) -> tuple[int, int]:
        """Return ``(estimated count, error)`` for ``key``; ``(0, 0)`` if it is not monitored (then its true count is ``<= total / capacity``). Never raises."""
        count = self._counts.get(key)
        return (0, 0) if count is None else (count, self._errors[key])

    def share(self, key: bytes | None) -> float:
        """Return the guaranteed lower bound of ``key``'s share of the total: ``(count - error) / total``.

        ``0.0`` when the key is not monitored or nothing was added. The true
        share is in ``[share(key), count / total]``. Never raises.
        """
        if self._total == 0:
            return 0.0
        count, error = self.estimate(key)
        return (count - error) / self._total

    def reset(self) -> None:
        """Forget all keys and the total, to start a new interval. Never raises."""
        self._counts.clear()
        self._errors.clear()
        self._buckets.clear()
        self._min = 0
        self._total = 0


class HotKey(NamedTuple):
    """A key holding more than ``hot_key_share`` of its lane's records in the interval."""

    lane: int
    key: bytes | None
    share: float  # guaranteed lower bound, see HeavyHitters.share


@dataclass(frozen=True, slots=True)
class LaneStats:
    """One lane's interval totals and its top key (``top_key`` is meaningless when ``records == 0``; ``None`` is also the unkeyed key)."""

    records: int
    size_bytes: int
    top_key: bytes | None
    top_share: float  # lower-bound share of top_key (the key with the highest one) in this lane's records, 0.0 when no records


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Per-interval load of a pipeline's lanes, from :meth:`LaneLoad.report`."""

    lanes: tuple[LaneStats, ...]
    hot_keys: list[HotKey]  # keys whose share of their lane > hot_key_share, by lane then share
    hot_lane: int | None  # the lane holding > 50 % of a non-trivial backlog, else None
    backlog_total: int
    hot_lane_share: float  # largest lane's share of the backlog, 0.0 when the backlog is empty

    @property
    def records_by_lane(self) -> list[int]:
        """Return records per lane in the interval."""
        return [lane.records for lane in self.lanes]

    @property
    def bytes_by_lane(self) -> list[int]:
        """Return bytes per lane in the interval."""
        return [lane.size_bytes for lane in self.lanes]


class LaneLoad:
    """Per-interval records, bytes and heavy-hitters sketch for each of ``lanes`` lanes. Memory O(lanes * capacity)."""

    __slots__ = ("lanes", "capacity", "min_records", "min_backlog", "_records", "_bytes", "_sketches")

    def __init__(
        self,
        lanes: int,
        capacity: int = 64,
        *,
        min_records: int = HOT_KEY_MIN_RECORDS,
        min_backlog: int = HOT_LANE_MIN_BACKLOG,
    ) -> None:
        """Create empty interval stats.

        ``min_records``: a lane's key is only reported hot once the lane saw
        at least this many records in the interval. ``min_backlog``: a hot
        lane is only reported when the total backlog is at least this.

        Raises:
            ValueError: if ``lanes`` or ``capacity`` is < 1, or ``min_records`` / ``min_backlog`` is < 0.
        """
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if min_records < 0 or min_backlog < 0:
            raise ValueError(f"min_records and min_backlog must be >= 0, got {min_records}, {min_backlog}")
        self.lanes = lanes
        self.capacity = capacity
        self.min_records = min_records
        self.min_backlog = min_backlog
        self._records = [0] * lanes
        self._bytes = [0] * lanes
        self._sketches = [HeavyHitters(capacity) for _ in range(lanes)]

    def observe(self, lane: int, key: bytes | None, size_bytes: int) -> None:
        """Count one record of ``size_bytes`` with ``key`` routed to ``lane``. O(1).

        Raises:
            IndexError: if ``lane`` is not in ``[0, lanes)`` (nothing is changed).
            ValueError: if ``size_bytes`` is negative (nothing is changed).
        """
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} out of range [0, {self.lanes})")
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        self._records[lane] += 1
        self._bytes[lane] += size_bytes
        self._sketches[lane].add(key)

    def sketch(self, lane: int) -> HeavyHitters:
        """Return ``lane``'s sketch (read it, e.g. ``top(5)`` for a log line; it is reset with the interval).

        Raises:
            IndexError: if ``lane`` is out of range.
        """
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} out of range [0, {self.lanes})")
        return self._sketches[lane]

    def report(self, hot_key_share: float, backlog_by_lane: Sequence[int]) -> LoadReport:
        """Summarize the interval so far (does not reset).

        - ``lanes[i]``: records, size_bytes, top key and its lower-bound share.
        - ``hot_keys``: ``(lane, key, share)`` for each key whose lower-bound
          share of its lane's records is ``> hot_key_share``, in lanes that saw
          at least ``min_records`` (and at least 1) records in the interval;
          by lane, then share descending (at most one per lane when
          ``hot_key_share >= 0.5``).
        - ``hot_lane``: with ``lanes >= 2``, the lane holding strictly more than
          half of ``sum(backlog_by_lane)`` when that sum is ``>= min_backlog``;
          else ``None``. ``backlog_by_lane`` is whatever the caller queues per
          lane (records buffered or waiting to be written), read now.

        Raises:
            ValueError: if ``hot_key_share`` is not in ``(0, 1]``, or
                ``backlog_by_lane`` does not have ``lanes`` entries or has a
                negative entry.
        """
        if not 0.0 < hot_key_share <= 1.0:
            raise ValueError(f"hot_key_share must be in (0, 1], got {hot_key_share}")
        if len(backlog_by_lane) != self.lanes:
            raise ValueError(f"backlog_by_lane has {len(backlog_by_lane)} entries, expected {self.lanes}")
        if any(b < 0 for b in backlog_by_lane):
            raise ValueError(f"backlog_by_lane has a negative entry: {list(backlog_by_lane)}")

        stats: list[LaneStats] = []
        hot_keys: list[HotKey] = []
        for lane, sketch in enumerate(self._sketches):
            records = self._records[lane]
            n = sketch.total()
            # Lower-bound shares of every monitored key, highest first (<= capacity entries).
            shares = sorted(
                ((key, (count - error) / n) for key, count, error in sketch.top(self.capacity)),
                key=lambda ks: -ks[1],
            )
            top_key, top_share = shares[0] if shares else (None, 0.0)
            stats.append(LaneStats(records=records, size_bytes=self._bytes[lane], top_key=top_key, top_share=top_share))
            if records > 0 and records >= self.min_records:
                for key, share in shares:
                    if share <= hot_key_share:
                        break
                    hot_keys.append(HotKey(lane, key, share))

        total = sum(backlog_by_lane)
        hot_lane: int | None = None
        lane_share = 0.0
        if total > 0:
            biggest = max(range(self.lanes), key=backlog_by_lane.__getitem__)
            lane_share = backlog_by_lane[biggest] / total
            if self.lanes >= 2 and total >= self.min_backlog and 2 * backlog_by_lane[biggest] > total:
                hot_lane = biggest
        return LoadReport(
            lanes=tuple(stats),
            hot_keys=hot_keys,
            hot_lane=hot_lane,
            backlog_total=total,
            hot_lane_share=lane_share,
        )

    def reset(self) -> None:
        """Zero every lane's records, bytes and sketch, to start a new interval. Never raises."""
        for lane in range(self.lanes):
            self._records[lane] = 0
            self._bytes[lane] = 0
            self._sketches[lane].reset()

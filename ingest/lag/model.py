"""The values ``ingest lag`` reports and the pure rules behind them (position, records behind, hot).

See :mod:`ingest.lag` for what is measured and how."""


from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)

#: A partition is hot when it holds more than this share of its pipeline's lag ...
HOT_SHARE = 0.5
#: ... and the pipeline's lag is at least this many records.
HOT_MIN_LAG = 100

#: Default per-request timeout against the broker.
DEFAULT_TIMEOUT_S = 10.0

PartitionKey = tuple[str, int]


# --------------------------------------------------------------------------- values
@dataclass(frozen=True, slots=True)
class PartitionLag:
    """Lag of one partition for one consumer group."""

    topic: str
    partition: int
    #: The group's committed offset (next offset to read); ``None``: no commit.
    committed: int | None
    low: int
    #: High watermark as the broker reports it.
    end: int
    #: Records behind: ``max(0, end - position)``.
    lag: int
    #: Timestamp (ms since the epoch) of the oldest unconsumed record, when known.
    oldest_ts_ms: int | None = None
    #: Age of the oldest unconsumed record in seconds, when known.
    lag_s: float | None = None
    hot: bool = False

    @property
    def key(self) -> PartitionKey:
        return (self.topic, self.partition)

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed": self.committed,
            "low": self.low,
            "end": self.end,
            "lag": self.lag,
            "oldest_ts_ms": self.oldest_ts_ms,
            "lag_s": None if self.lag_s is None else round(self.lag_s, 3),
            "hot": self.hot,
        }


@dataclass(frozen=True, slots=True)
class PipelineLag:
    """One pipeline's partitions (sorted by topic, partition) and their totals."""

    pipeline: str
    group_id: str
    topics: tuple[str, ...]
    partitions: tuple[PartitionLag, ...]
    #: Sum of the partitions' lag in records.
    lag: int
    #: Age of the oldest unconsumed record over all partitions (seconds), when known.
    max_lag_s: float | None
    #: Partitions the group has no committed offset for.
    uncommitted: int
    #: Partitions that could not be measured (e.g. a topic missing on the broker).
    errors: tuple[str, ...] = ()

    @property
    def hot(self) -> tuple[PartitionLag, ...]:
        return tuple(p for p in self.partitions if p.hot)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "group_id": self.group_id,
            "topics": list(self.topics),
            "partitions": [p.as_dict() for p in self.partitions],
            "totals": {
                "partitions": len(self.partitions),
                "lag": self.lag,
                "end": sum(p.end for p in self.partitions),
                "max_lag_s": None if self.max_lag_s is None else round(self.max_lag_s, 3),
                "uncommitted_partitions": self.uncommitted,
                "hot_partitions": [
                    {"topic": p.topic, "partition": p.partition, "lag": p.lag,
                     "share": round(p.lag / self.lag, 4) if self.lag else 0.0}
                    for p in self.hot
                ],
            },
            "errors": list(self.errors),
        }


@dataclass(frozen=True, slots=True)
class LagReport:
    """Everything one ``ingest lag`` pass measured."""

    at_ms: int
    pipelines: tuple[PipelineLag, ...] = field(default_factory=tuple)

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.pipelines)

    @property
    def errors(self) -> list[str]:
        return [f"pipeline {p.pipeline}: {e}" for p in self.pipelines for e in p.errors]

    def as_dict(self) -> dict[str, Any]:
        ages = [p.max_lag_s for p in self.pipelines if p.max_lag_s is not None]
        return {
            "at": _iso(self.at_ms),
            "pipelines": {p.pipeline: p.as_dict() for p in self.pipelines},
            "totals": {
                "pipelines": len(self.pipelines),
                "partitions": sum(len(p.partitions) for p in self.pipelines),
                "lag": self.lag,
                "max_lag_s": round(max(ages), 3) if ages else None,
                "hot_partitions": sum(len(p.hot) for p in self.pipelines),
                "errors": len(self.errors),
            },
        }


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


# --------------------------------------------------------------------------- pure rules
def consume_position(committed: int | None, low: int) -> int:
    """Where the group resumes: its commit, or the low watermark without one (or below it)."""
    return low if committed is None else max(committed, low)


def records_behind(committed: int | None, low: int, end: int) -> int:
    """Lag in records, clamped at 0 (a broker may report a high watermark below the log end)."""
    return max(0, end - consume_position(committed, low))


def age_seconds(ts_ms: int | None, now_ms: int) -> float | None:
    """Seconds since ``ts_ms``, never negative (clock skew between producer and us)."""
    if ts_ms is None:
        return None
    return max(0.0, (now_ms - ts_ms) / 1000.0)


def is_hot(lag: int, total: int, partitions: int, *, share: float = HOT_SHARE, min_lag: int = HOT_MIN_LAG) -> bool:
    """The hot-partition rule (see the module docstring)."""
    return partitions >= 2 and total >= min_lag and total > 0 and lag > share * total


def summarize(
    pipeline: str,
    group_id: str,
    topics: Iterable[str],
    rows: Iterable[PartitionLag],
    errors: Iterable[str] = (),
    *,
    hot_share: float = HOT_SHARE,
    hot_min_lag: int = HOT_MIN_LAG,
) -> PipelineLag:
    """Sort the rows, flag hot partitions and compute the pipeline's totals."""
    ordered = sorted(rows, key=lambda r: r.key)
    total = sum(r.lag for r in ordered)
    n = len(ordered)
    flagged = tuple(
        replace(r, hot=is_hot(r.lag, total, n, share=hot_share, min_lag=hot_min_lag)) for r in ordered
    )
    ages = [r.lag_s for r in flagged if r.lag_s is not None]
    return PipelineLag(
        pipeline=pipeline,
        group_id=group_id,
        topics=tuple(topics),
        partitions=flagged,
        lag=total,
        max_lag_s=max(ages) if ages else None,
        uncommitted=sum(1 for r in flagged if r.committed is None),
        errors=tuple(errors),
    )



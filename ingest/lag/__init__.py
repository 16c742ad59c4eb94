"""Consumer lag of each pipeline's consumer group, per partition, in records and in time.

For every partition of a pipeline's topics (from broker metadata):

- ``committed``: the group's committed offset (the next offset to read), read
  with a consumer that carries the group's ``group.id`` and calls
  ``committed()`` but never subscribes, so it does not join, rebalance or
  otherwise disturb the running group;
- ``low`` / ``end``: the low and high watermarks (``get_watermark_offsets(cached=False)``);
- ``lag`` (records) = ``max(0, end - position)`` where ``position`` is the
  committed offset, or the low watermark when the group has no commit for the
  partition (the pipeline starts from ``earliest``) or its commit fell below
  the low watermark (retention deleted those records). Clamped at 0 because
  some brokers (Tansu: base offset of the last batch + 1) report a high
  watermark below the true log end;
- ``lag_s`` (time) = now − timestamp of the oldest unconsumed record, i.e. the
  record at ``position``, read with a separate consumer that never joins any
  group (``assign`` + ``consume``). ``None`` when the lag is 0, when the broker
  gives no timestamp, or when the record could not be read within the timeout.

Hot partitions. A partition is flagged *hot* when it dominates its pipeline's
backlog: its lag is more than :data:`HOT_SHARE` (half) of the pipeline's total
lag, the pipeline's total lag is at least :data:`HOT_MIN_LAG` records (a tiny
backlog is noise), and the pipeline has at least two partitions (a lone
partition trivially holds all the lag). At most one partition per pipeline can
be hot. A hot partition usually means a skewed key or a stuck lane.

Every call opens its own short-lived clients and closes them. Nothing here
prints or logs client configuration (it may hold credentials); errors name the
bootstrap servers and librdkafka's message only.

:func:`summarize`, :func:`records_behind`, :func:`is_hot` and the renderers
are pure; :func:`measure_partitions` needs only duck-typed consumer handles;
:func:`collect_lag` builds the real clients.
"""

from ingest.lag.measure import collect_lag, measure_partitions, oldest_timestamps
from ingest.lag.model import (
    DEFAULT_TIMEOUT_S,
    HOT_MIN_LAG,
    HOT_SHARE,
    LagReport,
    PartitionLag,
    PipelineLag,
    age_seconds,
    consume_position,
    is_hot,
    records_behind,
    summarize,
)
from ingest.lag.render import format_age, render_json, render_tables

__all__ = [
    "DEFAULT_TIMEOUT_S", "HOT_MIN_LAG", "HOT_SHARE", "LagReport", "PartitionLag", "PipelineLag", "age_seconds",
    "collect_lag", "consume_position", "format_age", "is_hot", "measure_partitions", "oldest_timestamps",
    "records_behind", "render_json", "render_tables", "summarize",
]

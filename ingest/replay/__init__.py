"""``ingest replay-dlq``: the replay loop (:mod:`.replayer`), its order guard (:mod:`.order`) and
republishing to the original topic (:mod:`.publish`)."""

from ingest.replay.replayer import RateLimiter, Replayer, ReplaySummary

__all__ = ["RateLimiter", "Replayer", "ReplaySummary"]

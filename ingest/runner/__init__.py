"""Running pipelines: the loop (:mod:`.pipeline`), its lanes (:mod:`.lanes`), what a lane does with a
batch (:mod:`.writer`), offset commits (:mod:`.commits`), ``--until-idle`` (:mod:`.drain`), gauges
(:mod:`.observe`) and run counters (:mod:`.stats`)."""

from ingest.runner.pipeline import Pipeline, RunOptions
from ingest.runner.stats import PipelineStats

__all__ = ["Pipeline", "PipelineStats", "RunOptions"]

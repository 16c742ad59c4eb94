"""Deletes are counted as rows written and as rows deleted: the writer, the run stats and the metrics."""

from __future__ import annotations

import threading

from ingest.config import RetrySettings
from ingest.core.collapse import CollapseRule
from ingest.metrics import Metrics
from ingest.runner.stats import PipelineStats
from ingest.types import DeleteRow, Item, Record
from ingest.runner.writer import BatchWriter


class _Dlq:
    def put(self, entries):  # noqa: ANN001, ANN201 - never called: nothing is poison here
        raise AssertionError("no dead letters expected")


def test_written_deletes_are_counted_in_the_completion_the_stats_and_the_metrics() -> None:
    written: list[list[tuple]] = []
    writer = BatchWriter(pipeline="p", write=lambda rows, **_: written.append(list(rows)), dlq=_Dlq(),
                         retry=RetrySettings(), collapse_rule=CollapseRule((0,), "last", None),
                         abort=threading.Event())
    rows = [(1, "a"), DeleteRow((2, None)), (3, "c"), DeleteRow((1, None)), (2, "again")]
    items = [Item(Record("t", 0, i, None, None if isinstance(r, DeleteRow) else b"{}", None), r, None, 1, 10)
             for i, r in enumerate(rows)]
    completion = writer.handle(0, items, "size")
    assert completion.error is None
    assert sorted(map(tuple, written[0])) == [(1, None), (2, "again"), (3, "c")]
    assert (completion.rows_written, completion.rows_deleted, completion.records) == (3, 1, 5)
    metrics = Metrics()
    stats = PipelineStats()
    stats.count(completion, metrics.pipeline("p"))
    assert (stats.rows_written, stats.rows_deleted) == (3, 1)
    assert stats.as_dict()["rows_deleted"] == 1
    assert metrics.registry.get_sample_value("ingest_rows_deleted_total", {"pipeline": "p"}) == 1
    assert metrics.registry.get_sample_value("ingest_rows_written_total", {"pipeline": "p"}) == 3

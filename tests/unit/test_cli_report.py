"""The exit summary's error lines (ingest.cli.run.error_line)."""

from __future__ import annotations

from ingest.cli.run import error_line
from ingest.errors import FatalPipelineError


def test_a_pipeline_is_named_once_in_its_error_line() -> None:
    exc = FatalPipelineError("pipeline 'st': DLQ guard tripped: 5 of 10 records", error_class="dlq_guard")
    assert error_line("st", str(exc)) == "error: pipeline st: DLQ guard tripped: 5 of 10 records"
    assert error_line("st", "pipeline 'st': pipeline 'st': gave up") == "error: pipeline st: gave up"


def test_a_message_that_names_another_pipeline_or_none_is_kept_whole() -> None:
    assert error_line("a", "pipeline 'b': broken") == "error: pipeline a: pipeline 'b': broken"
    assert error_line("orders", "topic x does not exist") == "error: pipeline orders: topic x does not exist"

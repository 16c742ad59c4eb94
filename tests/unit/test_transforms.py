"""Unit tests of ingest.core.transforms: every step, ``when``, CEL errors with their config paths,
the pipeline's mapper with transforms, the acceptor's filtered counts, and hypothesis properties."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from harness import write_config
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ingest.cdc.mapper import TransformingMapper, mapper_for
from ingest.config import PipelineSettings, load_settings
from ingest.config.transforms import TransformStep
from ingest.core.transforms import compile_transforms
from ingest.errors import ConfigError, Filtered, InvalidRecord
from ingest.preview import preview, records_from_jsonl
from ingest.types import Record

WHERE = "pipelines[0].transforms"


def rec(value: Any = None, *, key: bytes | None = b"k1", offset: int = 5, timestamp_ms: int | None = 1000,
        headers: tuple[tuple[str, bytes | None], ...] = (), origin: tuple[str, int, int] | None = None) -> Record:
    raw = None if value is None else orjson.dumps(value)
    return Record("orders", 1, offset, key, raw, timestamp_ms, headers, origin)


def transformer(*steps: dict[str, Any]):
    t = compile_transforms([TransformStep.model_validate(s) for s in steps], WHERE)
    assert t is not None
    return t


def apply(steps: list[dict[str, Any]], doc: Any, record: Record | None = None) -> Any:
    return transformer(*steps).apply(record or rec({}), doc)


def failure(steps: list[dict[str, Any]], doc: Any, record: Record | None = None) -> InvalidRecord:
    with pytest.raises(InvalidRecord) as info:
        apply(steps, doc, record)
    assert info.value.stage == "transform" and info.value.error_class == "transform_error"
    return info.value


# --------------------------------------------------------------------------- filter
def test_filter_keeps_and_drops_naming_the_step() -> None:
    steps = [{"filter": "value.tenant != 'test'"}]
    assert apply(steps, {"tenant": "acme"}) == {"tenant": "acme"}
    with pytest.raises(Filtered) as info:
        apply(steps, {"tenant": "test"})
    assert info.value.step == "0-filter"
    with pytest.raises(Filtered) as info:
        apply([{"set": {"a": "1"}}, {"filter": "false", "name": "never"}], {})
    assert info.value.step == "never"


def test_filter_on_a_missing_field_is_a_transform_error_not_a_silent_drop() -> None:
    err = failure([{"filter": "value.tenant != 'test'"}], {"id": 1})
    assert err.message.startswith("transforms[0] (0-filter): filter: ") and "tenant" in err.message


def test_filter_that_gives_no_bool_on_a_record_fails_it() -> None:
    err = failure([{"filter": "value.flag"}], {"flag": 1})
    assert "must give a bool" in err.message


# --------------------------------------------------------------------------- set
def test_set_computed_constant_and_metadata_fields() -> None:
    record = rec(key=b"abc", offset=42, timestamp_ms=1764928800000, headers=(("h", b"v"), ("n", None)))
    out = apply([{"set": {"amount_cents": "int(value.amount * 100.0)", "source": "'shop'",
                          "day": "timestamp(value.ts).getDate()", "at": "topic + '/' + string(partition) + '/' "
                          "+ string(offset)", "ts_ms": "timestamp", "k": "string(key)", "h": "string(headers.h)",
                          "n": "headers.n", "when_ts": "timestamp(value.ts)"}}],
                {"amount": 12.5, "ts": "2026-12-05T10:00:00Z"}, record)
    assert out == {"amount": 12.5, "ts": "2026-12-05T10:00:00Z", "amount_cents": 1250, "source": "shop", "day": 5,
                   "at": "orders/1/42", "ts_ms": 1764928800000, "k": "abc", "h": "v", "n": None,
                   "when_ts": "2026-12-05T10:00:00+00:00"}


def test_set_expressions_read_the_value_before_the_step() -> None:
    assert apply([{"set": {"a": "value.a + 1", "b": "value.a"}}], {"a": 1}) == {"a": 2, "b": 1}
    assert apply([{"set": {"a": "value.a + 1"}}, {"set": {"b": "value.a"}}], {"a": 1}) == {"a": 2, "b": 2}


def test_set_never_changes_the_decoded_document() -> None:
    doc = {"a": 1}
    apply([{"set": {"b": "2"}}, {"drop": ["a"]}, {"rename": {"b": "c"}}], doc)
    assert doc == {"a": 1}


def test_a_republished_record_reads_its_origin() -> None:
    out = apply([{"set": {"at": "topic + string(partition) + string(offset)"}}], {},
                rec(origin=("src", 3, 9)))
    assert out["at"] == "src39"


@pytest.mark.parametrize(("expr", "doc", "words"), [
    ("value.missing + 1", {}, "missing"),
    ("value.a / 0", {"a": 1}, "divide by zero"),
    ("int(value.s)", {"s": "x"}, "convert"),
    ("value.a + value.b", {"a": 1, "b": 1.5}, "overload"),
    ("9223372036854775807 + value.a", {"a": 1}, "overflow"),
    ("value.b", {"b": {"x": 10**20}}, "range"),
])
def test_set_errors_name_the_step_field_and_cause(expr: str, doc: dict[str, Any], words: str) -> None:
    err = failure([{"drop": ["zz"]}, {"set": {"out": expr}}], doc)
    assert err.message.startswith("transforms[1] (1-set): set.out: ")
    assert words in err.message.lower() or words in err.message


def test_has_gives_a_default_for_a_missing_field() -> None:
    steps = [{"set": {"qty": "has(value.qty) ? value.qty : 1"}}]
    assert apply(steps, {})["qty"] == 1
    assert apply(steps, {"qty": 3})["qty"] == 3


def test_a_value_that_is_not_an_object_is_a_transform_error() -> None:
    err = failure([{"drop": ["a"]}], [1, 2])
    assert "object" in err.message


# --------------------------------------------------------------------------- drop / rename
def test_drop_removes_fields_and_ignores_missing_ones() -> None:
    assert apply([{"drop": ["a", "zz"]}], {"a": 1, "b": 2}) == {"b": 2}


def test_rename() -> None:
    assert apply([{"rename": {"a": "x", "zz": "y"}}], {"a": 1, "b": 2}) == {"x": 1, "b": 2}
    assert apply([{"rename": {"a": "b", "b": "a"}}], {"a": 1, "b": 2}) == {"b": 1, "a": 2}
    err = failure([{"rename": {"a": "b"}}], {"a": 1, "b": 2})
    assert "'b' exists" in err.message


# --------------------------------------------------------------------------- flatten
def test_flatten_all_levels_by_default_keeping_arrays() -> None:
    doc = {"id": 1, "c": {"id": 2, "addr": {"city": "Rome", "geo": {"lat": 1.5}}, "tags": [1, {"x": 1}]},
           "empty": {}}
    assert apply([{"flatten": {}}], doc) == {"id": 1, "c_id": 2, "c_addr_city": "Rome", "c_addr_geo_lat": 1.5,
                                            "c_tags": [1, {"x": 1}], "empty": {}}


def test_flatten_separator_depth_and_fields() -> None:
    doc = {"a": {"b": {"c": 1}}, "d": {"e": 2}}
    assert apply([{"flatten": {"separator": "__", "max_depth": 1}}], doc) == {"a__b": {"c": 1}, "d__e": 2}
    assert apply([{"flatten": {"fields": ["d"]}}], doc) == {"a": {"b": {"c": 1}}, "d_e": 2}


def test_flatten_collision_fails_the_record() -> None:
    err = failure([{"flatten": {}}], {"a_b": 1, "a": {"b": 2}})
    assert "a_b" in err.message and "transforms[0] (0-flatten)" in err.message


# --------------------------------------------------------------------------- timestamp
@pytest.mark.parametrize(("fmt", "value", "expected"), [
    ("epoch_s", 1764928800, "2025-12-05T10:00:00+00:00"),
    ("epoch_s", 1764928800.5, "2025-12-05T10:00:00.500000+00:00"),
    ("epoch_s", "1764928800", "2025-12-05T10:00:00+00:00"),
    ("epoch_ms", 1764928800123, "2025-12-05T10:00:00.123000+00:00"),
    ("epoch_us", 1764928800123456, "2025-12-05T10:00:00.123456+00:00"),
    ("epoch_ns", 1764928800123456789, "2025-12-05T10:00:00.123456+00:00"),
    ("epoch_ms", -1000, "1969-12-31T23:59:59+00:00"),
    ("iso8601", "2025-12-05T10:00:00Z", "2025-12-05T10:00:00+00:00"),
    ("iso8601", "2025-12-05T12:00:00+02:00", "2025-12-05T10:00:00+00:00"),
])
def test_timestamp_formats(fmt: str, value: Any, expected: str) -> None:
    assert apply([{"timestamp": {"field": "t", "format": fmt}}], {"t": value}) == {"t": expected}


def test_timestamp_naive_values_read_in_the_time_zone_and_into() -> None:
    step = {"timestamp": {"field": "t", "format": "iso8601", "timezone": "Europe/Rome", "into": "at"}}
    assert apply([step], {"t": "2025-07-01T12:00:00"}) == {"t": "2025-07-01T12:00:00",
                                                          "at": "2025-07-01T10:00:00+00:00"}
    step = {"timestamp": {"field": "t", "format": "strptime", "pattern": "%d/%m/%Y %H:%M",
                          "timezone": "America/New_York"}}
    assert apply([step], {"t": "05/12/2025 05:00"}) == {"t": "2025-12-05T10:00:00+00:00"}


def test_timestamp_output_is_what_a_timestamptz_column_reads() -> None:
    out = apply([{"timestamp": {"field": "t", "format": "epoch_ms"}}], {"t": 1764928800123})
    assert datetime.datetime.fromisoformat(out["t"]) == datetime.datetime(2025, 12, 5, 10, 0, 0, 123000,
                                                                         tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize(("fmt", "doc", "words"), [
    ("epoch_ms", {}, "missing"),
    ("epoch_ms", {"t": "soon"}, "epoch number"),
    ("epoch_ms", {"t": True}, "epoch number"),
    ("epoch_s", {"t": 10**15}, "range"),
    ("iso8601", {"t": "05/12/2025"}, "not ISO 8601"),
    ("iso8601", {"t": 5}, "ISO 8601"),
])
def test_timestamp_errors(fmt: str, doc: dict[str, Any], words: str) -> None:
    err = failure([{"timestamp": {"field": "t", "format": fmt}}], doc)
    assert words in err.message and err.message.startswith("transforms[0] (0-timestamp): ")


def test_timestamp_null_stays_null() -> None:
    assert apply([{"timestamp": {"field": "t", "format": "epoch_ms"}}], {"t": None}) == {"t": None}


# --------------------------------------------------------------------------- when
def test_when_applies_a_step_only_where_it_holds() -> None:
    steps = [{"set": {"priority": "'high'"}, "when": "value.amount >= 1000.0"},
             {"filter": "false", "when": "value.amount < 0.0"}]
    assert apply(steps, {"amount": 2000.0})["priority"] == "high"
    assert "priority" not in apply(steps, {"amount": 10.0})
    with pytest.raises(Filtered):
        apply(steps, {"amount": -1.0})


def test_when_that_fails_is_a_transform_error() -> None:
    err = failure([{"drop": ["a"], "when": "value.nope > 1"}], {"a": 1})
    assert err.message.startswith("transforms[0] (0-drop): when: ")


# --------------------------------------------------------------------------- config and compile errors
def test_a_step_has_exactly_one_kind() -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        TransformStep.model_validate({"filter": "true", "drop": ["a"]})
    with pytest.raises(ValidationError, match="exactly one of"):
        TransformStep.model_validate({"when": "true"})
    with pytest.raises(ValidationError):
        TransformStep.model_validate({"explode": "value.items"})
    with pytest.raises(ValidationError, match="pattern is required"):
        TransformStep.model_validate({"timestamp": {"field": "t", "format": "strptime"}})
    with pytest.raises(ValidationError, match="unknown time zone"):
        TransformStep.model_validate({"timestamp": {"field": "t", "format": "iso8601", "timezone": "Mars/Base"}})
    with pytest.raises(ValidationError, match="invalid field name"):
        TransformStep.model_validate({"set": {"a.b": "1"}})


@pytest.mark.parametrize(("steps", "path", "where"), [
    ([{"drop": ["a"]}, {"filter": "true"}, {"set": {"ok": "1", "amount_cents": "int(value.amount * )"}}],
     "pipelines[0].transforms[2].set.amount_cents", "line 1, column 20"),
    ([{"filter": "value.tenant = 'x'"}], "pipelines[0].transforms[0].filter", "line 1, column"),
    ([{"drop": ["a"], "when": "nosuch.var"}], "pipelines[0].transforms[0].when", "line 1, column"),
    ([{"filter": "1 + 2"}], "pipelines[0].transforms[0].filter", "a predicate must give a bool"),
    ([{"set": {"x": "'a' + 1"}}], "pipelines[0].transforms[0].set.x", "no matching overload"),
])
def test_an_expression_that_does_not_compile_names_its_config_path_and_position(
        steps: list[dict[str, Any]], path: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        transformer(*steps)
    text = str(info.value)
    assert text.startswith(path + ": does not compile") and where in text


def minimal(transforms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pipelines": [
        {"name": "other", "topics": ["t0"], "sink": {"table": "t0", "conflict_key": ["id"],
                                                        "columns": {"id": {"type": "bigint"}}}},
        {"name": "p1", "topics": ["t1"], "transforms": transforms,
         "sink": {"table": "t", "conflict_key": ["id"], "columns": {"id": {"type": "bigint"},
                                                                    "v": {"type": "text"}}}},
    ]}


def test_loading_a_config_refuses_a_step_that_does_not_compile(tmp_path: Path) -> None:
    path = write_config(tmp_path, minimal([{"filter": "true"}, {"set": {"v": "string(value.id"}}]))
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    text = str(info.value)
    assert str(path) in text
    assert "pipelines[1].transforms[1].set.v: does not compile at line 1, column 16" in text


def test_loading_a_config_with_good_transforms(tmp_path: Path) -> None:
    settings = load_settings(write_config(tmp_path, minimal([{"filter": "true", "name": "all"},
                                                             {"set": {"v": "string(value.id)"}}])))
    steps = settings.pipelines[1].transforms
    assert [s.kind for s in steps] == ["filter", "set"] and steps[0].label(0) == "all"


def test_step_names_are_unique(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="two steps have one name"):
        load_settings(write_config(tmp_path, minimal([{"filter": "true", "name": "x"},
                                                      {"drop": ["a"], "name": "x"}])))


def test_the_cli_check_refuses_it_with_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ingest.cli import app

    path = write_config(tmp_path, minimal([{"set": {"v": "value.id +"}}]))
    result = CliRunner().invoke(app, ["check", "-c", str(path)])
    assert result.exit_code == 2
    assert "pipelines[1].transforms[0].set.v: does not compile at line 1" in result.output


# --------------------------------------------------------------------------- the pipeline's mapper
def pipeline(transforms: list[dict[str, Any]], **extra: Any) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["orders"], "transforms": transforms, **extra,
        "sink": {"table": "t", "conflict_key": ["id"], "columns": {
            "id": {"type": "bigint", "required": True}, "amount_cents": {"type": "bigint"},
            "at": {"type": "timestamptz"}}}})


def test_mapper_for_applies_transforms_between_decode_and_map() -> None:
    m = mapper_for(pipeline([{"filter": "value.tenant != 'test'"},
                             {"set": {"amount_cents": "int(value.amount * 100.0)"}},
                             {"rename": {"order_id": "id"}},
                             {"timestamp": {"field": "ms", "format": "epoch_ms", "into": "at"}}]))
    assert isinstance(m, TransformingMapper)
    row, key = m.map(rec({"order_id": 7, "tenant": "a", "amount": 1.25, "ms": 0}))
    assert row[:3] == (7, 125, datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)) and key == b"k1"
    with pytest.raises(Filtered):
        m.map(rec({"order_id": 8, "tenant": "test"}))
    with pytest.raises(InvalidRecord) as info:
        m.map(rec({"order_id": 9, "tenant": "a", "amount": "x", "ms": 0}))
    assert info.value.stage == "transform"
    with pytest.raises(InvalidRecord) as info:  # decode errors stay decode errors
        m.map(Record("orders", 0, 1, None, b"{nope", None))
    assert info.value.stage == "decode"
    with pytest.raises(InvalidRecord) as info:  # a tombstone is the mapper's, as without transforms
        m.map(Record("orders", 0, 1, None, None, None))
    assert info.value.error_class == "tombstone"
    assert m.columnar_plan(None) is None


def test_mapper_for_without_transforms_is_the_plain_mapper() -> None:
    assert not isinstance(mapper_for(pipeline([])), TransformingMapper)


def test_change_events_transform_the_row_image() -> None:
    p = pipeline([{"set": {"amount_cents": "value.amount * 10"}}, {"filter": "value.id != 13"}],
                 envelope="debezium")
    m = mapper_for(p)
    event = {"op": "c", "before": None, "after": {"id": 7, "amount": 3}, "source": {}}
    row, _ = m.map(rec(event))
    assert row[:2] == (7, 30)
    with pytest.raises(Filtered):
        m.map(rec({"op": "u", "before": None, "after": {"id": 13, "amount": 3}, "source": {}}))


def test_a_delete_before_image_goes_through_the_steps_that_move_fields_only() -> None:
    from ingest.types import DeleteRow

    p = pipeline([{"filter": "value.status != 'draft'"}, {"set": {"amount_cents": "int(value.amount * 10.0)"}},
                  {"rename": {"key_id": "id"}}, {"drop": ["secret"]}], envelope="debezium")
    m = mapper_for(p)
    row, _ = m.map(rec({"op": "c", "before": None, "after": {"key_id": 7, "amount": 3.0, "status": "ok"},
                        "source": {}}))
    assert row[:2] == (7, 30)
    # REPLICA IDENTITY DEFAULT: the before image holds the key alone; filter and set would fail on it
    row, _ = m.map(rec({"op": "d", "before": {"key_id": 7, "amount": None, "status": None}, "after": None,
                        "source": {}}))
    assert isinstance(row, DeleteRow) and row[0] == 7


def test_preview_reports_rows_filtered_and_errors(tmp_path: Path) -> None:
    sample = tmp_path / "s.jsonl"
    sample.write_text('{"order_id": 1, "tenant": "a", "amount": 1.0, "ms": 0}\n\n{"order_id": 2, "tenant": "test"}\n'
                      '{"order_id": 3, "tenant": "a", "amount": "1", "ms": 0}\nnot json\n')
    p = pipeline([{"filter": "value.tenant != 'test'", "name": "no-test"},
                  {"set": {"amount_cents": "int(value.amount * 100.0)"}}, {"rename": {"order_id": "id"}},
                  {"timestamp": {"field": "ms", "format": "epoch_ms", "into": "at"}}])

    class NoRegistry:
        schema_registry = None

    report = preview(NoRegistry(), p, records_from_jsonl(sample, topic="orders"))
    assert [r["row"]["id"] for r in report.rows] == [1] and report.rows[0]["offset"] == 0
    assert report.filtered == [{"topic": "orders", "partition": 0, "offset": 1, "step": "no-test"}]
    assert [(e["offset"], e["stage"]) for e in report.errors] == [(2, "transform"), (3, "decode")]
    limited = preview(NoRegistry(), p, records_from_jsonl(sample, topic="orders", limit=2))
    assert len(limited.rows) + len(limited.filtered) + len(limited.errors) == 2


def test_preview_cli_from_a_jsonl_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ingest.cli import app

    config = write_config(tmp_path, minimal([{"filter": "value.id != 2"}]))
    sample = tmp_path / "s.jsonl"
    sample.write_text('{"value": {"id": 1, "v": "x"}, "key": "a", "offset": 10}\n{"value": {"id": 2}}\n'
                      '{"value_text": "oops", "offset": 12}\n')
    result = CliRunner().invoke(app, ["preview", "-c", str(config), "-p", "p1", "--from-file", str(sample),
                                      "--metadata", "--format", "json"])
    assert result.exit_code == 0, result.output
    out = orjson.loads(result.stdout)
    assert [r["row"] for r in out["tables"]["t"]] == [{"id": 1, "v": "x"}]
    assert out["filtered"][0]["step"] == "0-filter" and out["errors"][0]["offset"] == 12


# --------------------------------------------------------------------------- properties
values = st.dictionaries(st.sampled_from(["tenant", "amount", "a", "b"]),
                         st.one_of(st.none(), st.integers(-10**6, 10**6), st.text(max_size=5),
                                   st.sampled_from(["test", "acme"])), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(values, max_size=40))
def test_a_filters_kept_plus_filtered_plus_failed_is_its_input(docs: list[dict[str, Any]]) -> None:
    t = transformer({"filter": "value.tenant != 'test'"}, {"set": {"seen": "true"}})
    kept = filtered = failed = 0
    for i, doc in enumerate(docs):
        try:
            out = t.apply(rec({}, offset=i), doc)
        except Filtered:
            filtered += 1
        except InvalidRecord:
            failed += 1
        else:
            kept += 1
            assert out == {**doc, "seen": True}
    assert kept + filtered + failed == len(docs)
    # a record without the field the filter reads is dead-lettered, never dropped or passed on
    assert failed == sum(1 for d in docs if "tenant" not in d)
    assert filtered == sum(1 for d in docs if d.get("tenant") == "test")


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.one_of(st.integers(), st.text(max_size=3), st.none()),
                    lambda children: st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3),
                    max_leaves=12).filter(lambda d: isinstance(d, dict)))
def test_flatten_keeps_every_leaf_once(doc: dict[str, Any]) -> None:
    def leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
        if type(node) is dict and node:
            return [leaf for k, v in node.items() for leaf in leaves(v, f"{prefix}{k}.")]
        return [(prefix[:-1], node)]

    try:
        out = apply([{"flatten": {"separator": "."}}], doc)
    except InvalidRecord as exc:
        assert "flatten to" in exc.message
        return
    expected = [leaf for k, v in doc.items() for leaf in leaves(v, f"{k}.")]
    assert sorted(out.items(), key=repr) == sorted(expected, key=repr)


# --------------------------------------------------------------------------- the accept loop
def test_filtered_records_are_done_at_once_and_counted_per_step() -> None:
    import random

    from ingest.core.offsets import OffsetTracker
    from ingest.metrics import Metrics
    from ingest.runner.accept import Acceptor
    from ingest.runner.stats import PipelineStats
    from ingest.types import Partition

    p = pipeline([{"filter": "value.tenant != 'test'", "name": "no-test"}, {"filter": "value.order_id != 2"},
                  {"rename": {"order_id": "id"}}], lanes=1)
    tracker: OffsetTracker[Partition] = OffsetTracker()
    tp = Partition("orders", 1)
    tracker.assign(tp)
    handed: list[Any] = []

    class Batching:
        def __len__(self) -> int:
            return 1

        def buffer(self, lane: int, items: list[Any], sizes: list[int], now_ms: int) -> None:
            handed.extend(items)

    class Load:
        def observe(self, lane: int, key: bytes | None, size_bytes: int) -> None:
            pass

    metrics, stats = Metrics(), PipelineStats()
    acceptor = Acceptor(p, mapper_for(p), tracker=tracker, batching=Batching(), load=Load(),  # type: ignore[arg-type]
                        stats=stats, metrics=metrics.pipeline("p"), deterministic=False)
    acceptor._rng = random.Random(1)
    docs = [{"order_id": 1, "tenant": "test"}, {"order_id": 2, "tenant": "a"},
            {"order_id": 3, "tenant": "a", "amount_cents": 5}, {"tenant": "a"}, {"order_id": 4, "tenant": "test"}]
    acceptor.accept([rec(d, offset=i) for i, d in enumerate(docs)], 0)
    assert stats.filtered == {"no-test": 2, "1-filter": 1} and stats.skipped == 0
    assert stats.as_dict()["filtered"] == 3 and stats.as_dict()["filtered_by_step"] == {"no-test": 2, "1-filter": 1}
    # offsets 0, 1, 4 are done; 2 (a row) and 3 (a transform error on its way to the DLQ) are handed on
    assert [item.record.offset for item in handed] == [2, 3]
    assert handed[0].row is not None and handed[1].failure.stage == "transform"
    assert tracker.done_many(tp, [2, 3], tracker.epoch(tp)) >= 0
    assert tracker.watermark(tp) == 5
    sample = metrics.registry.get_sample_value
    assert sample("ingest_records_filtered_total", {"pipeline": "p", "step": "no-test"}) == 2
    assert sample("ingest_records_filtered_total", {"pipeline": "p", "step": "1-filter"}) == 1


def test_constant_expressions_are_evaluated_once_and_one_that_always_fails_is_refused() -> None:
    t = transformer({"set": {"source": "'shop'", "n": "2 * 21", "x": "value.a"}})
    step = t.steps[0]
    assert step.constants == {"source": "shop", "n": 42} and [f for f, _ in step.fields] == ["x"]
    assert t.apply(rec({}), {"a": 1}) == {"a": 1, "source": "shop", "n": 42, "x": 1}
    with pytest.raises(ConfigError, match=r"transforms\[0\]\.set\.bad: fails for every record: .*divide by zero"):
        transformer({"set": {"bad": "1 / 0"}})


def test_only_the_metadata_expressions_read_is_built_and_a_name_in_a_literal_is_harmless() -> None:
    t = transformer({"set": {"a": "'headers and key' + value.s", "b": "string(offset)"}})
    assert t.apply(rec({}, offset=9), {"s": "!"}) == {"s": "!", "a": "headers and key!", "b": "9"}


# --------------------------------------------------------------------------- against a declared schema
AVSC = {"type": "record", "name": "Order", "fields": [
    {"name": "order_id", "type": "long"}, {"name": "tenant", "type": "string"},
    {"name": "amount", "type": "double"}, {"name": "ts", "type": "string"},
    {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [{"name": "id", "type": "long"}]}},
]}


def schema_report(tmp_path: Path, transforms: list[dict[str, Any]], columns: dict[str, Any]):
    from ingest.formats.check import check_schemas
    from ingest.formats.registry import build_decoder

    avsc = tmp_path / "order.avsc"
    avsc.write_text(orjson.dumps(AVSC).decode())
    p = PipelineSettings.model_validate({
        "name": "p", "topics": ["orders"], "format": "avro", "avro_schema": str(avsc), "transforms": transforms,
        "sink": {"table": "t", "conflict_key": ["id"], "columns": columns}})
    return check_schemas(p, build_decoder(p, None), None, "pipelines[0].transforms")


def test_check_refuses_an_expression_reading_a_field_the_schema_lacks(tmp_path: Path) -> None:
    report = schema_report(tmp_path, [
        {"filter": "value.tenant != 'test' && has(value.maybe)"},
        {"set": {"amount_cents": "int(value.amount * 100.0)", "x": "value.customer.id + value.nosuch",
                 "day": "timestamp(value.ts).getDate()"}},
        {"set": {"y": "value.amount_cents + 1"}},  # produced by the step before: not looked up
        {"drop": ["tenant"]},
        {"filter": "value.tenant != ''", "when": "value.customer.nope > 0"},
        {"flatten": {}},
        {"set": {"z": "value.anything"}},  # after a flatten: not traced
    ], {"id": {"type": "bigint", "source": "$.order_id"}, "amount_cents": {"type": "bigint"}})
    tail = ": every record reaching it would be dead-lettered"
    assert report.problems == [
        "pipeline p: pipelines[0].transforms[1].set.x: reads value.nosuch (line 1, column 21), a field the "
        "avro_schema order.avsc lacks" + tail,
        "pipeline p: pipelines[0].transforms[4].when: reads value.customer.nope (line 1, column 1), a field the "
        "avro_schema order.avsc lacks" + tail,
        "pipeline p: pipelines[0].transforms[4].filter: reads value.tenant (line 1, column 1), which an earlier "
        "step dropped" + tail,
    ]


def test_check_traces_columns_through_rename_set_and_drop(tmp_path: Path) -> None:
    report = schema_report(tmp_path, [{"rename": {"order_id": "id"}}, {"set": {"cents": "1"}},
                                      {"drop": ["tenant"]}],
                           {"id": {"type": "bigint", "required": True},  # renamed: order_id is in the schema
                            "cents": {"type": "bigint", "required": True},  # produced
                            "tenant": {"type": "text", "required": True},  # dropped: always missing
                            "gone": {"type": "text"}})  # not in the schema: a warning, as without transforms
    assert len(report.problems) == 1 and "column tenant (source $.tenant) is dropped by the transforms" \
        in report.problems[0]
    assert len(report.warnings) == 1 and "column gone" in report.warnings[0]
    clean = schema_report(tmp_path, [], {"id": {"type": "bigint", "source": "$.order_id", "required": True}})
    assert clean.problems == [] and clean.warnings == []


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from(["id", "amount", "tenant", "ts", "a", "b", "a_b"]),
                                               children, max_size=4)),
    max_leaves=15)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_value_is_mapped_filtered_or_dead_lettered_never_a_crash(value: Any) -> None:
    m = mapper_for(pipeline([
        {"filter": "!has(value.tenant) || value.tenant != 'test'"},
        {"set": {"amount_cents": "int(value.amount * 100.0)"}, "when": "has(value.amount)"},
        {"flatten": {}},
        {"rename": {"a_b": "ab"}},
        {"timestamp": {"field": "ts", "format": "iso8601", "into": "at"}, "when": "has(value.ts)"},
        {"set": {"id": "has(value.id) ? value.id : 0"}},
        {"drop": ["b"]},
    ]))
    try:
        row, _ = m.map(Record("orders", 0, 1, None, orjson.dumps(value), None))  # JSON null too: not a tombstone
    except Filtered as exc:
        assert exc.step == "0-filter"
    except InvalidRecord as exc:
        assert exc.stage in ("transform", "map") and exc.message
    else:
        assert len(row) == len(m.column_names)


def test_a_set_step_computes_its_fields_in_one_evaluation_and_names_the_one_that_fails() -> None:
    t = transformer({"set": {"a": "value.x + 1 // one", "b": "string(value.x) + \"'\"", "é \"q\"": "value.x * 2",
                             "c": "'const'"}})
    step = t.steps[0]
    assert step.fused is not None and step.constants == {"c": "const"}
    assert t.apply(rec({}), {"x": 1}) == {"x": 1, "a": 2, "b": "1'", "é \"q\"": 2, "c": "const"}
    err = failure([{"set": {"a": "value.x + 1", "b": "value.nope", "d": "value.x"}}], {"x": 1})
    assert err.message.startswith("transforms[0] (0-set): set.b: ")


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["x", "y"]), st.one_of(st.integers(-100, 100), st.text(max_size=3),
                                                               st.none()), max_size=2))
def test_the_fused_set_gives_what_the_fields_give_one_by_one(doc: dict[str, Any]) -> None:
    fused_t = transformer({"set": {"a": "value.x + 1", "b": "string(value.y)"}})
    plain_t = transformer({"set": {"a": "value.x + 1", "b": "string(value.y)"}})
    plain_t.steps[0].fused = None

    def outcome(t: Any) -> Any:
        try:
            return t.apply(rec({}), doc)
        except InvalidRecord as exc:
            return exc.message

    assert fused_t.steps[0].fused is not None
    assert outcome(fused_t) == outcome(plain_t)


def test_preview_takes_exact_bytes_in_base64(tmp_path: Path) -> None:
    import base64

    sample = tmp_path / "s.jsonl"
    raw = base64.b64encode(b'{"order_id": 4, "tenant": "a", "amount": 2.0, "ms": 0}').decode()
    sample.write_text(f'{{"value_base64": "{raw}", "offset": 3}}\n{{"value_base64": "%%%"}}\n')
    records = records_from_jsonl(sample, topic="orders", metadata=True)
    assert next(records).value == b'{"order_id": 4, "tenant": "a", "amount": 2.0, "ms": 0}'
    with pytest.raises(ConfigError, match="s.jsonl:2: value_base64 is not base64"):
        next(records)


@pytest.mark.parametrize(("text", "refs"), [
    ("value.a + value.b.c", [("a",), ("b", "c")]),
    ("has(value.x) ? value.x : 1", [("x",)]),  # the test is not a read; the read is
    ("'value.z' + \"value.w\" + value.y", [("y",)]),  # string literals are not reads
    ("x.value.q + value . r", [("r",)]),  # a field named value is not the variable
    ("timestamp(value.ts).getDate() + value.items.all(i, i > 1)", [("ts",), ("items",)]),  # methods, macros
    ("value['a'] + value.size()", []),  # index syntax is not followed; size() is a method of value
])
def test_the_fields_an_expression_reads(text: str, refs: list[tuple[str, ...]]) -> None:
    from ingest.core.transforms.fields import references

    assert [path for path, _, _ in references(text)] == refs


def test_the_shape_follows_renames_drops_and_produced_fields() -> None:
    from ingest.core.transforms.fields import column_origin

    steps = [TransformStep.model_validate(s) for s in [
        {"rename": {"a": "b"}}, {"rename": {"b": "c", "x": "a"}}, {"set": {"d": "1"}}, {"drop": ["e"]},
        {"timestamp": {"field": "f", "format": "epoch_ms", "into": "g"}}, {"set": {"e": "2"}}]]
    assert column_origin(steps, "c") == ("a",)  # a -> b -> c
    assert column_origin(steps, "a") == ("x",)
    assert column_origin(steps, "b") == "dropped"  # renamed away
    assert column_origin(steps, "d") is None and column_origin(steps, "g") is None  # produced
    assert column_origin(steps, "e") is None  # dropped, then set again
    assert column_origin(steps, "f") == ("f",)
    assert column_origin([*steps, TransformStep.model_validate({"flatten": {}})], "f") is None

"""Transforms on the columnar tier (ingest.core.transforms.subset / .columnar) against the row path.

The row path -- :class:`~ingest.core.transforms.compile.Transformer` over the CEL binding -- is the
authority. Differential (hypothesis): random records and random expressions and steps of the subset;
for every record the columnar evaluation did not hand back (``rejected``), it must have filtered
exactly the records the row path filters (with the same filter's label) and produced exactly the
row path's field values, type for type and bit for bit. The tests below also hold the compiler's
refusals, CEL's own corner cases the evaluation relies on, and the plan and tier around it (rows,
filtered counts, poison) against the row mapper.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ingest.cdc.mapper import TransformingMapper, mapper_for
from ingest.config import PipelineSettings
from ingest.config.transforms import TransformStep
from ingest.core.collapse import collapse
from ingest.core.mapping.columnar import BatchFields
from ingest.core.transforms import compile_transforms
from ingest.core.transforms.cel import CompileError, compile_expression
from ingest.core.transforms.columnar import compile_columnar, double_text
from ingest.core.transforms.subset import Unsupported, parse
from ingest.errors import ConfigError, Filtered, InvalidRecord
from ingest.runner.columnar import ColumnarTier
from ingest.types import Item, Record

FIELDS = ("a", "b", "c", "d", "e")
OUT_KEYS = ["a", "b", "c", "d", "e", "x", "y"]


# --------------------------------------------------------------------------- the parser
@pytest.mark.parametrize(("text", "tree"), [
    ("value.a", ("field", "a")),
    ("1 + 2 * 3", ("bin", "+", ("const", 1), ("bin", "*", ("const", 2), ("const", 3)))),
    ("value.a - 1 - 2", ("bin", "-", ("bin", "-", ("field", "a"), ("const", 1)), ("const", 2))),
    ("!!value.a", ("field", "a")),  # CEL's parser drops an even run of ! or -
    ("---value.a", ("neg", ("field", "a"))),
    ("-value.a * 2", ("bin", "*", ("neg", ("field", "a")), ("const", 2))),
    ("value.t ? 1 : value.f ? 2 : 3",
     ("cond", ("field", "t"), ("const", 1), ("cond", ("field", "f"), ("const", 2), ("const", 3)))),
    ("value.a || value.b && !value.c", ("or", ("field", "a"), ("and", ("field", "b"), ("not", ("field", "c"))))),
    ("value.a < 2 == true", ("bin", "==", ("bin", "<", ("field", "a"), ("const", 2)), ("const", True))),
    ("has(value.x) ? int(value.x) : -1", ("cond", ("has", "x"), ("call", "int", ("field", "x")),
                                          ("neg", ("const", 1)))),
    ("'it\\'s' + \"a\\tb\" + string(value.n)", ("bin", "+", ("bin", "+", ("const", "it's"), ("const", "a\tb")),
                                                ("call", "string", ("field", "n")))),
    ("2.5e-3 // a comment\n + double(offset)", ("bin", "+", ("const", 0.0025), ("call", "double", ("meta", "offset")))),
    ("dyn(topic) == 't'", ("bin", "==", ("call", "dyn", ("meta", "topic")), ("const", "t"))),
])
def test_the_subset_parses_with_cels_precedence(text: str, tree: tuple) -> None:
    compile_expression(text)  # CEL takes it too
    assert parse(text) == tree


@pytest.mark.parametrize(("text", "says"), [
    ("size(value.a)", "the function size()"),
    ("value.a.size()", "a field of a field or a method call"),
    ("value.a.b", "a field of a field"),
    ("value['a']", "'value' other than as value.FIELD"),
    ("key", "the variable 'key'"),
    ("headers", "the variable 'headers'"),
    ("value", "'value' other than as value.FIELD"),
    ("1u", "'1u'"),
    ("0x10", "'0x10'"),
    ("9223372036854775808 == value.a", "the integer literal 9223372036854775808"),
    ("r'a'", "\"r'a'\""),
    ("b'a'", "\"b'a'\""),
    ("'\\x41'", "the escape \\x"),
    ("value.a in [1]", "the 'in' operator"),
    ("{'a': 1}", "(at column 1)"),
    ("timestamp(value.a)", "the function timestamp()"),
    ("int(value.a, 1)", "int() with more than one argument"),
])
def test_what_is_outside_the_subset_is_named(text: str, says: str) -> None:
    with pytest.raises(Unsupported) as info:
        parse(text)
    assert says in str(info.value)


# --------------------------------------------------------------------------- CEL's own corner cases
def cel(text: str, value: dict[str, Any]) -> Any:
    """The row path's value of one expression (a ``set``), or ``("error", message)``."""
    try:
        return transformer([{"set": {"r": text}}]).apply(rec(value), value)["r"]
    except (InvalidRecord, ConfigError) as exc:  # a constant that fails is refused at start-up
        return ("error", str(exc))


@settings(max_examples=300, deadline=None)
@given(st.floats() | st.sampled_from([1e6, 999999.5, 1e-4, 9.99999e-5, 1e-5, 1e16, 1e21, 123456789.0,
                                      5e-324, -0.0, 0.0, 2.0**63, 1e300, float("inf")]))
def test_string_of_a_double_is_written_as_cel_writes_it(x: float) -> None:
    got = cel("string(value.x)", {"x": x}) if math.isfinite(x) else None
    if got is not None:
        assert double_text(x) == got
    if x != x:
        assert double_text(x) is None


def test_cel_semantics_the_evaluation_relies_on() -> None:
    """What cel-expr-python does (the module docstring of ingest.core.transforms.columnar relies on it)."""
    v = {"i": 1, "d": 1.0, "s": "a", "n": None, "min": -(2**63), "m7": -7, "z": 0, "p53": 2**53 + 1,
         "d53": 2.0**53}
    assert cel("value.i == value.d", v) is True and cel("value.i == value.s", v) is False
    assert cel("value.n == value.n", v) is True and cel("value.n == value.i", v) is False
    assert cel("value.i < 1.5", v) is True
    assert cel("value.p53 == value.d53", v) is True  # int beside double: converted, not exact (unsure here)
    assert cel("value.m7 / 2", v) == -3 and cel("value.m7 % 2", v) == -1 and cel("7 % -2", v) == 1
    assert cel("value.min / -1", v)[0] == "error" and cel("value.min % -1", v)[0] == "error"
    assert cel("value.i / value.z", v)[0] == "error" and cel("-value.min", v)[0] == "error"
    assert cel("--value.min", v) == -(2**63)  # an even run of - is no operator
    assert cel("value.i + value.d", v)[0] == "error"
    assert cel("value.i && false", v) is False and cel("true && value.i", v)[0] == "error"
    assert cel("int(9223372036854774784.0)", v) == 9223372036854774784
    assert cel("int(-9223372036854775808.0)", v)[0] == "error"
    assert cel("int(' 12')", v) == 12 and cel("double('0x10')", v) == 16.0  # unsure here (not plain digits)
    assert cel("bool('True')", v) is True and cel("bool('T')", v)[0] == "error"


# --------------------------------------------------------------------------- differential
def rec(value: Any, offset: int = 0) -> Record:
    return Record("t", offset % 3, offset, b"k", orjson.dumps(value), 1_700_000_000_000 + offset)


def transformer(steps: list[dict[str, Any]]):
    t = compile_transforms([TransformStep.model_validate(s) for s in steps], "w")
    assert t is not None
    return t


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    return a == b


#: records compared in the differential tests: taken by the columnar evaluation (written or filtered),
#: or handed to the row path
SEEN: Counter[str] = Counter()
#: the checks of SEEN read what this module's differential tests counted: the whole module on one worker
#: (pytest-xdist --dist loadgroup, as scripts/test.sh runs the suite)
pytestmark = pytest.mark.xdist_group("transforms-columnar")


def differential(steps: list[dict[str, Any]], docs: list[dict[str, Any]]) -> tuple[set[int], dict[str, list[int]]]:
    """Both evaluations on ``docs``; asserts the contract. Returns (rejected, filtered)."""
    settings_ = [TransformStep.model_validate(s) for s in steps]
    try:
        t = compile_transforms(settings_, "w")
    except ConfigError:  # a set expression that reads nothing and fails: refused at start-up
        assume(False)
    bound = compile_columnar(settings_, t).bind(OUT_KEYS)
    records = [rec(doc, i) for i, doc in enumerate(docs)]
    decoded = bound.decode_lines(b"\n".join(r.value for r in records))
    by_field = list(zip(*map(msgspec.structs.astuple, decoded), strict=True))
    rejected: set[int] = set()
    out, filtered = bound.apply(by_field, BatchFields(records), rejected, len(records))
    dropped_by = {i: label for label, positions in filtered.items() for i in positions}
    assert not rejected & set(dropped_by)
    for i, r in enumerate(records):
        try:
            row: Any = t.apply(r, orjson.loads(r.value))
        except Filtered as exc:
            row = ("filtered", exc.step)
        except InvalidRecord as exc:
            row = ("error", exc.message)
        if i in rejected:
            SEEN["rejected"] += 1
            continue
        if i in dropped_by:
            assert row == ("filtered", dropped_by[i]), (i, docs[i], row)
            SEEN["filtered"] += 1
            continue
        assert type(row) is dict, (i, docs[i], row)
        got = {k: out[j][i] for j, k in enumerate(OUT_KEYS)}
        want = {k: row.get(k) for k in OUT_KEYS}
        assert all(_same(got[k], want[k]) for k in OUT_KEYS), (i, docs[i], got, want)
        SEEN["taken"] += 1
    return rejected, filtered


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-20, max_value=20),
    st.sampled_from([2**53 + 1, 2**62, 2**63 - 1, -(2**63), -(2**53)]),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0.0, -0.0, 1.5, -2.5, 1e20, 1e-5, 123456.7, 2.0**53, 9.2e18, 1e300, 0.1, 100.0]),
    st.sampled_from(["a", "", "12", "-3", "1.5", "true", "f", " 7", "x y", "é", "😀", "0", "False"]),
)
documents = st.fixed_dictionaries({}, optional={name: scalars for name in FIELDS})

_LITERALS = ["0", "1", "2", "7", "16", "9223372036854775807", "0.0", "1.5", "100.0", "1e20", "2.5e-5",
             "'a'", "''", "'12'", "'1.5'", "'true'", "' 7'", "true", "false", "null"]


@st.composite
def expressions(draw: st.DrawFn, depth: int = 3) -> str:
    leaf = st.one_of(st.sampled_from([f"value.{f}" for f in FIELDS]), st.sampled_from(_LITERALS),
                     st.sampled_from([f"has(value.{f})" for f in FIELDS] + ["partition", "offset", "topic", "timestamp"]))
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(leaf)
    sub = expressions(depth=depth - 1)
    shape = draw(st.sampled_from(["bin"] * 6 + ["unary", "cond", "cast", "logic"]))
    if shape == "bin":
        op = draw(st.sampled_from(["+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">="]))
        a, b = draw(sub), draw(sub)
        return f"({a} {op} {b})" if draw(st.booleans()) else f"{a} {op} {b}"
    if shape == "logic":
        op = draw(st.sampled_from(["&&", "||"]))
        return f"({draw(sub)} {op} {draw(sub)})"
    if shape == "unary":
        return f"{draw(st.sampled_from(['!', '-', '!!', '--']))}({draw(sub)})"
    if shape == "cond":
        return f"({draw(sub)} ? {draw(sub)} : {draw(sub)})"
    return f"{draw(st.sampled_from(['int', 'double', 'string', 'bool', 'dyn']))}({draw(sub)})"


def _compiles(text: str, predicate: bool = False) -> bool:
    try:
        compile_expression(text, predicate=predicate)
        return True
    except CompileError:
        return False


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(expressions(), expressions(), st.lists(documents, min_size=1, max_size=12))
@example("value.a + value.b", "int(value.c) * 2", [{"a": 2**63 - 1, "b": 1, "c": 1.9}, {"a": 1, "b": 2, "c": -1.9}])
@example("string(value.a)", "value.a % value.b", [{"a": 1e21, "b": 0}, {"a": 0.0001, "b": -7}, {"a": -7, "b": 2}])
@example("value.a < value.b", "value.a == value.b", [{"a": 1, "b": 1.5}, {"a": 2**53 + 1, "b": 2.0**53}, {"a": "é", "b": "😀"}])
def test_set_expressions_give_the_row_paths_values(x: str, y: str, docs: list[dict[str, Any]]) -> None:
    assume(_compiles(x) and _compiles(y))
    differential([{"set": {"x": x, "y": y}}], docs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(expressions(), st.lists(documents, min_size=1, max_size=12))
def test_filters_drop_what_the_row_path_drops(predicate: str, docs: list[dict[str, Any]]) -> None:
    assume(_compiles(predicate, predicate=True))
    differential([{"filter": predicate, "name": "f"}], docs)


@st.composite
def step_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["filter", "set", "drop", "rename"]))
        if kind == "filter":
            step: dict[str, Any] = {"filter": draw(expressions(depth=2))}
        elif kind == "set":
            names = draw(st.lists(st.sampled_from([*FIELDS, "x", "y"]), min_size=1, max_size=2, unique=True))
            step = {"set": {name: draw(expressions(depth=2)) for name in names}}
        elif kind == "drop":
            step = {"drop": draw(st.lists(st.sampled_from([*FIELDS, "x"]), min_size=1, max_size=2, unique=True))}
        else:
            olds = draw(st.lists(st.sampled_from([*FIELDS, "x"]), min_size=1, max_size=2, unique=True))
            news = draw(st.lists(st.sampled_from([*FIELDS, "x", "y"]), min_size=len(olds), max_size=len(olds),
                                 unique=True))
            step = {"rename": dict(zip(olds, news, strict=True))}
        if draw(st.integers(0, 2)) == 0:
            step["when"] = draw(expressions(depth=1))
        steps.append(step)
    return steps


def _step_compiles(step: dict[str, Any]) -> bool:
    texts = [(step["filter"], True)] if "filter" in step else []
    texts += [(t, False) for t in step.get("set", {}).values()] + ([(step["when"], True)] if "when" in step else [])
    return all(_compiles(text, predicate) for text, predicate in texts)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(step_lists(), st.lists(documents, min_size=1, max_size=12))
@example([{"rename": {"a": "b", "b": "a"}}, {"drop": ["c"], "when": "has(value.a)"}],
         [{"a": 1, "b": "s", "c": 2}, {"b": 2}, {"c": 1.5}])
@example([{"rename": {"a": "b"}, "when": "value.c == 1"}, {"set": {"x": "has(value.a)", "y": "value.b"}}],
         [{"a": 1, "b": 2, "c": 1}, {"a": 1, "c": 1}, {"a": 1, "b": 2, "c": 2}, {"b": 3}])
def test_step_lists_give_the_row_paths_documents(steps: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    assume(all(_step_compiles(s) for s in steps))
    differential(steps, docs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats() | st.sampled_from([1e-4, 9.999999999999999e-05, 999999.9999999999, 1e6, -1e-4, 0.1]),
                min_size=1, max_size=40),
       st.lists(st.from_regex(r"-?[0-9]{1,20}(\.[0-9]{1,20})?", fullmatch=True) |
                st.from_regex(r" ?[+-]?[0-9]{0,3}[.eE]?[0-9]{0,3} ?", fullmatch=True), min_size=1, max_size=40))
def test_conversions_of_whole_columns_match_cel(doubles: list[float], texts: list[str]) -> None:
    """string() of doubles as Arrow and Python write them, int()/double() of text as Arrow parses it."""
    differential([{"set": {"x": "string(value.a)", "y": "string(-value.a)"}}],
                 [{"a": x} for x in doubles if math.isfinite(x)] or [{"a": 1.0}])
    differential([{"set": {"x": "double(value.b)"}}], [{"b": t} for t in texts])
    differential([{"set": {"y": "int(value.b)"}}], [{"b": t} for t in texts])


def test_the_differential_tests_compared_taken_records() -> None:
    """Runs after them (file order): most comparisons must not have been handed to the row path."""
    assert SEEN["taken"] >= 1000 and SEEN["filtered"] >= 100, SEEN


# --------------------------------------------------------------------------- what is sure
BENCH_STEPS = [
    {"filter": "value.kind != 'none'"},
    {"set": {"amount_cents": "int(value.amount * 100.0)", "label": "value.kind + '-' + string(value.user)",
             "bucket": "value.user % 16"}},
]


def test_the_bench_pipeline_is_evaluated_whole_on_clean_records() -> None:
    docs = [{"id": i, "user": i % 997, "kind": ["click", "view", "none"][i % 3], "amount": round(i % 10000 / 100, 2),
             "ts": 1764460800000 + i} for i in range(300)]
    settings_ = [TransformStep.model_validate(s) for s in BENCH_STEPS]
    t = compile_transforms(settings_, "w")
    keys = ["id", "user", "kind", "amount", "ts", "amount_cents", "label", "bucket"]
    bound = compile_columnar(settings_, t).bind(keys)
    records = [rec(d, i) for i, d in enumerate(docs)]
    decoded = bound.decode_lines(b"\n".join(r.value for r in records))
    rejected: set[int] = set()
    out, filtered = bound.apply(list(zip(*map(msgspec.structs.astuple, decoded), strict=True)),
                                BatchFields(records), rejected, len(records))
    assert rejected == set() and filtered == {"0-filter": list(range(2, 300, 3))}
    for i in (0, 1, 298):
        assert [out[j][i] for j in range(len(keys))] == [t.apply(records[i], docs[i]).get(k) for k in keys]


def test_records_the_evaluation_cannot_vouch_for_are_handed_back() -> None:
    steps = [{"filter": "value.n > 0"}, {"set": {"x": "value.n * 2", "y": "value.s + '!'"}}]
    docs = [{"n": 1, "s": "a"},                 # taken
            {"n": 0, "s": "a"},                 # filtered
            {"n": 2**62, "s": "a"},             # overflow: the row path's transform_error
            {"n": 1.5, "s": "a"},               # a double beside ints: the row path decides (an error here)
            {"s": "a"},                         # missing field: error
            {"n": 3, "s": None},                # null + string: error
            {"n": 4, "s": 5}]                   # wrong type
    rejected, filtered = differential(steps, docs)
    assert rejected == {2, 3, 4, 5, 6} and filtered == {"0-filter": [1]}


# --------------------------------------------------------------------------- refusals
def pipeline(transforms: list[dict[str, Any]], **columns: dict[str, Any]) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["t"], "transforms": transforms,
        "sink": {"table": "t", "conflict_key": ["id"], "columns": {"id": {"type": "bigint", "required": True},
                                                                   **columns}}})


@pytest.mark.parametrize(("transforms", "why"), [
    ([{"filter": "value.a > 0"}, {"flatten": {}}], "transforms[1] (1-flatten): the flatten step runs on the row path only"),
    ([{"timestamp": {"field": "ms", "format": "epoch_ms"}}], "transforms[0] (0-timestamp): the timestamp step"),
    ([{"set": {"n": "size(value.tags)"}, "name": "count"}],
     "transforms[0] (count): set.n: the function size() is not evaluated by the columnar tier"),
    ([{"filter": "true", "when": "key == b'x'"}], "transforms[0] (0-filter): when: the variable 'key'"),
    ([{"filter": "value.meta.src == 'web'"}], "transforms[0] (0-filter): filter: a field of a field"),
])
def test_a_step_outside_the_subset_refuses_the_tier_naming_it(transforms: list[dict[str, Any]], why: str) -> None:
    m = mapper_for(pipeline(transforms, n={"type": "bigint"}))
    assert isinstance(m, TransformingMapper)
    assert m.columnar_plan(None) is None
    assert why in (m.columnar_refusal(None) or "")


def test_a_subset_pipeline_has_a_plan_and_its_columns_refusal_is_the_mappers() -> None:
    m = mapper_for(pipeline([{"set": {"n": "value.a + 1"}}], n={"type": "bigint"}))
    assert m.columnar_refusal(None) is None and m.columnar_plan(None) is not None
    m = mapper_for(pipeline([{"set": {"n": "value.a + 1"}}], n={"type": "bigint", "source": "$.n.m"}))
    assert m.columnar_plan(None) is None and "column 'n' reads '$.n.m'" in (m.columnar_refusal(None) or "")


# --------------------------------------------------------------------------- the plan and the tier
PIPE = pipeline([{"filter": "value.kind != 'test'", "name": "no-test"}, {"rename": {"order": "id"}},
                 {"set": {"cents": "int(value.amount * 100.0)", "tag": "value.kind + ':' + string(partition)"}},
                 {"drop": ["kind"]}],
                cents={"type": "bigint", "required": True}, tag={"type": "text"}, kind={"type": "text"})


def _row_path(mapper: Any, records: list[Record]) -> tuple[dict, set[int], Counter[str]]:
    items, poison, dropped = [], set(), Counter()
    for r in records:
        try:
            row, _ = mapper.map(r)
            items.append(Item(r, row, None, 0, 1))
        except Filtered as exc:
            dropped[exc.step] += 1
        except InvalidRecord:
            poison.add(r.offset)
    _, groups = collapse(items, PIPE.collapse_rule())
    return {g[0].row[0]: g[0].row for g in groups}, poison, dropped


order_docs = st.fixed_dictionaries(
    {"order": st.integers(0, 6)},
    optional={"kind": st.sampled_from(["a", "b", "test", None, 3]),
              "amount": st.one_of(st.floats(-1e6, 1e6, width=32), st.integers(-5, 5), st.just("x"), st.just(1e300))})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(order_docs, min_size=1, max_size=20))
def test_the_plan_with_transforms_writes_and_filters_what_the_row_path_does(docs: list[dict[str, Any]]) -> None:
    mapper = mapper_for(PIPE)
    rule = PIPE.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index)
    assert plan is not None
    records = [rec(d, i) for i, d in enumerate(docs)]
    expected, poison, dropped = _row_path(mapper, records)
    built = plan.build(records)
    assert built is not None
    rejected = set(built.rejected)
    filtered = {i for positions in built.filtered.values() for i in positions}
    assert poison <= rejected and not filtered & rejected
    # the rejected records the row mapper filters count as filtered (the tier does so, below)
    again = Counter({label: len(p) for label, p in built.filtered.items()})
    rest = rejected - poison
    for i in sorted(rest):
        try:
            mapper.map(records[i])
        except Filtered as exc:
            again[exc.step] += 1
            rest.discard(i)
    assert again == dropped
    if rest:  # a rejected record maps after all: the tier writes this batch by rows
        return
    got = {row["id"]: tuple(row.values()) for row in built.table.to_pylist()}
    assert got == expected


def test_the_tier_counts_filtered_records_and_dead_letters_poison() -> None:
    mapper = mapper_for(PIPE)
    plan = mapper.columnar_plan(PIPE.collapse_rule().key_index)
    tier = ColumnarTier("p", plan, lambda table: table, lambda payload, **kw: None, mapper.map)
    docs = [{"order": 1, "kind": "a", "amount": 1.25}, {"order": 2, "kind": "test", "amount": 1.0},
            {"order": 3, "kind": None, "amount": 2.0},   # rejected: null + string; the row path fails it
            {"order": 4, "kind": "b", "amount": "x"},    # poison: a string times a double
            {"order": 5, "kind": "test", "amount": 2}]   # filtered (the filter is sure before the set fails)
    items = [Item(rec(d, i), None, None, 0, 10) for i, d in enumerate(docs)]
    planned = tier.build(items)
    assert planned is not None and planned.rows == 1
    assert planned.filtered == {"no-test": 2} and [i.record.offset for i in planned.filtered_items] == [1, 4]
    assert [(i.record.offset, f.error_class) for i, f in planned.poison] == [(2, "transform_error"),
                                                                              (3, "transform_error")]
    mapped, filtered, _ = tier.map_items(items)
    assert filtered == {"no-test": 2} and [i.record.offset for i in mapped] == [0, 2, 3]


class _Dlq:
    def __init__(self) -> None:
        self.entries: list = []

    def put(self, entries) -> None:
        self.entries.extend(entries)


def _writer_of(encode, columnar_write, rows: list, dlq: _Dlq, tokens: bool = False):
    import threading

    from ingest.config import RetrySettings
    from ingest.runner.writer import BatchWriter

    mapper = mapper_for(PIPE)
    plan = mapper.columnar_plan(PIPE.collapse_rule().key_index)
    tier = ColumnarTier("p", plan, encode, columnar_write, mapper.map)

    def write(batch, token=None) -> None:
        rows.append((list(batch), token))

    return BatchWriter(pipeline="p", write=write, dlq=dlq, retry=RetrySettings(max_attempts=2),
                       collapse_rule=PIPE.collapse_rule(), abort=threading.Event(), columnar=tier,
                       insert_tokens=tokens)


BATCH = [{"order": 1, "kind": "a", "amount": 1.25}, {"order": 2, "kind": "test", "amount": 1.0},
         {"order": 3, "kind": "b", "amount": "x"}, {"order": 4, "kind": "test"}, {"order": 5, "kind": "c", "amount": 2.5}]


@pytest.mark.parametrize("by", ["columns", "rows: not encoded", "rows: the columnar write failed"])
def test_a_batch_with_filtered_records_completes_whole_and_counts_them(by: str) -> None:
    """Filtered records are in the batch's offsets and its record count (the in-flight accounting), not
    in its rows, its DLQ entries or its insert token; counted per filter whichever way it is written."""
    from ingest.sinks.base import dedup_token

    columnar: list = []
    rows: list = []
    dlq = _Dlq()

    def encode(table):
        if by == "rows: not encoded":
            raise ValueError("refused")
        return table

    def columnar_write(payload, token=None) -> None:
        if by == "rows: the columnar write failed":
            raise RuntimeError("down")
        columnar.append((payload, token))

    writer = _writer_of(encode, columnar_write, rows, dlq, tokens=True)
    items = [Item(rec(d, i), None, None, 0, 10) for i, d in enumerate(BATCH)]
    done = writer.handle(0, items, "size")
    assert done.error is None
    assert done.records == 5 and done.filtered == {"no-test": 2}
    assert sorted(o for offsets in done.done.values() for o in offsets) == [0, 1, 2, 3, 4]
    assert [e.record.offset for e in dlq.entries] == [2] and done.rows_written == 2
    written = [t.to_pylist() for t, _ in columnar] if by == "columns" else [r for batch, _ in rows for r in batch]
    assert len(written) == (1 if by == "columns" else 2)
    token = columnar[0][1] if by == "columns" else rows[0][1]
    assert token == dedup_token("p", [items[0], items[4]])  # the records behind the rows, as the row path's


def test_the_run_counts_a_batchs_filtered_records_as_the_row_path_does() -> None:
    from ingest.metrics import Metrics
    from ingest.runner.stats import PipelineStats
    from ingest.runner.writer import Completion

    metrics = Metrics().pipeline("p")
    stats = PipelineStats(records_consumed=5, records_mapped=5)
    stats.count(Completion(lane=0, reason="size", records=5, rows_written=2, filtered=Counter({"no-test": 2})),
                metrics)
    assert stats.filtered == {"no-test": 2} and stats.records_mapped == 3
    assert metrics._m.records_filtered.labels("p", "no-test")._value.get() == 2
    assert metrics.records_done._value.get() == 3


CH_STEPS = [{"filter": "value.kind != 'test'", "name": "no-test"}, {"rename": {"order": "id"}},
            {"set": {"cents": "int(value.amount * 100.0)", "tag": "value.kind + ':' + string(offset)"}}]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(order_docs, min_size=1, max_size=20))
def test_a_clickhouse_plan_with_transforms_inserts_what_the_row_path_inserts(docs: list[dict[str, Any]]) -> None:
    """The ClickHouse tier (highest version of a key wins, the sink's Arrow conversion) with transforms."""
    from ingest.core.mapping import Mapper
    from ingest.sinks.clickhouse.arrow import ArrowEncoder, ColumnarConverter
    from ingest.sinks.clickhouse.settings import ClickHouseSinkSettings

    cfg = ClickHouseSinkSettings(kind="clickhouse", url="chdb://memory", database="d", table="t", order_by=["id"],
                                 columns={"id": {"type": "UInt64"}, "cents": {"type": "Int64"},
                                          "tag": {"type": "Nullable(String)"}, "kind": {"type": "Nullable(String)"}})
    steps = [TransformStep.model_validate(s) for s in CH_STEPS]
    mapper = TransformingMapper(Mapper(cfg.columns), compile_transforms(steps, "w"), columnar_steps=steps)
    rule = cfg.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None, mapper.columnar_refusal(rule.key_index, rule.version_index)
    types = list(cfg.ch_types.values())
    encoder = ArrowEncoder.for_columns(list(cfg.columns), types)
    records = [rec(d, i) for i, d in enumerate(docs)]
    items, poison = [], set()
    for r in records:
        try:
            items.append(Item(r, mapper.map(r)[0], None, 0, 1))
        except Filtered:
            pass
        except InvalidRecord:
            poison.add(r.offset)
    _, groups = collapse(items, rule)
    rows = [g[0].row for g in groups]
    built = plan.build(records)
    assert built is not None and poison <= set(built.rejected)
    if not set(built.rejected) <= poison:
        return  # some handed-back record maps after all: written by rows
    SEEN["clickhouse batches"] += 1
    got = ColumnarConverter(plan.columns, types, encoder.schema).convert(built.table).to_pylist()
    want = encoder.table(list(zip(*rows))).to_pylist() if rows else []
    assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])


def test_the_clickhouse_differential_compared_columnar_batches() -> None:
    """Runs after it (file order): not every batch was handed to the row path."""
    assert SEEN["clickhouse batches"] >= 30, SEEN

"""``explode``: arrays into child rows written atomically with their parent (issue #37 item 5).

Real PostgreSQL throughout; the end-to-end test adds the real broker and ``python -m ingest``
subprocesses killed with SIGKILL mid-run, at least once and exactly once. Ground truth is a model
of the latest good record of every order: at the end the ``orders`` and ``order_items`` tables
must equal it exactly -- no orphan child, no missing item, no stale item -- every poison record
must be in the DLQ with its step, and the group's offsets at the log end.
"""

from __future__ import annotations

import json
import random
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from pipeline_helpers import (
    assert_committed_at_log_end,
    dlq_rows,
    read_summary,
    wait_assigned,
    wait_until,
)

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.errors import PermanentError
from ingest.sinks.registry import backend as backend_for
from ingest.types import Record

pytestmark = pytest.mark.timeout(300)

PIPELINE = "orders"
ORDERS, ITEMS = "orders", "order items"  # a child table name that needs quoting


def explode_step(replace: bool = True, when: str | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {"explode": {
        "path": "items", "table": ITEMS, "conflict_key": ["order_id", "line_no"],
        "columns": {"order_id": {"type": "bigint"}, "line_no": {"type": "integer"},
                    "sku": {"type": "text", "required": True}, "qty": {"type": "integer", "required": True}},
        "parent": {"order_id": "value.id"}, "index_as": "line_no", "index_start": 1, "replace": replace},
        "name": "items"}
    if when is not None:
        step["when"] = when
    return step


def pipeline(dsn: str, **overrides: Any) -> dict[str, Any]:
    sink = {"kind": "postgres", "dsn": dsn, "table": ORDERS, "conflict_key": ["id"],
            "columns": {"id": {"type": "bigint"}, "total": {"type": "numeric(12,2)"},
                        "n_items": {"type": "integer"}},
            **overrides.pop("sink", {})}
    return {"name": PIPELINE, "topics": ["orders-topic"], "sink": sink,
            "transforms": overrides.pop("transforms", [{"set": {"n_items": "size(value.items)"}}, explode_step()]),
            **overrides}


def items_table(dsn: str) -> dict[int, list[tuple[int, str, int]]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = conn.execute(f'SELECT order_id, line_no, sku, qty FROM "{ITEMS}" ORDER BY 1, 2').fetchall()
    out: dict[int, list[tuple[int, str, int]]] = {}
    for order_id, line, sku, qty in got:
        out.setdefault(order_id, []).append((line, sku, qty))
    return out


def orders_table(dsn: str) -> dict[int, tuple[Decimal, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute(f"SELECT id, total, n_items FROM {ORDERS}").fetchall()}


# --------------------------------------------------------------------------- the sink, directly


class Writer:
    """The pipeline's mapper and PostgreSQL sink, without a broker: records in, one transaction out."""

    def __init__(self, settings: PipelineSettings) -> None:
        backend = backend_for(settings.sink.kind)
        backend.migrate(settings)
        self.mapper = mapper_for(settings)
        self.sink = backend.build(settings, lanes=1)

    def write(self, *records: tuple[int, int, dict[str, Any]]) -> None:
        """``(partition, offset, value)`` records mapped and written as one batch, collapsed by the
        parent key as the batch writer does (the last record of a key wins)."""
        rows = {v["id"]: self.mapper.map(Record("orders-topic", p, o, None, json.dumps(v).encode(), 0))[0]
                for p, o, v in records}
        self.sink.write(list(rows.values()))


def order(order_id: int, *items: tuple[str, int], total: str = "1.00") -> dict[str, Any]:
    return {"id": order_id, "total": total, "items": [{"sku": s, "qty": q} for s, q in items]}


def test_children_follow_the_latest_parent_in_one_transaction(pg_dsn: str) -> None:
    w = Writer(PipelineSettings.model_validate(pipeline(pg_dsn)))
    try:
        w.write((0, 1, order(1, ("a", 1), ("b", 2), ("c", 3))), (0, 2, order(2, ("x", 9))))
        assert items_table(pg_dsn) == {1: [(1, "a", 1), (2, "b", 2), (3, "c", 3)], 2: [(1, "x", 9)]}
        assert orders_table(pg_dsn) == {1: (Decimal("1.00"), 3), 2: (Decimal("1.00"), 1)}
        # An update removes an item and changes one: the stale child is deleted, the changed one updated.
        w.write((0, 3, order(1, ("a", 5), ("c", 3))))
        assert items_table(pg_dsn)[1] == [(1, "a", 5), (2, "c", 3)]
        # An empty array writes the parent and deletes its children; the other order keeps its own.
        w.write((0, 4, order(1)))
        assert items_table(pg_dsn) == {2: [(1, "x", 9)]}
        assert orders_table(pg_dsn)[1] == (Decimal("1.00"), 0)
        # A late writer of the same partition (an older offset) changes neither the parent nor its
        # children: it deletes none and adds none (its second item is a key the table lacks).
        w.write((0, 0, order(2, ("old", 1), ("older", 2))))
        assert items_table(pg_dsn) == {2: [(1, "x", 9)]}
        # Two records of one parent in a batch: the later one's children only.
        w.write((1, 10, order(3, ("p", 1), ("q", 1))), (1, 11, order(3, ("r", 7))))
        assert items_table(pg_dsn)[3] == [(1, "r", 7)]
    finally:
        w.sink.close()


def xmins(dsn: str) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Each order's and each item's ``xmin`` (the transaction that wrote its current version)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        orders = dict(conn.execute(f"SELECT id, xmin::text::bigint FROM {ORDERS}").fetchall())
        items = {(o, n): x for o, n, x in conn.execute(
            f'SELECT order_id, line_no, xmin::text::bigint FROM "{ITEMS}"').fetchall()}
    return orders, items


@pytest.mark.parametrize("skip_unchanged", [True, False])
def test_a_replayed_parent_keeps_its_children_and_gets_new_ones(pg_dsn: str, skip_unchanged: bool) -> None:
    """``sink.skip_unchanged``: a replayed batch (the same records at the same offsets) rewrites neither
    the parents nor the children (with the setting off, both are rewritten). A parent the upsert leaves
    unchanged still counts as applied: when the same record's children are not what the child table
    holds (a child column or explode step changed, a child table emptied), the replay writes them.
    A late writer still changes no child."""
    settings = pipeline(pg_dsn, sink={"skip_unchanged": skip_unchanged})
    w = Writer(PipelineSettings.model_validate(settings))
    batch = [(0, 1, order(1, ("a", 1), ("b", 2))), (0, 2, order(2, ("x", 9)))]
    want = {1: [(1, "a", 1), (2, "b", 2)], 2: [(1, "x", 9)]}
    try:
        w.write(*batch)
        before = xmins(pg_dsn)
        w.write(*batch)
        assert items_table(pg_dsn) == want
        orders, items = xmins(pg_dsn)
        if skip_unchanged:
            assert (orders, items) == before
        else:
            assert all(orders[k] != before[0][k] for k in orders) and all(items[k] != before[1][k] for k in items)
        # the child table emptied behind the parents (a new explode step would start so): a replay fills it
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'TRUNCATE "{ITEMS}"')
        w.write(*batch)
        assert items_table(pg_dsn) == want
        if skip_unchanged:
            assert xmins(pg_dsn)[0] == before[0]  # the parents were left as they were
        # a late writer (an older offset of the partition), its items different: no child changes
        w.write((0, 0, order(1, ("late", 5))))
        assert items_table(pg_dsn) == want
    finally:
        w.sink.close()
    # the same records, the step's children numbered from 0 now: the replaced children follow the
    # unchanged parents (stale ones deleted, new ones written)
    settings["transforms"][1]["explode"]["index_start"] = 0
    w = Writer(PipelineSettings.model_validate(settings))
    try:
        w.write(*batch)
        assert items_table(pg_dsn) == {1: [(0, "a", 1), (1, "b", 2)], 2: [(0, "x", 9)]}
        if skip_unchanged:
            assert xmins(pg_dsn)[0] == before[0]
    finally:
        w.sink.close()


def test_a_child_the_database_refuses_rolls_back_its_parent(pg_dsn: str) -> None:
    """The parent and its children are one transaction: a child row the database rejects (a CHECK
    constraint) leaves neither the new parent nor any of its children, and the error is the data's."""
    w = Writer(PipelineSettings.model_validate(pipeline(pg_dsn)))
    try:
        w.write((0, 1, order(1, ("a", 1))))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'ALTER TABLE "{ITEMS}" ADD CHECK (qty < 100)')
        with pytest.raises(PermanentError):
            w.write((0, 2, order(1, ("a", 2), ("b", 500), total="2.00")))
    finally:
        w.sink.close()
    assert items_table(pg_dsn) == {1: [(1, "a", 1)]}
    assert orders_table(pg_dsn) == {1: (Decimal("1.00"), 1)}


def test_replace_off_and_when_leave_other_children_alone(pg_dsn: str) -> None:
    """``replace: false`` only upserts; a step whose ``when`` does not hold leaves the parent's children."""
    w = Writer(PipelineSettings.model_validate(pipeline(pg_dsn, transforms=[
        {"set": {"n_items": "size(value.items)"}}, explode_step(replace=False, when="value.total != '0'")])))
    try:
        w.write((0, 1, order(1, ("a", 1), ("b", 2))))
        w.write((0, 2, order(1, ("z", 3))))
        assert items_table(pg_dsn)[1] == [(1, "z", 3), (2, "b", 2)]
    finally:
        w.sink.close()
    w = Writer(PipelineSettings.model_validate(pipeline(pg_dsn, transforms=[
        {"set": {"n_items": "size(value.items)"}}, explode_step(when="value.total != '0'")])))
    try:
        w.write((0, 3, order(1, total="0")))  # the step does not apply: children untouched
        assert items_table(pg_dsn)[1] == [(1, "z", 3), (2, "b", 2)]
        assert orders_table(pg_dsn)[1] == (Decimal("0.00"), 0)
        w.write((0, 4, order(1, ("y", 1))))
        assert items_table(pg_dsn)[1] == [(1, "y", 1)]
    finally:
        w.sink.close()


def test_replace_keeps_the_child_table_equal_to_the_latest_parent(pg_dsn: str) -> None:
    """Hypothesis: any sequence of orders (items added, changed, removed, emptied), cut into batches
    anywhere, leaves the child table equal to the latest order's items, on a real PostgreSQL."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    w = Writer(PipelineSettings.model_validate(pipeline(pg_dsn)))
    item = st.tuples(st.sampled_from("abcde"), st.integers(1, 9))
    updates = st.lists(st.tuples(st.integers(0, 4), st.lists(item, max_size=4), st.integers(1, 4)),
                       min_size=1, max_size=25)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(updates)
    def check(sequence: list[tuple[int, list[tuple[str, int]], int]]) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'TRUNCATE {ORDERS}, "{ITEMS}"')
        batch: list[tuple[int, int, dict[str, Any]]] = []
        latest: dict[int, list[tuple[int, str, int]]] = {}
        for offset, (order_id, items, cut) in enumerate(sequence):
            batch.append((0, offset, order(order_id, *items)))
            latest[order_id] = [(i + 1, sku, qty) for i, (sku, qty) in enumerate(items)]
            if cut == 1:
                w.write(*batch)
                batch = []
        if batch:
            w.write(*batch)
        assert items_table(pg_dsn) == {k: v for k, v in latest.items() if v}

    try:
        check()
    finally:
        w.sink.close()


# --------------------------------------------------------------------------- ClickHouse (chDB)


def ch_pipeline(url: str, **overrides: Any) -> dict[str, Any]:
    step = explode_step(**overrides)
    step["explode"]["columns"] = {"order_id": {"type": "Int64"}, "line_no": {"type": "Int32"},
                                  "sku": {"type": "String"}, "qty": {"type": "Int32"}}
    return {"name": PIPELINE, "topics": ["orders-topic"], "dlq": {"kind": "kafka", "topic": "orders-dlq"},
            "transforms": [{"set": {"n_items": "size(value.items)"}}, step],
            "sink": {"kind": "clickhouse", "url": url, "database": "shop", "table": ORDERS, "order_by": ["id"],
                     "columns": {"id": {"type": "Int64"}, "total": {"type": "Decimal(12, 2)"},
                                 "n_items": {"type": "Int32"}}}}


def ch_items(client: Any) -> dict[int, list[tuple[int, str, int]]]:
    out: dict[int, list[tuple[int, str, int]]] = {}
    for order_id, line, sku, qty in client.query(
            f"SELECT order_id, line_no, sku, qty FROM shop.`{ITEMS}` FINAL ORDER BY 1, 2").result_rows:
        out.setdefault(order_id, []).append((line, sku, qty))
    return out


def test_clickhouse_children_follow_the_latest_parent_marking_the_removed_ones(chdb: Any) -> None:
    w = Writer(PipelineSettings.model_validate(ch_pipeline(chdb.url)))
    client = chdb.client()
    try:
        w.write((0, 1, order(1, ("a", 1), ("b", 2), ("c", 3))), (0, 2, order(2, ("x", 9))))
        assert ch_items(client) == {1: [(1, "a", 1), (2, "b", 2), (3, "c", 3)], 2: [(1, "x", 9)]}
        w.write((0, 3, order(1, ("a", 5), ("c", 3))))  # one item removed, one changed
        assert ch_items(client)[1] == [(1, "a", 5), (2, "c", 3)]
        w.write((0, 4, order(1)))  # an empty array: every child of order 1 marked deleted
        assert ch_items(client) == {2: [(1, "x", 9)]}
        # a late writer (an older offset of the partition) adds and removes no child
        w.write((0, 0, order(2, ("old", 1), ("older", 2))))
        assert ch_items(client) == {2: [(1, "x", 9)]}
        assert client.query(f"SELECT id, n_items FROM shop.{ORDERS} FINAL ORDER BY id").result_rows == [(1, 0), (2, 1)]
        engine = client.query(f"SELECT engine_full FROM system.tables WHERE database = 'shop' AND name = '{ITEMS}'"
                              ).result_rows[0][0]
        assert "ReplacingMergeTree(_version, _ingest_deleted)" in engine
    finally:
        w.sink.close()
        chdb.close()


# --------------------------------------------------------------------------- end to end, with kills


def stream(seed: int, n_orders: int, n_records: int) -> list[dict[str, Any]]:
    """Orders updated many times, items added, changed and removed; some records are poison (an
    element with a quantity that is not a number, or a missing array)."""
    rng = random.Random(seed)
    out = []
    for seq in range(n_records):
        order_id = rng.randrange(n_orders)
        items = [{"sku": f"s{rng.randrange(50)}", "qty": rng.randrange(1, 9)} for _ in range(rng.randrange(0, 5))]
        doc: dict[str, Any] = {"id": order_id, "total": f"{rng.randrange(10_000)}.{rng.randrange(100):02d}",
                               "items": items, "seq": seq}
        if rng.random() < 0.01 and items:
            items[-1]["qty"] = "lots"  # poison element: the whole record goes to the DLQ
        elif rng.random() < 0.005:
            del doc["items"]  # poison: no array (would otherwise delete every child)
        out.append(doc)
    return out


def is_poison(doc: dict[str, Any]) -> bool:
    return "items" not in doc or any(not isinstance(i["qty"], int) for i in doc["items"])


def model(docs: list[dict[str, Any]]) -> tuple[dict[int, tuple[Decimal, int]], dict[int, list[tuple[int, str, int]]]]:
    """The latest good record of every order (records of one order share a partition: log order)."""
    orders, items = {}, {}
    for doc in docs:
        if is_poison(doc):
            continue
        orders[doc["id"]] = (Decimal(doc["total"]), len(doc["items"]))
        items[doc["id"]] = [(i + 1, it["sku"], it["qty"]) for i, it in enumerate(doc["items"])]
    return orders, {k: v for k, v in items.items() if v}


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_orders_and_items_equal_the_latest_orders_after_sigkills(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                  tmp_path: Path, delivery: str) -> None:
    rng = random.Random(f"explode-{delivery}")
    topic = new_topic(4)
    docs = stream(rng.randrange(2**32), n_orders=400, n_records=12_000)
    cfg = {"kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
           "pipelines": [pipeline(pg_dsn, topics=[topic], group_id=group_id, lanes=2, commit_interval_ms=200,
                                  shutdown_timeout_s=10, batch={"max_rows": 200, "max_latency_ms": 100},
                                  sink={"delivery": delivery})]}
    config = write_config(tmp_path, cfg)
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    messages = [(str(d["id"]).encode(), json.dumps(d).encode()) for d in docs]
    half = len(messages) // 3
    assert produce(kafka_bootstrap, topic, messages[:half]) == half
    for kill in range(2):
        proc = start_ingest(["run", "--config", config, "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc, timeout_s=90)
        before = len(orders_table(pg_dsn))
        wait_until(lambda b=before: len(orders_table(pg_dsn)) > b or kill > 0, 60, what="rows written", proc=proc)
        if kill == 0:
            assert produce(kafka_bootstrap, topic, messages[half:2 * half]) == half
        time.sleep(rng.uniform(0.5, 2.0))
        assert proc.poll() is None, proc.describe()
        proc.kill9()
        assert proc.returncode == -signal.SIGKILL
    rest = messages[2 * half:]
    assert produce(kafka_bootstrap, topic, rest) == len(rest)
    summary = tmp_path / "summary.json"
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0",
                      "--summary-json", summary], timeout_s=180, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]

    want_orders, want_items = model(docs)
    assert orders_table(pg_dsn) == want_orders
    got_items = items_table(pg_dsn)
    assert got_items == want_items, {k: (got_items.get(k), want_items.get(k)) for k in
                                     set(got_items) ^ set(want_items) | {k for k in want_items
                                                                          if got_items.get(k) != want_items[k]}}
    poison = sorted(d["seq"] for d in docs if is_poison(d))
    dead = dlq_rows(pg_dsn)
    assert poison and sorted({json.loads(d["value"])["seq"] for d in dead}) == poison
    for d in dead:
        assert (d["stage"], d["error_class"]) == ("transform", "transform_error"), d
        # a missing array fails the set step that counts it first; a bad element fails the explode
        step = "transforms[0] (0-set): set.n_items" if "items" not in json.loads(d["value"]) else \
            "transforms[1] (items): explode element"
        assert d["error_message"].startswith(step), d["error_message"]
    assert sum(assert_committed_at_log_end(kafka_bootstrap, group_id, topic).values()) == len(docs)
    assert read_summary(summary)["pipelines"][PIPELINE]["records_consumed"] > 0


def test_clickhouse_orders_and_items_equal_the_latest_orders(kafka_bootstrap, pg_dsn, new_topic, group_id, chdb,
                                                            tmp_path: Path) -> None:
    """The same stream through ``python -m ingest`` into chDB: each table ``FINAL`` equals the model."""
    topic = new_topic(3)
    docs = stream(7, n_orders=150, n_records=3_000)
    pipe = ch_pipeline(chdb.url) | {"topics": [topic], "group_id": group_id, "lanes": 2, "commit_interval_ms": 200,
                                    "batch": {"max_rows": 100, "max_latency_ms": 100},
                                    "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)}, "pipelines": [pipe]})
    assert produce(kafka_bootstrap, topic, [(str(d["id"]).encode(), json.dumps(d).encode()) for d in docs]) == len(docs)
    chdb.close()  # the ingest subprocess owns the chDB path while it runs
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0"], timeout_s=180,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    want_orders, want_items = model(docs)
    client = chdb.client()
    try:
        got_orders = {r[0]: (r[1], r[2]) for r in client.query(
            f"SELECT id, total, n_items FROM shop.{ORDERS} FINAL").result_rows}
        got_items = ch_items(client)
    finally:
        chdb.close()
    assert got_orders == want_orders
    assert got_items == want_items
    assert sorted({json.loads(d["value"])["seq"] for d in dlq_rows(pg_dsn)}) == sorted(
        d["seq"] for d in docs if is_poison(d))
    assert sum(assert_committed_at_log_end(kafka_bootstrap, group_id, topic).values()) == len(docs)


def test_check_migrate_and_replay_after_a_fix_write_parent_and_children_once(kafka_bootstrap, pg_dsn, new_topic,
                                                                             group_id, tmp_path: Path) -> None:
    """``check`` names the child table, ``migrate`` creates it; a record with an element missing a
    required field is dead-lettered whole; after the column gets a default, ``replay-dlq`` writes
    the order and all its items once (a second replay writes nothing)."""
    topic = new_topic(2)
    docs = [order(i, ("a", 1), ("b", 2)) for i in range(10)]
    for i in (3, 7):
        docs[i]["items"][1] = {"qty": 4}  # no sku
    kafka = {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)}
    broken = write_config(tmp_path, {"kafka": kafka, "pipelines": [pipeline(pg_dsn, topics=[topic], group_id=group_id)]})
    fixed_pipe = pipeline(pg_dsn, topics=[topic], group_id=group_id)
    fixed_pipe["transforms"][1]["explode"]["columns"]["sku"] = {"type": "text", "default": "unknown"}
    fixed = write_config(tmp_path, {"kafka": kafka, "pipelines": [fixed_pipe]}, name="fixed.yaml")

    res = run_ingest(["migrate", "--config", broken], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0 and f'table public.{ITEMS} (exploded from items)' in res.stdout, res.stdout
    res = run_ingest(["check", "--config", broken], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"child table public.{ITEMS} (explode items, replace)" in res.stdout
    assert "write tier: rows" in res.stdout
    produce(kafka_bootstrap, topic, [(str(d["id"]).encode(), json.dumps(d).encode()) for d in docs])
    res = run_ingest(["run", "--config", broken, "--until-idle", "3", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(orders_table(pg_dsn)) == set(range(10)) - {3, 7}
    assert [json.loads(d["value"])["id"] for d in sorted(dlq_rows(pg_dsn), key=lambda d: d["offset"])] in (
        [3, 7], [7, 3])
    assert set(items_table(pg_dsn)) == set(range(10)) - {3, 7}

    res = run_ingest(["replay-dlq", "--config", fixed, "--pipeline", PIPELINE], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0 and "replayed 2, still failing 0" in res.stdout, res.stdout + res.stderr
    want = {i: [(1, "a", 1), (2, "b", 2)] for i in range(10)} | {3: [(1, "a", 1), (2, "unknown", 4)],
                                                                 7: [(1, "a", 1), (2, "unknown", 4)]}
    assert items_table(pg_dsn) == want
    assert set(orders_table(pg_dsn)) == set(range(10))
    res = run_ingest(["replay-dlq", "--config", fixed, "--pipeline", PIPELINE], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0 and "replayed 0," in res.stdout, res.stdout
    assert items_table(pg_dsn) == want


def test_children_follow_a_parent_whose_key_the_database_rounds(pg_dsn: str) -> None:
    """A parent key of a rounding type (numeric(10,2) given 3 decimals, timestamptz(3) given µs): the
    parent the upsert applied is told by its source columns, not by its key coming back unchanged."""
    step = explode_step()
    step["explode"]["columns"]["order_id"] = {"type": "numeric(10,2)"}
    step["explode"]["conflict_key"] = ["order_id", "line_no"]
    settings = PipelineSettings.model_validate(pipeline(pg_dsn, transforms=[step], sink={
        "conflict_key": ["id", "at"], "columns": {"id": {"type": "numeric(10,2)"}, "at": {"type": "timestamptz(3)"},
                                                  "total": {"type": "numeric(12,2)"}}}))
    w = Writer(settings)
    try:
        rows = [w.mapper.map(Record("orders-topic", 0, 1, None, json.dumps(
            {"id": "12.345", "at": "2025-01-01T00:00:00.123456Z", "total": "1",
             "items": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}]}).encode(), 0))[0]]
        w.sink.write(rows)
    finally:
        w.sink.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        got = conn.execute(f'SELECT order_id::text, line_no, sku FROM "{ITEMS}" ORDER BY 2').fetchall()
    assert got == [("12.35", 1, "a"), ("12.35", 2, "b")]

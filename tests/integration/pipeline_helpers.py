"""Shared helpers for the real-service pipeline tests (``test_pipeline.py``).

Vocabulary: an *order record* is a Kafka message whose key is ``str(order_id)``
and whose value is a JSON object ``{order_id, status, seq, amount, updated_at}``.
``seq`` is unique per generated record (exact duplicates re-send the same
bytes), so the stored ``seq`` of a key tells exactly which record was written
last. Because the key decides the partition, every record of one key lands in
one partition, and "the last value of a key" is well defined.

Ground truth comes from the broker itself where it matters: :func:`read_topic`
reads every partition back from offset 0 to the true log end, so expected table
contents can be computed from what the log really holds (in partition order),
whichever thread produced what.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from harness import IngestProcess, run_ingest, write_config
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    log_end_offsets,
    produce,
    unique_name,
)

PIPELINE = "orders"
TABLE = "orders"
BASE_TS = datetime(2024, 1, 1, tzinfo=timezone.utc)

#: (status, seq, amount, updated_at) -- the non-key columns as they come back from PostgreSQL.
Row = tuple[str | None, int | None, Decimal | None, datetime | None]

# --------------------------------------------------------------------------- config


def order_columns(version_column: bool = False) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "order_id": {"type": "bigint", "source": "$.order_id", "required": True},
        "status": {"type": "text"},
        "seq": {"type": "bigint"},
        "amount": {"type": "numeric(12,2)"},
        "updated_at": {"type": "timestamptz"},
    }
    if version_column:
        cols["version"] = {"type": "bigint", "source": "@offset"}
    return cols


def pipeline_config(
    *,
    bootstrap: str,
    topic: str,
    group: str,
    dsn: str,
    lanes: int = 1,
    batch: Mapping[str, Any] | None = None,
    version_column: bool = False,
    shutdown_timeout_s: float = 10.0,
    retry: Mapping[str, Any] | None = None,
    key: str | None = None,
    **pipeline_extra: Any,
) -> dict[str, Any]:
    """The test config: one pipeline ``orders`` from ``topic`` into table ``orders``."""
    sink: dict[str, Any] = {
        "kind": "postgres",
        "dsn": dsn,
        "table": TABLE,
        "conflict_key": ["order_id"],
        "columns": order_columns(version_column),
    }
    if version_column:
        sink["version_column"] = "version"
    pipeline: dict[str, Any] = {
        "name": PIPELINE,
        "topics": [topic],
        "group_id": group,
        "lanes": lanes,
        "commit_interval_ms": 200,
        "shutdown_timeout_s": shutdown_timeout_s,
        "sink": sink,
    }
    if key is not None:
        pipeline["key"] = key
    if batch:
        pipeline["batch"] = dict(batch)
    if retry:
        pipeline["retry"] = dict(retry)
    pipeline.update(pipeline_extra)
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [pipeline],
    }


def write_and_migrate(tmp_path: Path, config: Mapping[str, Any]) -> Path:
    """Write the config and run ``ingest migrate`` (must exit 0). Returns the config path."""
    path = write_config(tmp_path, config)
    res = run_ingest(["migrate", "--config", path], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, f"ingest migrate failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return path


def run_args(config: Path, *, until_idle: float | None = None, summary: Path | None = None) -> list[Any]:
    args: list[Any] = ["run", "--config", config]
    if until_idle is not None:
        args += ["--until-idle", str(until_idle)]
    if summary is not None:
        args += ["--summary-json", summary]
    return args


def read_summary(path: Path) -> dict[str, Any]:
    """The whole ``--summary-json`` document; ``["pipelines"]["orders"]`` holds the counters."""
    return json.loads(Path(path).read_text())


def seed_for(name: str) -> int:
    """A random seed for one test (``INGEST_TEST_SEED`` replays one), printed so a failure can be replayed."""
    seed = int(os.environ.get("INGEST_TEST_SEED") or time.time_ns() % 2**31)
    print(f"{name}: seed {seed}")
    return seed


def assert_exit_ok(res: Any) -> None:
    """A finished ``ingest`` command exited 0 (else its output's tails in the failure)."""
    assert res.returncode == 0, f"ingest exited {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n" \
                                f"--- stderr ---\n{res.stderr[-6000:]}"


# --------------------------------------------------------------------------- records


def order_value(order_id: int, seq: int, rng: random.Random) -> bytes:
    status = rng.choice(("new", "paid", "shipped", "cancelled", "refunded", "ünïcødé ✓"))
    amount = round(rng.uniform(0, 99_999), 2)
    updated = (BASE_TS + timedelta(milliseconds=seq * 7 + rng.randint(0, 5))).isoformat()
    return orjson.dumps(
        {"order_id": order_id, "status": status, "seq": seq, "amount": amount, "updated_at": updated}
    )


def order_key(order_id: int) -> bytes:
    return str(order_id).encode()


class OrderGen:
    """Generates order records: new keys, updates of earlier keys and exact duplicates.

    Thread-safe. ``first_id`` lets several generators use disjoint key ranges.
    """

    def __init__(self, seed: int, *, update_frac: float = 0.2, dup_frac: float = 0.02,
                 first_id: int = 1, first_seq: int = 0) -> None:
        self.rng = random.Random(seed)
        self.update_frac = update_frac
        self.dup_frac = dup_frac
        self._next_id = first_id
        self._seq = first_seq
        self._ids: list[int] = []
        self._recent: list[tuple[bytes, bytes]] = []
        self._lock = threading.Lock()

    def next(self, n: int) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        with self._lock:
            rng = self.rng
            for _ in range(n):
                r = rng.random()
                if r < self.dup_frac and (out or self._recent):
                    # An exact duplicate (same key, same bytes): half the time the record just
                    # produced (lands in the same batch), else a random earlier record.
                    if out and rng.random() < 0.5:
                        out.append(out[-1])
                    else:
                        pool = self._recent if self._recent else out
                        out.append(pool[rng.randrange(len(pool))])
                    continue
                if r < self.dup_frac + self.update_frac and self._ids:
                    order_id = self._ids[rng.randrange(len(self._ids))]
                else:
                    order_id = self._next_id
                    self._next_id += 1
                    self._ids.append(order_id)
                self._seq += 1
                out.append((order_key(order_id), order_value(order_id, self._seq, rng)))
            self._recent.extend(out)
            if len(self._recent) > 50_000:
                del self._recent[: len(self._recent) - 50_000]
        return out


def row_of(value: bytes) -> tuple[int, Row]:
    """``(order_id, row)`` that a good order record maps to."""
    doc = orjson.loads(value)
    amount = doc.get("amount")
    updated = doc.get("updated_at")
    return doc["order_id"], (
        doc.get("status"),
        doc.get("seq"),
        None if amount is None else Decimal(repr(amount)).quantize(Decimal("0.01")),
        None if updated is None else datetime.fromisoformat(updated),
    )


def last_values(records: Iterable[tuple[bytes | None, bytes | None]]) -> dict[int, Row]:
    """Last row per order id, in the given (produce) order."""
    out: dict[int, Row] = {}
    for _key, value in records:
        assert value is not None
        order_id, row = row_of(value)
        out[order_id] = row
    return out


# --------------------------------------------------------------------------- the log


@dataclass(frozen=True, slots=True)
class Msg:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def read_topic(bootstrap: str, topic: str, *, timeout_s: float = 90.0) -> dict[int, list[Msg]]:
    """Every message of ``topic`` from offset 0 to the true log end, per partition, in offset order."""
    ends = log_end_offsets(bootstrap, topic)
    out: dict[int, list[Msg]] = {p: [] for p in ends}
    todo = {p for p, e in ends.items() if e > 0}
    if not todo:
        return out
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": unique_name("pipeline-readback"),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "error",
        "fetch.wait.max.ms": 100,
    })
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(todo)])
        deadline = time.monotonic() + timeout_s
        while todo:
            if time.monotonic() >= deadline:
                have = {p: len(out[p]) for p in todo}
                raise TimeoutError(f"read_topic({topic}): partitions {have} short of ends {ends}")
            for msg in consumer.consume(10_000, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(err)
                p = msg.partition()
                if msg.offset() < ends[p]:
                    out[p].append(Msg(p, msg.offset(), msg.key(), msg.value()))
                if msg.offset() + 1 >= ends[p]:
                    todo.discard(p)
    finally:
        consumer.close()
    for p, msgs in out.items():
        offsets = [m.offset for m in msgs]
        assert offsets == sorted(set(offsets)), f"partition {p}: offsets out of order or repeated"
        assert offsets[-1:] == ([ends[p] - 1] if ends[p] else []), f"partition {p}: did not reach log end {ends[p]}"
    return out


def expected_from_log(log: Mapping[int, list[Msg]], upto: Mapping[int, int] | None = None,
                      *, with_version: bool = False) -> dict[int, tuple]:
    """Last row per order id over the log (or over offsets ``< upto[p]`` per partition).

    Checks the test's premise on the way: one order id never spans two partitions.
    Records that are not good order records are ignored. With ``with_version`` each
    row also carries the offset of the record (the ``@offset`` version column).
    """
    out: dict[int, tuple] = {}
    home: dict[int, int] = {}
    for p, msgs in log.items():
        limit = None if upto is None else upto.get(p, 0)
        for m in msgs:
            if limit is not None and m.offset >= limit:
                break
            try:
                order_id, row = row_of(m.value)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - poison records
                continue
            if home.setdefault(order_id, p) != p:
                raise AssertionError(f"order {order_id} found in partitions {home[order_id]} and {p}")
            out[order_id] = (*row, m.offset) if with_version else row
    return out


def assert_committed_records_written(log: Mapping[int, list[Msg]], committed: Mapping[int, int],
                                     written: Mapping[int, tuple]) -> None:
    """Nothing committed that is not in the table, after a run that may have stopped mid-stream.

    For every order id whose records reach below its partition's committed offset, the table's
    row must be the row of its last record there *or of a later record of that key* (written
    but not committed when the run stopped). Compared by log position, not by ``seq``: the
    generator re-sends exact copies of earlier records, so a later offset may carry a lower seq.
    """
    last_below: dict[int, int] = {}  # order id -> offset of its last record below the commit
    later_rows: dict[int, list[tuple]] = {}  # order id -> rows from that record on
    for p, msgs in log.items():
        limit = committed.get(p, 0)
        for m in msgs:
            try:
                order_id, row = row_of(m.value)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - poison records
                continue
            if m.offset < limit:
                last_below[order_id] = m.offset
                later_rows[order_id] = [row]
            elif order_id in last_below:
                later_rows[order_id].append(row)
    for order_id, offset in last_below.items():
        got = written.get(order_id)
        assert got is not None and got in later_rows[order_id], (
            f"order {order_id}: committed past its record at offset {offset}, but the table holds {got}; "
            f"acceptable rows {later_rows[order_id]}")


def assert_committed_at_log_end(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """Committed offset == true log end for every non-empty partition (and nothing else committed)."""
    ends = log_end_offsets(bootstrap, topic)
    committed = committed_offsets(bootstrap, group, topic)
    want = {p: e for p, e in ends.items() if e > 0}
    assert committed == want, f"committed offsets {committed} != true log end {want} (all ends {ends})"
    return committed


# --------------------------------------------------------------------------- the database


def table_rows(dsn: str, *, with_version: bool = False) -> dict[int, tuple]:
    cols = "order_id, status, seq, amount, updated_at" + (", version" if with_version else "")
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT {cols} FROM {TABLE}").fetchall()  # noqa: S608 - fixed names
    out = {r[0]: tuple(r[1:]) for r in rows}
    assert len(out) == len(rows), "duplicate order ids in the table (primary key missing?)"
    return out


def count_rows(dsn: str, table: str = TABLE) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608


def max_seq(dsn: str) -> int:
    """The newest record (highest ``seq``) in the table; -1 when empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT coalesce(max(seq), -1) FROM {TABLE}").fetchone()[0]  # noqa: S608


def dlq_rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            'SELECT pipeline, topic, "partition", "offset", key, value, stage, error_class, error_message, '
            "attempts, status FROM ingest_dlq ORDER BY \"partition\", \"offset\""
        )
        names = [d.name for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def diff_summary(actual: Mapping[int, tuple], expected: Mapping[int, tuple], limit: int = 8) -> str:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    wrong = sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k])
    lines = [f"table has {len(actual)} rows, expected {len(expected)}; "
             f"{len(missing)} missing, {len(extra)} unexpected, {len(wrong)} with a wrong value"]
    if missing:
        lines.append(f"  missing ids: {missing[:limit]}")
    if extra:
        lines.append(f"  unexpected ids: {extra[:limit]} e.g. {[actual[k] for k in extra[:3]]}")
    for k in wrong[:limit]:
        lines.append(f"  id {k}: table {actual[k]!r}, expected {expected[k]!r}")
    return "\n".join(lines)


def assert_table_equals(dsn: str, expected: Mapping[int, tuple], *, with_version: bool = False) -> None:
    actual = table_rows(dsn, with_version=with_version)
    if actual != expected:
        raise AssertionError(diff_summary(actual, expected))


# --------------------------------------------------------------------------- waiting


def wait_until(pred: Callable[[], Any], timeout_s: float, *, interval_s: float = 0.1,
               what: str = "condition", proc: IngestProcess | None = None) -> Any:
    """Poll ``pred`` until truthy (returns its value). Fails with ``what`` on timeout, or at
    once when ``proc`` exits meanwhile (showing its output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ingest exited ({proc.returncode}) while waiting for {what}\n{proc.describe()}")
        if time.monotonic() >= deadline:
            extra = f"\n{proc.describe()}" if proc is not None else ""
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{extra}")
        time.sleep(interval_s)


def log_events(proc: IngestProcess) -> list[dict[str, Any]]:
    """The JSON log lines of ``proc``'s stderr (other lines are skipped)."""
    events = []
    for line in proc.output()[1].splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def assignments(proc: IngestProcess) -> list[list[str]]:
    return [e.get("partitions") or [] for e in log_events(proc) if e.get("event") == "partitions assigned"]


def wait_assigned(proc: IngestProcess, timeout_s: float = 60.0) -> list[str]:
    """Wait until ``proc`` logged an assignment of at least one partition; return it."""
    def assigned() -> list[str] | None:
        got = [a for a in assignments(proc) if a]
        return got[-1] if got else None

    return wait_until(assigned, timeout_s, interval_s=0.1, what="a partition assignment", proc=proc)


# --------------------------------------------------------------------------- producing in the background


class SteadyProducer(threading.Thread):
    """Produces ``chunk`` records from ``gen`` every ``interval_s`` until stopped (or ``limit``).

    Uses its own cached producer (``client.id``), so it never shares a flush
    with the test thread's ``produce`` calls.
    """

    def __init__(self, bootstrap: str, topic: str, gen: OrderGen, *, chunk: int = 200,
                 interval_s: float = 0.1, limit: int | None = None) -> None:
        super().__init__(name="steady-producer", daemon=True)
        self.bootstrap, self.topic, self.gen = bootstrap, topic, gen
        self.chunk, self.interval_s, self.limit = chunk, interval_s, limit
        self.produced = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                n = self.chunk if self.limit is None else min(self.chunk, self.limit - self.produced)
                if n <= 0:
                    return
                self.produced += produce(self.bootstrap, self.topic, self.gen.next(n),
                                         config={"client.id": "steady-producer"})
                self._stop_event.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc

    def finish(self, timeout_s: float = 60.0) -> int:
        """Stop, wait, re-raise a producer error; return how many records were produced."""
        self._stop_event.set()
        self.join(timeout_s)
        assert not self.is_alive(), "steady producer did not stop"
        if self.error is not None:
            raise self.error
        return self.produced


def run_pipeline_on_off(tmp_path: Path, bootstrap: str, topic: str, dlq_dsn: str, pipeline: dict[str, Any],
                        columnar: bool | None, top: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[tuple]]:
    """Run one pipeline (``pipeline``: its settings but ``name``-derived group, batch and ``columnar``)
    over ``topic`` until idle with ``columnar`` set (None: unset); assert it exited 0 and committed at
    the log end. Returns its summary stats and its PostgreSQL DLQ rows (partition, offset, stage,
    error class, message) in offset order. For the columnar tier's on/off differentials. ``top``:
    more top-level settings (``schema_registry``)."""
    name = pipeline["name"]
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap,
                  "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{**pipeline, "topics": [topic], "group_id": f"{name}-{topic}",
                       "batch": {"max_rows": 500, "max_latency_ms": 100}}],
        **(top or {}),
    }
    if columnar is not None:
        cfg["pipelines"][0]["columnar"] = columnar
    d = tmp_path / name
    d.mkdir()
    path = write_and_migrate(d, cfg)
    summary = d / "summary.json"
    res = run_ingest(["run", "--config", path, "--until-idle", "2", "--summary-json", summary], timeout_s=120,
                     log_dir=d)
    assert_exit_ok(res)
    assert_committed_at_log_end(bootstrap, f"{name}-{topic}", topic)
    with psycopg.connect(dlq_dsn) as conn:
        dlq = conn.execute(f'SELECT "partition", "offset", stage, error_class, error_message FROM "{name}_dlq" '
                           "ORDER BY 1, 2").fetchall()
    return read_summary(summary)["pipelines"][name], dlq


#: the ClickHouse database of the differentials' tables (:func:`registry_runs_on_off` with ``chdb``)
CH_DATABASE = "ingest_test"


def registry_runs_on_off(tmp_path: Path, bootstrap: str, topic: str, dsn: str, registry_url: str, *, fmt: str,
                         prefix: str, columns: dict[str, Any], delivery: str, lanes: int,
                         chdb: Any = None, sink: dict[str, Any] | None = None,
                         read: Callable[[Any, str], Any] | None = None, **pipeline: Any) -> list[tuple[dict, Any, list]]:
    """A registry format's (``fmt``) pipeline over ``topic`` into PostgreSQL, by rows and then with the
    columnar tier (the default), each into a table of its own named from ``prefix``: per run, its summary
    stats, its table's rows (``columns`` in that order, by ``id``; or what ``read(connection, table name)``
    returns) and its DLQ rows (as :func:`run_pipeline_on_off` gives them). ``sink``: more sink settings
    (``version_column``...); ``pipeline``: more pipeline settings (``envelope``, ``deletes``...).
    ``chdb`` (the ``chdb`` fixture's session): into ClickHouse instead (a table of :data:`CH_DATABASE`
    ordered by ``id``, at least once: ``delivery`` is not used), its rows read with FINAL, each value as
    ClickHouse's text of it and the ``_version`` last, once the run has ended (a run owns the chDB path
    while it runs); the DLQ stays in PostgreSQL (``dsn``)."""
    runs = []
    for name, columnar in ((f"{prefix}rows", False), (f"{prefix}cols", None)):  # None: on where it fits
        name += ("_eo" if delivery == "exactly_once" else "") + ("_l2" if lanes == 2 else "")
        target: dict[str, Any] = {"table": name, "columns": columns}
        if chdb is None:
            target.update(kind="postgres", dsn=dsn, conflict_key=["id"], delivery=delivery)
        else:
            target.update(kind="clickhouse", url=chdb.url, database=CH_DATABASE, order_by=["id"])
        stats, dlq = run_pipeline_on_off(tmp_path, bootstrap, topic, dsn, {
            "name": name, "lanes": lanes, "format": fmt, **pipeline, "sink": {**target, **(sink or {})},
            "dlq": {"kind": "postgres", "dsn": dsn, "table": f"{name}_dlq"},
        }, columnar, top={"schema_registry": {"url": registry_url}})
        if chdb is None:
            with psycopg.connect(dsn) as conn:
                rows = (read(conn, name) if read is not None
                        else conn.execute(f'SELECT {", ".join(columns)} FROM "{name}" ORDER BY id').fetchall())
        else:
            texts = ", ".join(f"toString({column})" for column in [*columns, "_version"])
            try:
                rows = chdb.client().query(f"SELECT {texts} FROM {CH_DATABASE}.{name} FINAL ORDER BY id").result_rows
            finally:
                chdb.close()
        runs.append((stats, rows, dlq))
    return runs


def columnar_stream(doc_of: Callable[[int], dict[str, Any]],
                    special: Callable[[int, dict[str, Any]], bytes | None] | None = None) -> list[tuple[bytes, bytes]]:
    """3000 records over 700 keys (updates) for the columnar tier's differentials: ``doc_of(i)`` (with
    ``id`` and ``n``, an integer column, and an epoch-millisecond ``ts``), except poison of three
    kinds (``n`` not a number, not JSON, ``n`` out of range), an ISO ``ts`` only the row mapper takes,
    and whatever ``special(i, doc)`` returns instead of the document."""
    out = []
    for i in range(3000):
        key = i % 700
        doc = doc_of(i)
        value = orjson.dumps(doc)
        if i % 97 == 5:
            value = b'{"id": ' + str(key).encode() + b', "n": "not a number"}'  # map poison
        elif i % 131 == 7:
            value = b"{broken"  # decode poison
        elif i % 151 == 9:
            value = orjson.dumps({**doc, "n": 2**40})  # out of range for the integer column: poison
        elif i % 1000 == 11:
            value = orjson.dumps({**doc, "ts": "2025-11-30T00:00:00Z"})  # ISO text: the row mapper's
        elif special is not None:
            value = special(i, doc) or value
        out.append((str(key).encode(), value))
    return out

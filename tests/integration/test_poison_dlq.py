"""Poison records end to end: classification, batch isolation, both DLQ backends, the DLQ guard,
``ingest replay-dlq`` and ``ingest dlq count|list|show`` -- real broker, real PostgreSQL,
``python -m ingest`` as a subprocess.

The sink table ``payments`` is created by ``ingest migrate`` and then given constraints the
config knows nothing about: ``CHECK (amount >= 0)`` and a foreign key to ``customers``; its
``code`` column is ``varchar(8)`` (config type). The stream mixes good records with every kind
of poison (see :data:`KINDS`); ground truth for "which record is where" is the topic itself,
read back from offset 0.

Random choices come from one seed per test (printed); ``INGEST_TEST_SEED`` replays one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from harness import IngestProcess, run_ingest, start_ingest, write_config
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    create_topic,
    delete_topics,
    log_end_offsets,
    unique_name,
)
from harness.services import temp_database
from pipeline_helpers import wait_until
from psycopg import conninfo, sql

# One worker runs the whole module (pytest-xdist --dist loadgroup): the ``poisoned`` run is module-scoped.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("poison_dlq")]

PIPELINE = "payments"
TABLE = "payments"
PARENT = "customers"
N_CUSTOMERS = 50
#: A password that must never show up in DLQ rows, CLI output or logs (trust auth ignores it).
SECRET = "Pw-n0t-in-the-DLQ-7731"

#: kind -> (stage, error_class, sqlstate) the DLQ must record.
KINDS: dict[str, tuple[str, str, str | None]] = {
    "bad_json": ("decode", "invalid_json", None),
    "empty_value": ("decode", "invalid_json", None),
    "non_utf8": ("decode", "invalid_utf8", None),
    "missing_field": ("map", "missing_field", None),
    "wrong_type": ("map", "wrong_type", None),
    "check_violation": ("write", "integrity_constraint_violation", "23514"),
    "too_long": ("write", "data_exception", "22001"),
    "fk_violation": ("write", "integrity_constraint_violation", "23503"),
}
WRITE_KINDS = {k for k, v in KINDS.items() if v[0] == "write"}
FK_BASE = 900_000  # customer ids the fk_violation records point to (no such parent at first)
POISON_ID_BASE = 5_000_000


def _seed(name: str) -> int:
    seed = int(os.environ.get("INGEST_TEST_SEED") or time.time_ns() % 2**31)
    print(f"{name}: seed {seed}")
    return seed


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, (f"{' '.join(map(str, res.args[2:]))} exited {res.returncode}\n"
                                 f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-6000:]}")


# --------------------------------------------------------------------------- the stream


@dataclass
class Stream:
    """Records to produce, and what each one must become."""

    records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    #: Kafka key -> poison kind
    poison: dict[bytes, str] = field(default_factory=dict)
    #: id -> row (amount, code, customer_id, note) for every record that must land
    good: dict[int, tuple] = field(default_factory=dict)
    #: id -> row for the write-stage poison records (land after the fix and a replay)
    fixable: dict[int, tuple] = field(default_factory=dict)


def _row(doc: dict[str, Any]) -> tuple:
    return (Decimal(repr(doc["amount"])).quantize(Decimal("0.01")), doc.get("code"), doc.get("customer_id"),
            doc.get("note"))


def good_record(i: int, rng: random.Random) -> tuple[bytes, bytes, dict]:
    doc = {
        "id": i,
        "amount": round(rng.uniform(0, 5000), 2),
        "code": f"c{i:06d}",
        "customer_id": rng.randint(1, N_CUSTOMERS),
        "note": rng.choice(["ok", "ünïcødé ✓", "quote ' and \" and \\ backslash", "tab\tnewline\n", ""]),
    }
    return str(i).encode(), json.dumps(doc, ensure_ascii=False).encode(), doc


def poison_record(kind: str, j: int) -> tuple[bytes, bytes, dict | None]:
    pid = POISON_ID_BASE + j
    doc: dict[str, Any] | None
    if kind == "bad_json":
        return b"", b'{"id": %d, "amount": 1.5, "code": ' % pid, None
    if kind == "empty_value":
        return b"", b"", None
    if kind == "non_utf8":
        return b"", b'{"id": %d, "amount": 1, "note": "\xff\xfe\xc3\x28"}' % pid, None
    if kind == "missing_field":
        doc = {"amount": 3.25, "code": "nokey", "customer_id": 1}
    elif kind == "wrong_type":
        doc = {"id": pid, "amount": {"value": 12}, "customer_id": 1}
    elif kind == "check_violation":
        doc = {"id": pid, "amount": -12.5, "code": "neg", "customer_id": 2, "note": "negative"}
    elif kind == "too_long":
        doc = {"id": pid, "amount": 7.75, "code": "WAY-TOO-LONG-CODE", "customer_id": 3, "note": "long"}
    elif kind == "fk_violation":
        doc = {"id": pid, "amount": 9.5, "code": "fk", "customer_id": FK_BASE + j, "note": "orphan"}
    else:  # pragma: no cover
        raise ValueError(kind)
    return b"", json.dumps(doc).encode(), doc


def make_stream(n: int, n_poison: int, seed: int) -> Stream:
    """``n`` records of which ``n_poison`` are poison, the kinds in equal shares, shuffled in."""
    rng = random.Random(seed)
    kinds = [list(KINDS)[j % len(KINDS)] for j in range(n_poison)]
    slots = set(rng.sample(range(n), n_poison))
    s = Stream()
    next_id = 1
    j = 0
    for pos in range(n):
        if pos in slots:
            kind = kinds[j]
            _, value, doc = poison_record(kind, j)
            key = f"poison-{j}-{kind}".encode()
            s.records.append((key, value, [("trace-id", f"poison-{j}".encode()), ("bin", b"\x00\xff")]))
            s.poison[key] = kind
            if kind in WRITE_KINDS:
                assert doc is not None
                s.fixable[doc["id"]] = _row(doc)
            j += 1
        else:
            key, value, doc = good_record(next_id, rng)
            s.records.append((key, value, [("trace-id", f"good-{next_id}".encode())]))
            s.good[next_id] = _row(doc)
            next_id += 1
    assert Counter(s.poison.values()) == Counter(kinds)
    return s


def produce_with_headers(bootstrap: str, topic: str, records: Iterable[tuple[bytes, bytes, list]],
                         partition: int | None = None) -> int:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    failed: list[str] = []
    count = 0

    def on_delivery(err, _msg) -> None:
        if err is not None:
            failed.append(str(err))

    for key, value, headers in records:
        kwargs: dict[str, Any] = {"key": key, "value": value, "headers": headers, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                producer.produce(topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        count += 1
        if count % 1000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0, "records not delivered"
    assert not failed, failed[:3]
    return count


@dataclass(frozen=True)
class Msg:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int | None = None


def read_log(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[Msg]:
    """Every message of ``topic`` from offset 0 to the true log end."""
    ends = log_end_offsets(bootstrap, topic)
    todo = {p for p, e in ends.items() if e > 0}
    out: list[Msg] = []
    if not todo:
        return out
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": unique_name("poison-readback"),
        "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "error",
        "fetch.wait.max.ms": 100,
    })
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(todo)])
        deadline = time.monotonic() + timeout_s
        while todo:
            assert time.monotonic() < deadline, f"read_log({topic}): partitions {todo} short of {ends}"
            for m in consumer.consume(10_000, 0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(m.error())
                p = m.partition()
                if m.offset() < ends[p]:
                    ts_type, ts = m.timestamp()
                    out.append(Msg(p, m.offset(), m.key(), m.value(), tuple(m.headers() or ()),
                                   ts if ts_type != TIMESTAMP_NOT_AVAILABLE else None))
                if m.offset() + 1 >= ends[p]:
                    todo.discard(p)
    finally:
        consumer.close()
    return sorted(out, key=lambda m: (m.partition, m.offset))


# --------------------------------------------------------------------------- config, database


def with_password(dsn: str, password: str) -> str:
    params = conninfo.conninfo_to_dict(dsn)
    params["password"] = password
    return conninfo.make_conninfo(**params)


def columns(code_type: str = "varchar(8)") -> dict[str, Any]:
    return {
        "id": {"type": "bigint", "source": "$.id", "required": True},
        "amount": {"type": "numeric(12,2)", "required": True},
        "code": {"type": code_type},
        "customer_id": {"type": "bigint"},
        "note": {"type": "text"},
    }


def make_config(*, bootstrap: str, topic: str, group: str, dsn: str, code_type: str = "varchar(8)",
                lanes: int = 2, batch: Mapping[str, Any] | None = None, dlq: Mapping[str, Any] | None = None,
                retry: Mapping[str, Any] | None = None, kafka_extra: Mapping[str, Any] | None = None,
                sink_extra: Mapping[str, Any] | None = None, **pipeline_extra: Any) -> dict[str, Any]:
    pipeline: dict[str, Any] = {
        "name": PIPELINE,
        "topics": [topic],
        "group_id": group,
        "lanes": lanes,
        "commit_interval_ms": 200,
        "shutdown_timeout_s": 15,
        "batch": dict(batch or {"max_rows": 500, "max_latency_ms": 200}),
        "sink": {"kind": "postgres", "dsn": dsn, "table": TABLE, "conflict_key": ["id"],
                 "columns": columns(code_type), **(sink_extra or {})},
    }
    if dlq:
        pipeline["dlq"] = dict(dlq)
    if retry:
        pipeline["retry"] = dict(retry)
    pipeline.update(pipeline_extra)
    return {"kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS), **(kafka_extra or {})},
            "pipelines": [pipeline]}


def migrate(tmp_path: Path, config: Mapping[str, Any], name: str = "ingest.yaml") -> Path:
    path = write_config(tmp_path, config, name)
    res = run_ingest(["migrate", "--config", path], timeout_s=60, log_dir=tmp_path)
    _ok(res)
    return path


def add_constraints(dsn: str) -> None:
    """What the config does not know about: a CHECK and a FOREIGN KEY to a parent table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {PARENT} (id bigint PRIMARY KEY, name text)")
        conn.execute(f"INSERT INTO {PARENT} SELECT g, 'customer ' || g FROM generate_series(1, %s) g",
                     (N_CUSTOMERS,))
        conn.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT payments_amount_nonneg CHECK (amount >= 0)")
        conn.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT payments_customer_fk "
                     f"FOREIGN KEY (customer_id) REFERENCES {PARENT} (id)")
        ctype = conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                             "WHERE attrelid = %s::regclass AND attname = 'code'", (TABLE,)).fetchone()[0]
        assert ctype == "character varying(8)"


def table_rows(dsn: str) -> dict[int, tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT id, amount, code, customer_id, note FROM {TABLE}").fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def count_rows(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]


def dlq_table(dsn: str) -> list[dict[str, Any]]:
    """Every column of every ingest_dlq row, by id."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("SELECT * FROM ingest_dlq ORDER BY id")
        names = [d.name for d in cur.description]
        out = []
        for r in cur.fetchall():
            row = dict(zip(names, r))
            for k in ("key", "value"):
                if row[k] is not None:
                    row[k] = bytes(row[k])
            out.append(row)
        return out


def dlq_headers(row: Mapping[str, Any]) -> list[tuple[str, bytes | None]]:
    raw = row["headers"]
    items = json.loads(raw) if isinstance(raw, str) else raw
    return [(k, None if v is None else base64.b64decode(v)) for k, v in items]


def assert_committed_at_log_end(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    ends = {p: e for p, e in log_end_offsets(bootstrap, topic).items() if e > 0}
    committed = committed_offsets(bootstrap, group, topic)
    assert committed == ends, f"committed {committed} != log end {ends}"
    return committed


def read_summary(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def log_events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def wait_assigned(proc: IngestProcess, timeout_s: float = 60) -> None:
    wait_until(lambda: any(e.get("event") == "partitions assigned" and e.get("partitions")
                           for e in log_events(proc.output()[1])),
               timeout_s, what="a partition assignment", proc=proc)


def cli(args: list[Any], tmp_path: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    res = run_ingest(args, timeout_s=timeout_s, log_dir=tmp_path)
    assert SECRET not in res.stdout and SECRET not in res.stderr, "the DSN password leaked into CLI output"
    return res


def replay(config: Path, tmp_path: Path, *extra: Any, timeout_s: float = 120) -> str:
    res = cli(["replay-dlq", "--config", config, "--pipeline", PIPELINE, *extra], tmp_path, timeout_s)
    _ok(res)
    return res.stdout.strip().splitlines()[-1]


def expected_dlq(log: list[Msg], stream: Stream) -> dict[tuple[int, int], tuple[str, Msg]]:
    """(partition, offset) -> (kind, message) of every poison record in the log."""
    out = {}
    for m in log:
        kind = stream.poison.get(m.key or b"")
        if kind is not None:
            out[(m.partition, m.offset)] = (kind, m)
    assert len(out) == len(stream.poison), "a poison record is missing from the log"
    return out


def check_dlq_entry(row: Mapping[str, Any], kind: str, msg: Msg, topic: str) -> None:
    stage, error_class, sqlstate = KINDS[kind]
    where = f"{kind} at {msg.partition}:{msg.offset}"
    assert row["pipeline"] == PIPELINE
    assert row["topic"] == topic
    assert (row["stage"], row["error_class"], row["sqlstate"]) == (stage, error_class, sqlstate), \
        f"{where}: DLQ says {row['stage']}/{row['error_class']}/{row['sqlstate']}: {row['error_message']}"
    assert row["key"] == msg.key, where
    assert row["value"] == msg.value, f"{where}: value bytes changed"
    assert dlq_headers(row) == list(msg.headers), f"{where}: headers changed"
    assert row["error_message"], where
    assert SECRET not in row["error_message"] and "postgresql://" not in row["error_message"]
    assert row["record_timestamp"] is not None
    if msg.timestamp_ms is not None:
        assert row["record_timestamp"] == datetime.fromtimestamp(msg.timestamp_ms / 1000, tz=timezone.utc), where
    assert row["first_failed_at"] <= row["last_failed_at"]


# --------------------------------------------------------------------------- 1. the 10k poison mix (shared run)


@dataclass
class Poisoned:
    bootstrap: str
    dsn: str
    topic: str
    group: str
    config: Path
    fixed_config: Path
    tmp: Path
    stream: Stream
    log: list[Msg]
    summary: dict[str, Any]
    stderr: str
    elapsed_s: float


N_RECORDS = 10_000
N_POISON = 100  # 1 %
MAX_ROWS = 500


@pytest.fixture(scope="module")
def poisoned(kafka_bootstrap: str, pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Poisoned]:
    """One ingest run over a 10k-record topic with 1 % poison of every kind, PostgreSQL DLQ."""
    tmp = tmp_path_factory.mktemp("poison-mix")
    seed = _seed("poison-mix")
    stream = make_stream(N_RECORDS, N_POISON, seed)
    topic = unique_name("poison-mix", max_len=60)
    group = unique_name("g-poison-mix", max_len=60)
    create_topic(kafka_bootstrap, topic, 6)
    try:
        with temp_database(pg_admin_dsn) as raw_dsn:
            dsn = with_password(raw_dsn, SECRET)
            base = dict(bootstrap=kafka_bootstrap, topic=topic, group=group, dsn=dsn,
                        batch={"max_rows": MAX_ROWS, "max_latency_ms": 200})
            config = migrate(tmp, make_config(**base))
            add_constraints(dsn)
            # The operator's fix for "too long" is a config change too: the mapper's stage table
            # and the sink column both come from the configured type.
            fixed_config = write_config(tmp, make_config(**{**base, "code_type": "varchar(32)"}), "fixed.yaml")
            assert produce_with_headers(kafka_bootstrap, topic, stream.records) == N_RECORDS
            summary_path = tmp / "summary.json"
            started = time.monotonic()
            res = cli(["run", "--config", config, "--until-idle", "3", "--summary-json", summary_path], tmp, 180)
            elapsed = time.monotonic() - started
            _ok(res)
            log = read_log(kafka_bootstrap, topic)
            yield Poisoned(kafka_bootstrap, dsn, topic, group, config, fixed_config, tmp, stream, log,
                           read_summary(summary_path), res.stderr, elapsed)
    finally:
        with contextlib.suppress(Exception):
            delete_topics(kafka_bootstrap, [topic])


def test_poison_mix_good_rows_land_and_exactly_the_poison_is_dead_lettered(poisoned: Poisoned) -> None:
    p = poisoned
    assert len(p.log) == N_RECORDS

    # Every good record landed, with its value; nothing else did.
    actual = table_rows(p.dsn)
    missing = sorted(set(p.stream.good) - set(actual))
    extra = sorted(set(actual) - set(p.stream.good))
    wrong = [i for i in set(actual) & set(p.stream.good) if actual[i] != p.stream.good[i]]
    assert not missing and not extra and not wrong, \
        f"{len(missing)} missing {missing[:5]}, {len(extra)} unexpected {extra[:5]}, {len(wrong)} wrong {wrong[:5]}"

    # Exactly the poison records are in the DLQ, each once, with stage, class, SQLSTATE and bytes.
    want = expected_dlq(p.log, p.stream)
    rows = dlq_table(p.dsn)
    got = {(r["partition"], r["offset"]): r for r in rows}
    assert len(got) == len(rows), "a record is in the DLQ twice"
    assert set(got) == set(want), (f"DLQ has {len(got)} entries, expected {len(want)}; "
                                   f"unexpected {sorted(set(got) - set(want))[:5]}, "
                                   f"missing {[(k, want[k][0]) for k in sorted(set(want) - set(got))][:5]}")
    for pos, (kind, msg) in want.items():
        check_dlq_entry(got[pos], kind, msg, p.topic)
        assert got[pos]["status"] == "pending"
        assert got[pos]["attempts"] == 1
        assert got[pos]["replays"] == 0

    # The summary agrees, by stage/class.
    stats = p.summary["pipelines"][PIPELINE]
    assert p.summary["errors"] == {}
    by_class = Counter()
    for kind in p.stream.poison.values():
        stage, error_class, _ = KINDS[kind]
        by_class[f"{stage}/{error_class}"] += 1
    assert stats["dead_lettered_by_class"] == dict(by_class)
    assert stats["dead_lettered"] == N_POISON
    assert stats["records_consumed"] == N_RECORDS
    assert stats["rows_written"] == len(p.stream.good)

    # Committed offsets reach the log end.
    assert_committed_at_log_end(p.bootstrap, p.group, p.topic)

    # The DLQ table is queryable by pipeline and time, and keyed by record.
    with psycopg.connect(p.dsn, autocommit=True) as conn:
        indexes = [r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'ingest_dlq'")]
    assert any("UNIQUE" in d and "(pipeline, topic, partition, \"offset\")" in d for d in indexes), indexes
    assert any("(pipeline, last_failed_at)" in d for d in indexes), indexes

    # Batch isolation, not row-by-row: one poison row costs at most 2*ceil(log2 n) extra calls.
    w = sum(1 for k in p.stream.poison.values() if k in WRITE_KINDS)
    depth = math.ceil(math.log2(MAX_ROWS))
    batches = stats["batches"]
    calls = stats["write_calls"]
    assert calls <= batches + 2 * w * depth, f"{calls} write calls for {batches} batches and {w} poison rows"
    assert calls < 3 * w * depth + batches
    assert calls < w * MAX_ROWS / 10, "looks like row-by-row fallback"
    assert stats["retries"] == 0
    assert SECRET not in p.stderr
    print(f"poison mix: {N_RECORDS} records, {N_POISON} poison ({w} write-stage), {batches} batches, "
          f"{calls} write calls (row-by-row would be ~{w * MAX_ROWS}), run {p.elapsed_s:.1f}s, "
          f"rate {stats['rate_per_s']}/s")


def test_dlq_cli_count_list_show(poisoned: Poisoned) -> None:
    p = poisoned
    base = ["--config", p.config, "--pipeline", PIPELINE]
    want = expected_dlq(p.log, p.stream)

    # count (json): by stage, class and status
    res = cli(["dlq", "count", *base, "--format", "json"], p.tmp)
    _ok(res)
    counted = {(d["stage"], d["error_class"], d["status"]): d["count"] for d in json.loads(res.stdout)}
    expect = Counter((KINDS[k][0], KINDS[k][1], "pending") for k, _ in want.values())
    assert counted == dict(expect)

    res = cli(["dlq", "count", *base, "--stage", "write", "--format", "json"], p.tmp)
    _ok(res)
    assert sum(d["count"] for d in json.loads(res.stdout)) == sum(1 for k, _ in want.values() if k in WRITE_KINDS)

    # count (table) prints a total
    res = cli(["dlq", "count", *base], p.tmp)
    _ok(res)
    assert "total" in res.stdout and str(N_POISON) in res.stdout

    # list (json): every entry, with provenance and the original bytes (base64 when not UTF-8)
    res = cli(["dlq", "list", *base, "--format", "json", "--limit", "1000"], p.tmp)
    _ok(res)
    listed = json.loads(res.stdout)
    assert len(listed) == N_POISON
    ids = [e["id"] for e in listed]
    assert ids == sorted(ids)
    for e in listed:
        kind, msg = want[(e["partition"], e["offset"])]
        assert (e["stage"], e["error_class"], e["sqlstate"]) == KINDS[kind]
        assert e["topic"] == p.topic and e["status"] == "pending" and e["attempts"] == 1
        value = e["value"]
        raw = base64.b64decode(value[len("base64:"):]) if value.startswith("base64:") else value.encode()
        assert raw == msg.value
        assert e["headers"]["trace-id"] == dict(msg.headers)["trace-id"].decode()

    # filters: --error-class, --stage, --limit, --offset-range
    res = cli(["dlq", "list", *base, "--format", "json", "--error-class", "data_exception"], p.tmp)
    _ok(res)
    assert {e["sqlstate"] for e in json.loads(res.stdout)} == {"22001"}
    assert len(json.loads(res.stdout)) == sum(1 for k, _ in want.values() if k == "too_long")
    res = cli(["dlq", "list", *base, "--format", "json", "--stage", "map", "--limit", "3"], p.tmp)
    _ok(res)
    assert [e["stage"] for e in json.loads(res.stdout)] == ["map"] * 3
    part, off = min(want)
    res = cli(["dlq", "list", *base, "--format", "json", "--offset-range", f"{part}:{off}-{off}"], p.tmp)
    _ok(res)
    assert [(e["partition"], e["offset"]) for e in json.loads(res.stdout)] == [(part, off)]

    res = cli(["dlq", "list", *base, "--format", "json", "--since", "2999-01-01T00:00:00Z"], p.tmp)
    _ok(res)
    assert json.loads(res.stdout) == []
    res = cli(["dlq", "list", *base, "--format", "json", "--until", "2999-01-01", "--limit", "1000"], p.tmp)
    _ok(res)
    assert len(json.loads(res.stdout)) == N_POISON

    # list (table)
    res = cli(["dlq", "list", *base, "--limit", "5"], p.tmp)
    _ok(res)
    assert "5 shown" in res.stdout

    # show: one entry in full, as JSON; a non-UTF-8 value comes back as base64 of the exact bytes
    bad = next(e for e in listed if e["error_class"] == "invalid_utf8")
    res = cli(["dlq", "show", str(bad["id"]), *base], p.tmp)
    _ok(res)
    shown = json.loads(res.stdout)
    kind, msg = want[(shown["partition"], shown["offset"])]
    assert kind == "non_utf8"
    assert shown["value"].startswith("base64:")
    assert base64.b64decode(shown["value"][len("base64:"):]) == msg.value
    assert shown["error_class"] == "invalid_utf8" and shown["stage"] == "decode"
    res = cli(["dlq", "show", "999999999", *base], p.tmp)
    assert res.returncode == 1 and "no DLQ entry" in res.stderr


def test_replay_after_fixing_the_cause(poisoned: Poisoned) -> None:
    """dry run, filters, the fix, replay, re-run, still-failing decode/map entries, the loop guard."""
    p = poisoned
    want = expected_dlq(p.log, p.stream)
    n_write = sum(1 for k, _ in want.values() if k in WRITE_KINDS)
    n_other = N_POISON - n_write

    # --dry-run changes nothing.
    before_dlq, before_rows = dlq_table(p.dsn), table_rows(p.dsn)
    line = replay(p.config, p.tmp, "--dry-run")
    assert "dry run" in line and f"{N_POISON} entries" in line
    assert dlq_table(p.dsn) == before_dlq
    assert table_rows(p.dsn) == before_rows

    # Before the fix a replay fails again: attempts and replays grow, nothing lands.
    line = replay(p.config, p.tmp, "--error-class", "data_exception", "--limit", "2")
    assert line.startswith("replayed 0, still failing 2"), line
    after = {r["id"]: r for r in dlq_table(p.dsn)}
    changed = [i for i, r in after.items() if r != next(b for b in before_dlq if b["id"] == i)]
    assert len(changed) == 2
    for i in changed:
        assert after[i]["error_class"] == "data_exception" and after[i]["sqlstate"] == "22001"
        assert (after[i]["attempts"], after[i]["replays"], after[i]["status"]) == (2, 1, "pending")
    assert table_rows(p.dsn) == before_rows

    # Fix the causes: drop the CHECK, widen the varchar (table and config), add the parents.
    with psycopg.connect(p.dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT payments_amount_nonneg")
        conn.execute(f"ALTER TABLE {TABLE} ALTER COLUMN code TYPE varchar(32)")
        conn.execute(f"INSERT INTO {PARENT} SELECT g, 'late customer' FROM generate_series(%s, %s) g",
                     (FK_BASE, FK_BASE + N_POISON))

    # --dry-run after the fix still changes nothing.
    snap = dlq_table(p.dsn)
    line = replay(p.fixed_config, p.tmp, "--dry-run")
    assert f"{N_POISON} entries" in line
    assert dlq_table(p.dsn) == snap

    # --error-class and --limit filter: exactly 3 check/fk entries, the lowest ids.
    line = replay(p.fixed_config, p.tmp, "--error-class", "integrity_constraint_violation", "--limit", "3")
    assert line.startswith("replayed 3, still failing 0"), line
    now = dlq_table(p.dsn)
    replayed = [r for r in now if r["status"] == "replayed"]
    icv = sorted(r["id"] for r in snap if r["error_class"] == "integrity_constraint_violation")
    assert sorted(r["id"] for r in replayed) == icv[:3]
    untouched = {r["id"]: r for r in snap if r["id"] not in icv[:3]}
    assert all(r == untouched[r["id"]] for r in now if r["id"] in untouched), "a filtered-out entry changed"

    # The rest: write-stage entries land; decode/map entries still fail.
    line = replay(p.fixed_config, p.tmp)
    assert line.startswith(f"replayed {n_write - 3}, still failing {n_other}"), line
    rows = table_rows(p.dsn)
    assert rows == {**p.stream.good, **p.stream.fixable}, "the table is not good rows + the replayed fixes"
    first = {(r["partition"], r["offset"]): r for r in dlq_table(p.dsn)}
    for pos, (kind, msg) in want.items():
        r = first[pos]
        assert r["key"] == msg.key and r["value"] == msg.value
        if kind in WRITE_KINDS:
            # one failed replay before the fix for two of them, then the one that landed
            replays = 2 if r["id"] in changed else 1
            assert r["status"] == "replayed" and r["replays"] == replays and r["replayed_at"] is not None, (kind, r)
        else:
            stage, error_class, _ = KINDS[kind]
            assert r["status"] == "pending", (kind, r)
            assert (r["attempts"], r["replays"]) == (2, 1), (kind, r)
            assert (r["stage"], r["error_class"]) == (stage, error_class)  # the same error again

    # Again: nothing new is replayed; the write-stage entries are not touched.
    line = replay(p.fixed_config, p.tmp)
    assert line.startswith(f"replayed 0, still failing {n_other}"), line
    second = {(r["partition"], r["offset"]): r for r in dlq_table(p.dsn)}
    for pos, (kind, _msg) in want.items():
        if kind in WRITE_KINDS:
            assert second[pos] == first[pos]
        else:
            assert (second[pos]["attempts"], second[pos]["replays"], second[pos]["status"]) == (3, 2, "pending")
    assert table_rows(p.dsn) == rows

    # The loop guard: the third failed replay (dlq.max_replays = 3) gives the entries up.
    line = replay(p.fixed_config, p.tmp)
    assert line.startswith(f"replayed 0, still failing {n_other} (gave up {n_other})"), line
    third = {(r["partition"], r["offset"]): r for r in dlq_table(p.dsn)}
    for pos, (kind, _msg) in want.items():
        if kind not in WRITE_KINDS:
            assert (third[pos]["replays"], third[pos]["status"]) == (3, "gave_up"), third[pos]
    line = replay(p.fixed_config, p.tmp)
    assert line.startswith("replayed 0, still failing 0"), line
    assert {(r["partition"], r["offset"]): r for r in dlq_table(p.dsn)} == third  # given-up entries are skipped
    res = cli(["dlq", "count", "--config", p.config, "--pipeline", PIPELINE, "--format", "json"], p.tmp)
    _ok(res)
    by_status = Counter()
    for d in json.loads(res.stdout):
        by_status[d["status"]] += d["count"]
    assert by_status == {"replayed": n_write, "gave_up": n_other}
    assert table_rows(p.dsn) == rows


# --------------------------------------------------------------------------- 2. statements per poisoned batch


def test_one_poison_row_costs_log_n_statements_on_a_real_table(pg_dsn: str, tmp_path: Path) -> None:
    """PostgresSink + write_isolating on a real table: one CHECK-violating row among 1024."""
    from ingest.core.isolation import write_isolating
    from ingest.sinks.postgres.settings import PostgresSinkSettings as PgSettings
    from ingest.sinks.postgres.sink import PostgresSink

    cfg = PgSettings(dsn=pg_dsn, table=TABLE, conflict_key=["id"], columns=columns())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, amount numeric(12,2) NOT NULL "
                     f"CHECK (amount >= 0), code varchar(8), customer_id bigint, note text, "
                     f"_ingest_stream bigint, _ingest_offset bigint)")
    sink = PostgresSink(cfg, pool_size=1)
    try:
        n = 1024
        rows = [(i, Decimal("1.00") if i != 700 else Decimal("-1.00"), f"c{i}", None, None, 1, i) for i in range(n)]
        calls = [0]

        def write(piece):
            calls[0] += 1
            sink.write([rows[i] for i in piece])

        poison = write_isolating(range(n), write)
        assert [i for i, _ in poison] == [700]
        assert poison[0][1].sqlstate == "23514"
        assert calls[0] == 1 + 2 * 10  # 21 round trips, not 1024
        # Successful writes are one COPY + one INSERT each: one good half per level.
        assert sink.statements == 2 * 10
        assert count_rows(pg_dsn) == n - 1
    finally:
        sink.close()


# --------------------------------------------------------------------------- 3. interrupted replay


def test_interrupted_replay_replays_each_record_once(pg_dsn: str, tmp_path: Path) -> None:
    """kill -9 a rate-limited replay of 5000 entries mid-way, run it again: each entry replayed
    exactly once (replays == 1), the table has every row. The entries are dead-lettered through
    the product's own PostgreSQL DLQ backend (as the pipeline would)."""
    from ingest.dlq.base import DlqEntry
    from ingest.dlq.postgres import PostgresDlq
    from ingest.types import Failure, Record

    dsn = with_password(pg_dsn, SECRET)
    topic = "payments-replay"
    config = migrate(tmp_path, make_config(bootstrap="127.0.0.1:1", topic=topic, group="unused", dsn=dsn))
    n = 5000
    rng = random.Random(_seed("interrupted-replay"))
    expected: dict[int, tuple] = {}
    entries = []
    for i in range(n):
        key, value, doc = good_record(10_000 + i, rng)
        expected[doc["id"]] = _row(doc)
        rec = Record(topic, i % 6, i // 6, key, value, 1_700_000_000_000 + i, (("h", b"v"),))
        entries.append(DlqEntry(PIPELINE, rec, Failure("write", "integrity_constraint_violation",
                                                       "violates check constraint", "23514")))
    dlq = PostgresDlq(dsn, "public", "ingest_dlq")
    try:
        for i in range(0, n, 1000):
            dlq.put(entries[i:i + 1000])
    finally:
        dlq.close()
    assert len(dlq_table(dsn)) == n

    def replayed_count() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM ingest_dlq WHERE status = 'replayed'").fetchone()[0]

    # 500-entry chunks at 1000/s: a chunk every 0.5 s, ~5 s for all.
    proc = start_ingest(["replay-dlq", "--config", config, "--pipeline", PIPELINE, "--rate", "1000"],
                        log_dir=tmp_path)
    wait_until(lambda: replayed_count() >= 1000, 60, what="a partial replay", proc=proc, interval_s=0.02)
    assert proc.kill9() == -signal.SIGKILL
    at_kill = replayed_count()
    assert 1000 <= at_kill < n, f"{at_kill} of {n} replayed at the kill: not mid-way"
    # What is marked replayed is exactly what is in the table (mark and write share a transaction).
    with psycopg.connect(dsn, autocommit=True) as conn:
        marked = {r[0] for r in conn.execute(
            "SELECT (convert_from(value, 'UTF8')::jsonb->>'id')::bigint FROM ingest_dlq WHERE status = 'replayed'")}
    assert set(table_rows(dsn)) == marked

    line = replay(config, tmp_path)
    assert line.startswith(f"replayed {n - at_kill}, still failing 0"), line
    rows = dlq_table(dsn)
    assert len(rows) == n
    assert Counter((r["status"], r["replays"]) for r in rows) == {("replayed", 1): n}
    assert table_rows(dsn) == expected
    assert replay(config, tmp_path).startswith("replayed 0, still failing 0")
    print(f"interrupted replay: killed at {at_kill}/{n}, the re-run replayed {n - at_kill}")


# --------------------------------------------------------------------------- 4. the database down for 20 s


def test_database_down_20s_dead_letters_nothing(kafka_bootstrap, pg_dsn, pg_admin_dsn, new_topic, group_id,
                                                tmp_path) -> None:
    topic = new_topic(6)
    rng = random.Random(_seed("db-down"))
    first = [good_record(i, rng) for i in range(1, 40_001)]
    produce_with_headers(kafka_bootstrap, topic, [(k, v, []) for k, v, _ in first])
    config = migrate(tmp_path, make_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 500, "max_latency_ms": 100},
        retry={"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 2000},
    ))
    add_constraints(pg_dsn)
    dbname = conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    summary_path = tmp_path / "summary.json"
    proc = start_ingest(["run", "--config", config, "--until-idle", "5", "--summary-json", summary_path],
                        log_dir=tmp_path)
    blocked = False

    def set_allow(allow: bool) -> int:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(dbname), sql.SQL("true" if allow else "false")))
            if allow:
                return 0
            cur = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))
            return len(cur.fetchall())

    second = [good_record(i, rng) for i in range(40_001, 50_001)]
    try:
        wait_assigned(proc)
        wait_until(lambda: count_rows(pg_dsn) > 0, 60, what="rows being written", proc=proc)
        terminated = set_allow(False)
        blocked = True
        down_at = time.monotonic()
        # More records arrive while the database is down: they cannot be written now.
        produce_with_headers(kafka_bootstrap, topic, [(k, v, []) for k, v, _ in second])
        while time.monotonic() - down_at < 20:
            assert proc.poll() is None, f"ingest exited while the database was down\n{proc.describe()}"
            time.sleep(0.5)
        set_allow(True)
        blocked = False
        up_at = time.monotonic()
        code = proc.wait(120)
        recovered_s = time.monotonic() - up_at
    finally:
        if blocked:
            set_allow(True)
    assert code == 0, proc.describe()
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["dead_lettered"] == 0
    assert stats["retries"] > 0, stats
    assert dlq_table(pg_dsn) == []
    expected = {doc["id"]: _row(doc) for _, _, doc in first + second}
    assert table_rows(pg_dsn) == expected
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    print(f"db down: terminated {terminated} backends, {stats['retries']} retries, done "
          f"{recovered_s:.1f}s after the database came back (incl. --until-idle 5)")


# --------------------------------------------------------------------------- 5. the DLQ guard


def test_dlq_guard_stops_a_pipeline_whose_every_record_fails(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                             tmp_path) -> None:
    """Every record is bad JSON, ``dlq.max_consecutive: 50``: exit 1 with a clear message, nothing
    committed past a record that is not in the DLQ, and the topic not emptied into the DLQ. Then a
    run with the guard off dead-letters the rest: a record dead-lettered twice (its offset was not
    committed) is still one DLQ entry."""
    topic = new_topic(3)
    n = 5000
    records = [(f"k{i}".encode(), b'{"id": %d, "amount": ' % i, []) for i in range(n)]  # all bad JSON
    produce_with_headers(kafka_bootstrap, topic, records)
    base = dict(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=1,
                batch={"max_rows": 20, "max_latency_ms": 100})
    config = migrate(tmp_path, make_config(**base, dlq={"max_consecutive": 50, "max_ratio": None}))
    summary_path = tmp_path / "summary.json"
    res = run_ingest(["run", "--config", config, "--until-idle", "10", "--summary-json", summary_path],
                     timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 1, f"exit {res.returncode}\n{res.stderr[-4000:]}"
    assert "DLQ guard tripped" in res.stderr
    assert "consecutive records dead-lettered (dlq.max_consecutive=50)" in res.stderr

    rows = dlq_table(pg_dsn)
    assert rows, "nothing was dead-lettered"
    assert {(r["stage"], r["error_class"]) for r in rows} == {("decode", "invalid_json")}
    in_dlq: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        in_dlq[r["partition"]].add(r["offset"])
    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    for part, off in committed.items():
        # Every record below a committed offset is durably in the DLQ.
        assert set(range(off)) <= in_dlq[part], f"partition {part}: committed {off} past records not in the DLQ"
        assert off <= len(in_dlq[part])
    assert sum(committed.values()) < n
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["rows_written"] == 0
    first_run = {(r["partition"], r["offset"]) for r in rows}
    print(f"guard: stopped after {stats['dead_lettered']} counted dead-letters, {len(rows)} DLQ rows, "
          f"committed {sum(committed.values())} of {n}")

    # Guard off: the rest is dead-lettered; records dead-lettered again stay one entry each.
    off_config = write_config(tmp_path, make_config(**base, dlq={"max_consecutive": None, "max_ratio": None}),
                              "guard-off.yaml")
    _ok(run_ingest(["run", "--config", off_config, "--until-idle", "3"], timeout_s=120, log_dir=tmp_path))
    after = dlq_table(pg_dsn)
    positions = [(r["partition"], r["offset"]) for r in after]
    assert len(positions) == len(set(positions)) == n, "a record is in the DLQ twice (or missing)"
    for r in after:
        pos = (r["partition"], r["offset"])
        again = pos in first_run and r["offset"] >= committed.get(r["partition"], 0)
        assert r["attempts"] == (2 if again else 1), (pos, r["attempts"], again)
        assert r["last_failed_at"] >= r["first_failed_at"]
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)

    # The guard exists so that a bad deploy does not empty the topic into the DLQ.
    assert len(rows) < n / 2, (f"{len(rows)} of {n} records were dead-lettered by the run the guard stopped "
                               f"(it tripped after {stats['dead_lettered']}; committed {sum(committed.values())})")


# --------------------------------------------------------------------------- 6. the Kafka DLQ backend


def test_kafka_dlq_backend_poison_mix(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path) -> None:
    topic = new_topic(6)
    dlq_topic = new_topic(1)
    n, n_poison = 2000, 40
    stream = make_stream(n, n_poison, _seed("kafka-dlq"))
    config = migrate(tmp_path, make_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=with_password(pg_dsn, SECRET),
        dlq={"kind": "kafka", "topic": dlq_topic},
    ))
    add_constraints(pg_dsn)
    produce_with_headers(kafka_bootstrap, topic, stream.records)
    summary_path = tmp_path / "summary.json"
    res = cli(["run", "--config", config, "--until-idle", "3", "--summary-json", summary_path], tmp_path, 120)
    _ok(res)

    assert table_rows(pg_dsn) == stream.good
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    log = read_log(kafka_bootstrap, topic)
    want = expected_dlq(log, stream)
    dead = read_log(kafka_bootstrap, dlq_topic)
    assert len(dead) == n_poison, f"{len(dead)} records in the DLQ topic, expected {n_poison}"
    seen = set()
    for m in dead:
        h = dict(m.headers)
        pos = (int(h["ingest.partition"]), int(h["ingest.offset"]))
        assert pos not in seen, f"{pos} dead-lettered twice"
        seen.add(pos)
        kind, orig = want[pos]
        stage, error_class, sqlstate = KINDS[kind]
        assert m.key == orig.key, kind
        assert (m.value or b"") == (orig.value or b"") and (m.value is None) == (orig.value is None), kind
        assert h["ingest.topic"] == topic.encode()
        assert h["ingest.pipeline"] == PIPELINE.encode()
        assert h["ingest.stage"] == stage.encode()
        assert h["ingest.error_class"] == error_class.encode()
        assert h.get("ingest.sqlstate") == (sqlstate.encode() if sqlstate else None)
        assert h["ingest.error_message"] and SECRET.encode() not in h["ingest.error_message"]
        assert int(h["ingest.failed_at"]) > 0
        # the original headers come first, unchanged
        assert list(m.headers[: len(orig.headers)]) == list(orig.headers)
    assert seen == set(want)
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["dead_lettered"] == n_poison
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('ingest_dlq') IS NOT NULL").fetchone()[0]
        if exists:
            assert conn.execute("SELECT count(*) FROM ingest_dlq").fetchone()[0] == 0


# --------------------------------------------------------------------------- 7. the DLQ unreachable


@pytest.mark.parametrize("how", ["dropped", "locked"])
def test_dlq_unreachable_blocks_the_commit_then_completes(how, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                          tmp_path) -> None:
    topic = new_topic(3)
    rng = random.Random(_seed(f"dlq-unreachable-{how}"))
    config = migrate(tmp_path, make_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=1,
        batch={"max_rows": 200, "max_latency_ms": 100},
        retry={"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 1000},
    ))
    docs = {}
    next_id = 1

    def goods(k: int) -> list[tuple[bytes, bytes, list]]:
        nonlocal next_id
        out = []
        for _ in range(k):
            key, value, doc = good_record(next_id, rng)
            docs[next_id] = _row(doc)
            next_id += 1
            out.append((key, value, []))
        return out

    for part in range(3):
        produce_with_headers(kafka_bootstrap, topic, goods(300), partition=part)
    poison_part, poison_off = 1, 300
    produce_with_headers(kafka_bootstrap, topic, [(b"poison", b"{not json", [])], partition=poison_part)
    produce_with_headers(kafka_bootstrap, topic, goods(300), partition=poison_part)

    locker: psycopg.Connection | None = None
    if how == "dropped":
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE ingest_dlq")
    else:
        locker = psycopg.connect(pg_dsn)
        locker.execute("LOCK TABLE ingest_dlq IN ACCESS EXCLUSIVE MODE")  # held until rollback
    summary_path = tmp_path / "summary.json"
    proc = start_ingest(["run", "--config", config, "--until-idle", "3", "--summary-json", summary_path],
                        log_dir=tmp_path)
    try:
        wait_assigned(proc)
        wait_until(lambda: count_rows(pg_dsn) > 0, 60, what="rows being written", proc=proc)
        max_seen = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"ingest exited while the DLQ was unreachable\n{proc.describe()}"
            committed = committed_offsets(kafka_bootstrap, group_id, topic)
            max_seen = max(max_seen, committed.get(poison_part, 0))
            assert committed.get(poison_part, 0) <= poison_off, \
                f"committed {committed} past the poison record at {poison_part}:{poison_off}"
            time.sleep(0.5)
        if how == "dropped":
            retried = [e for e in log_events(proc.output()[1])
                       if e.get("event") == "transient failure, retrying" and e.get("what") == "dlq write"]
            assert retried, f"no DLQ write retries logged\n{proc.describe()}"
            _ok(run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path))
        else:
            assert locker is not None
            locker.rollback()
        code = proc.wait(90)
    finally:
        if locker is not None:
            locker.close()
    assert code == 0, proc.describe()
    rows = dlq_table(pg_dsn)
    assert [(r["partition"], r["offset"], r["stage"], r["value"]) for r in rows] == \
        [(poison_part, poison_off, "decode", b"{not json")]
    assert table_rows(pg_dsn) == docs
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    if how == "dropped":
        assert stats["retries"] > 0
    print(f"dlq {how}: committed on the poison partition stayed <= {max_seen} (poison at {poison_off}); "
          f"retries {stats['retries']}")

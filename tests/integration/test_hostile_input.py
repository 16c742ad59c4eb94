"""Hostile records through a real ``ingest run``: every one is written or dead-lettered with a reason.

The mapper's property tests (tests/unit/test_mapping.py) cover random input
exhaustively; this runs a fixed zoo of nasty records through the whole
pipeline (decode, map, COPY, upsert, isolation, DLQ) and a record larger than
``batch.max_bytes`` (written alone, never a loop).
"""

from __future__ import annotations

import orjson
import psycopg
from harness import run_ingest, write_config
from harness.kafka import committed_offsets, log_end_offsets, produce

BIG = "x" * 50_000

ZOO: list[tuple[bytes | None, bytes | None, str]] = [
    (b"1", orjson.dumps({"id": 1, "note": "fine"}), "ok"),
    (b"2", orjson.dumps({"id": 2, "note": BIG}), "ok"),                       # larger than max_bytes
    (b"3", b'{"id": 3, "note": "nul \\u0000 inside"}', "map"),               # PostgreSQL rejects NUL in text
    (b"4", b'{"id": 4, "note": "lone \\ud800 surrogate"}', "decode"),
    (b"5", b'{"id": 4e400, "note": "huge"}', "decode"),                       # orjson: number out of range
    (b"6", b'{"id": 123456789012345678901234567890}', "map"),                 # bigint overflow
    (b"7", b"[" * 2000 + b"]" * 2000, "decode"),                              # deep nesting
    (b"8", b'{"id": NaN}', "decode"),
    (b"9", b"\xff\xfe not utf-8", "decode"),
    (b"10", b"", "decode"),
    (b"11", None, "decode"),                                                  # tombstone
    (b"12", orjson.dumps({"id": 12, "note": "ok", "extra": {"deep": [1, 2, {"x": None}]}}), "ok"),
    (b"13", orjson.dumps({"id": 13, "note": "\u202e\u0301 combining ✓ 🦀"}), "ok"),
    (b"14", orjson.dumps({"id": 14, "note": "too long for the check constraint" * 3}), "write"),
    (None, orjson.dumps({"id": 15, "note": "no key"}), "ok"),
]


def test_hostile_records_are_written_or_dead_lettered(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=1)
    path = write_config(tmp_path, {
        "kafka": {"bootstrap_servers": kafka_bootstrap,
                  "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "zoo", "topics": [topic], "group_id": group_id,
            "batch": {"max_rows": 100, "max_bytes": 4096, "max_latency_ms": 100},
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "zoo", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "note": {"type": "text"}}},
        }],
    })
    assert run_ingest(["migrate", "-c", path], timeout_s=60).returncode == 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE zoo ADD CONSTRAINT short_or_big CHECK (length(note) < 60 OR length(note) > 1000)")
    produce(kafka_bootstrap, topic, [(k, v) for k, v, _ in ZOO])
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0",
                      "--summary-json", tmp_path / "s.json"], timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    with psycopg.connect(pg_dsn) as conn:
        ids = {r[0] for r in conn.execute("SELECT id FROM zoo")}
        big = conn.execute("SELECT length(note) FROM zoo WHERE id = 2").fetchone()[0]
        dlq = {r[0]: (r[1], r[2]) for r in conn.execute('SELECT "offset", stage, error_message FROM ingest_dlq')}
    expected_ok = {i + 1 for i, (_, _, fate) in enumerate(ZOO) if fate == "ok"}
    assert ids == expected_ok and big == len(BIG)
    for offset, (_, _, fate) in enumerate(ZOO):
        if fate == "ok":
            assert offset not in dlq
        else:
            stage, message = dlq[offset]
            assert stage == fate, (offset, stage, message)
            assert message
    summary = orjson.loads((tmp_path / "s.json").read_bytes())["pipelines"]["zoo"]
    assert summary["records_consumed"] == len(ZOO)
    # The fast path took every record but those the mapper found poison (the generic loop decided those).
    assert summary["records_mapped"] == len(ZOO)
    assert summary["fast_path_misses"] == sum(1 for _, _, fate in ZOO if fate in ("decode", "map"))
    assert summary["flushes"].get("bytes", 0) >= 1  # the big record forced a bytes flush, alone
    assert committed_offsets(kafka_bootstrap, group_id, topic) == log_end_offsets(kafka_bootstrap, topic)

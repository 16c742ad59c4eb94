"""Change data capture, acceptance: a Debezium stream of a busy source table, SIGKILLs while it is
ingested, and the sink table mirrors the source table exactly.

The source (:mod:`harness.cdc_source`): a simulated table ``items`` with random inserts, updates,
deletes and re-inserts of deleted keys (≥ 50k events over ``KEYS`` keys, keys reused after
deletion, a snapshot of ``SNAPSHOT`` rows first, about 1 % of the updates changing the primary
key, 0.5 % of the events short-lived rows inserted and deleted by the next event), encoded as
Debezium's PostgreSQL connector writes it with the JSON converter and ``schemas.enable=true``
(precise decimals as base64, MicroTimestamp), a tombstone after every delete, every event of one
key in one partition of 6 (the partition passed explicitly).

One case per sink: PostgreSQL with hard deletes, with soft deletes (``deleted_at``), hard deletes
in exactly-once mode, and ClickHouse (chDB, ``ReplacingMergeTree(lsn, _ingest_deleted)``). Each:

1. ``ingest migrate``; a head of the stream is produced, the rest streams in from a paced producer
   thread for as long as the kills last (so every run has work and a backlog piles up while ingest
   is down);
2. ``KILLS`` (≥ 5) times: start ``ingest run`` (lanes 4, small batches), wait for its assignment
   and for its committed offsets to move, then SIGKILL it -- every other time 0-0.2 s later, while
   it still drains the backlog that piled up while it was down, else 0.05-1.5 s later -- at a
   moment it has work in hand (records produced and not committed: the kill waits for that);
3. the rest of the stream is produced, one session timeout after the last kill (Tansu can still
   hand partitions to a member killed less than that ago) ``ingest run --until-idle 2`` drains
   it and must exit 0;
4. the sink equals the source's final state exactly, every column (``lsn`` included: the version
   of the row's last upsert); soft deletes: the rows with ``deleted_at IS NULL`` equal the source,
   and the rows with ``deleted_at`` set are exactly the keys that existed and are deleted now, each
   with the values it held before its delete and the delete's ``lsn`` (short-lived rows, inserted
   and deleted within one batch, included);
   ClickHouse: ``FINAL WHERE _ingest_deleted = 0`` equals the source, and ``FINAL`` alone hides
   every deleted key too; committed offsets equal the true log end; the DLQ is empty; the final
   run's summary counts no dead letters and some ``rows_deleted``.

What "no row appears or disappears twice" is checked by (PostgreSQL cases)
---------------------------------------------------------------------------
A run's summary (``rows_written``, ``rows_deleted``) exists only for runs that exit, not for the
ones SIGKILLed, and it counts rows *after* in-batch collapsing, so no sum of summaries can say
whether a change was applied twice. The database can: after ``migrate`` the test puts an
``AFTER INSERT OR UPDATE OR DELETE ... FOR EACH ROW`` trigger on the sink table that appends
``(op, id, lsn, live)`` of every row change to an audit table in the same transaction (a rolled
back batch leaves nothing there). So the audit holds exactly the row changes the database
committed, across every run, killed or not. Then, per key, with ``lsn`` the version of the
source's change that an audit entry wrote:

- every upsert entry is a version the source really emitted for that key;
- the versions a key is written with never go backwards (``lsn`` non-decreasing over the audit,
  across deletes: a stale upsert never resurrects a deleted row) -- every case;
- exactly-once: strictly increasing -- no version is written twice (no row appears twice, no
  re-read batch re-applies anything), and no version of a row is deleted twice (``DELETE`` entries
  per ``(id, lsn)`` at most one) -- together with the exact end state and the empty DLQ, which
  say the ``already_written`` skip logic dropped exactly what the database had;
- at-least-once: equal versions are allowed (a batch re-read after a kill is re-applied; the
  version guard lets a record equal to the row apply); the test prints how many re-applications
  the audit saw, which shows the audit does see replays (the exactly-once check is not vacuous).

Random choices (the stream, kill moments) come from one seed per test (printed);
``INGEST_TEST_SEED`` replays one. ``INGEST_TEST_CDC_EVENTS`` (default 50000) and
``INGEST_TEST_CDC_KILLS`` (default 5) size the cases.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.cdc_source import Row, SourceTable, produce_stream
from harness.kafka import committed_offsets, log_end_offsets
from pipeline_helpers import (
    assert_committed_at_log_end,
    assert_exit_ok,
    diff_summary,
    dlq_rows,
    read_summary,
    seed_for,
    wait_assigned,
    wait_until,
)

pytestmark = pytest.mark.timeout(420)

PIPELINE = "mirror"
TABLE = "items"
CH_DATABASE = "cdc_test"
PARTITIONS = 6
LANES = 4
EVENTS = int(os.environ.get("INGEST_TEST_CDC_EVENTS") or 50_000)
KILLS = int(os.environ.get("INGEST_TEST_CDC_KILLS") or 5)
KEYS = max(50, EVENTS // 12)
SNAPSHOT = KEYS // 4
#: A SIGKILLed member is replaced after about session timeout + join (Tansu): short, as the chaos runner.
CONSUMER_SETTINGS = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 200}
#: Share of the stream produced before the first run; the rest streams in while the kills go on.
HEAD_FRAC = 0.15
#: How long the paced rest of the stream lasts (about the time the kill cycles take).
STREAM_S = 4.0 * KILLS
#: Records held back from the paced producer, released ``RESERVE_SLICE`` at a time only when a run
#: has caught up with everything produced (a slow machine's kill cycles outlast ``STREAM_S``): so
#: every kill finds work in hand however long the cycles take.
RESERVE_SLICE = 300

#: ``replica_identity``: the source table's (``default``: a delete's before image holds the key only,
#: updates have none; ``full``: both carry the whole old row), alternated over the cases.
CASES = {
    "postgres-hard": {"sink": "postgres", "deletes": "hard", "delivery": "at_least_once",
                      "replica_identity": "default"},
    "postgres-soft": {"sink": "postgres", "deletes": "soft", "delivery": "at_least_once",
                      "replica_identity": "default"},
    "postgres-exactly-once": {"sink": "postgres", "deletes": "hard", "delivery": "exactly_once",
                              "replica_identity": "full"},
    "clickhouse": {"sink": "clickhouse", "deletes": "hard", "delivery": "at_least_once", "replica_identity": "full"},
}




# --------------------------------------------------------------------------- config


def pg_columns() -> dict[str, Any]:
    return {
        "id": {"type": "bigint", "required": True},
        "name": {"type": "text"},
        "price": {"type": "numeric(12,2)"},
        "qty": {"type": "integer"},
        "updated_at": {"type": "timestamptz"},
        "lsn": {"type": "bigint", "source": "@source.lsn"},
    }


def ch_columns() -> dict[str, Any]:
    return {
        "id": {"type": "Int64", "required": True},
        "name": {"type": "Nullable(String)"},
        "price": {"type": "Nullable(Decimal(12, 2))"},
        "qty": {"type": "Nullable(Int32)"},
        "updated_at": {"type": "Nullable(DateTime64(6, 'UTC'))"},
        "lsn": {"type": "UInt64", "source": "@source.lsn"},
    }


def mirror_config(case: dict[str, str], *, bootstrap: str, topic: str, group: str, pg_dsn: str,
                  chdb_url: str | None) -> dict[str, Any]:
    if case["sink"] == "postgres":
        sink: dict[str, Any] = {"kind": "postgres", "dsn": pg_dsn, "table": TABLE, "conflict_key": ["id"],
                                "version_column": "lsn", "delivery": case["delivery"], "columns": pg_columns()}
    else:
        sink = {"kind": "clickhouse", "url": chdb_url, "database": CH_DATABASE, "table": TABLE,
                "order_by": ["id"], "version_column": "lsn", "columns": ch_columns()}
    deletes: dict[str, Any] = {"mode": case["deletes"]}
    if case["deletes"] == "soft":
        deletes.update(soft_column="deleted_at", soft_column_type="timestamptz")
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": PIPELINE,
            "topics": [topic],
            "group_id": group,
            "envelope": "debezium",
            "deletes": deletes,
            "lanes": LANES,
            "commit_interval_ms": 200,
            "shutdown_timeout_s": 10,
            "batch": {"max_rows": 1000, "max_latency_ms": 100},
            "retry": {"max_attempts": 8, "initial_backoff_ms": 50, "max_backoff_ms": 1000},
            "sink": sink,
            "dlq": {"kind": "postgres", "dsn": pg_dsn},
        }],
    }


def run_args(config: Path, *, until_idle: float | None = None, summary: Path | None = None) -> list[Any]:
    args: list[Any] = ["run", "--config", config, "--metrics-port", "0"]
    if until_idle is not None:
        args += ["--until-idle", str(until_idle)]
    if summary is not None:
        args += ["--summary-json", summary]
    return args


# --------------------------------------------------------------------------- the audit (PostgreSQL)

AUDIT_SQL = """
CREATE TABLE items_audit (seq bigserial PRIMARY KEY, op text NOT NULL, id bigint NOT NULL, lsn bigint,
                          live boolean NOT NULL);
CREATE FUNCTION items_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    INSERT INTO items_audit (op, id, lsn, live) VALUES ('D', OLD.id, OLD.lsn, false);
    RETURN OLD;
  END IF;
  INSERT INTO items_audit (op, id, lsn, live)
  VALUES (left(TG_OP, 1), NEW.id, NEW.lsn, {live});
  RETURN NEW;
END $$;
CREATE TRIGGER items_audit AFTER INSERT OR UPDATE OR DELETE ON items FOR EACH ROW EXECUTE FUNCTION items_audit();
"""


def install_audit(dsn: str, soft: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AUDIT_SQL.replace("{live}", "NEW.deleted_at IS NULL" if soft else "true"))


def check_audit(dsn: str, history: dict[int, set[int]], *, exactly_once: bool, soft: bool) -> dict[str, int]:
    """The checks of the module docstring over the audit; returns counts for the report."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        entries = conn.execute("SELECT op, id, lsn, live FROM items_audit ORDER BY seq").fetchall()
    assert entries, "the audit trigger saw no row change at all"
    by_key: dict[int, list[tuple[str, int, bool]]] = defaultdict(list)
    for op, key_id, lsn, live in entries:
        by_key[key_id].append((op, lsn, live))
    problems: list[str] = []
    reapplied = 0
    deleted_twice = 0
    for key_id, changes in by_key.items():
        last_lsn = -1
        seen_deletes: Counter[int] = Counter()
        for op, lsn, live in changes:
            if op == "D" or (soft and not live):
                seen_deletes[lsn] += 1
                if not soft:
                    continue
            if live and lsn not in history.get(key_id, ()):
                problems.append(f"id {key_id}: written with lsn {lsn}, which the source never emitted for it")
            if lsn < last_lsn:
                problems.append(f"id {key_id}: went back from lsn {last_lsn} to {lsn} ({op})")
            elif lsn == last_lsn and live:
                reapplied += 1
                if exactly_once:
                    problems.append(f"id {key_id}: version lsn {lsn} written twice")
            last_lsn = max(last_lsn, lsn)
        twice = sum(1 for n in seen_deletes.values() if n > 1)
        deleted_twice += twice
        if twice and exactly_once:
            problems.append(f"id {key_id}: a version deleted twice: {dict(seen_deletes)}")
    assert not problems, f"{len(problems)} audit problems, e.g.:\n  " + "\n  ".join(problems[:10])
    ops = Counter(op for op, *_ in entries)
    return {"entries": len(entries), "inserts": ops["I"], "updates": ops["U"], "deletes": ops["D"],
            "reapplied": reapplied, "deleted_twice": deleted_twice}


# --------------------------------------------------------------------------- reading the sink


def _utc(dt: Any) -> Any:
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def pg_table(dsn: str, soft: bool) -> tuple[dict[int, Row], dict[int, Row]]:
    """(live rows, soft-deleted rows)."""
    cols = "id, name, price, qty, updated_at, lsn" + (", deleted_at" if soft else "")
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT {cols} FROM {TABLE}").fetchall()
    live: dict[int, Row] = {}
    deleted: dict[int, Row] = {}
    for r in rows:
        (deleted if soft and r[6] is not None else live)[r[0]] = Row(r[1], r[2], r[3], _utc(r[4]), r[5])
    assert len(live) + len(deleted) == len(rows), "duplicate ids in the sink table"
    return live, deleted


def ch_table(chdb: Any) -> tuple[dict[int, Row], int, int]:
    """(rows of ``FINAL WHERE _ingest_deleted = 0``, count of ``FINAL`` alone, rows stored before merging)."""
    client = chdb.client()
    try:
        t = f"{CH_DATABASE}.{TABLE}"
        result = client.query(f"SELECT id, name, price, qty, updated_at, lsn FROM {t} FINAL "
                              "WHERE _ingest_deleted = 0").result_rows
        final_count = client.command(f"SELECT count() FROM {t} FINAL")
        stored = client.command(f"SELECT count() FROM {t}")
    finally:
        chdb.close()  # the path must not stay open in this process
    live = {r[0]: Row(r[1], r[2], r[3], _utc(r[4]), r[5]) for r in result}
    assert len(live) == len(result), "FINAL returned one id twice"
    return live, int(final_count), int(stored)


# --------------------------------------------------------------------------- the stream


class PacedProducer(threading.Thread):
    """Produces ``records`` in chunks spread over ``duration_s`` (its own producer client)."""

    def __init__(self, bootstrap: str, topic: str, records: list, duration_s: float, chunk: int = 500) -> None:
        super().__init__(name="cdc-producer", daemon=True)
        self.bootstrap, self.topic, self.records = bootstrap, topic, records
        self.chunk = chunk
        self.interval_s = duration_s / max(1, len(records) / chunk)
        self.produced = 0
        self.error: BaseException | None = None
        self._hurry = threading.Event()

    def run(self) -> None:
        try:
            for start in range(0, len(self.records), self.chunk):
                self.produced += produce_stream(self.bootstrap, self.topic, self.records[start:start + self.chunk],
                                                config={"client.id": "cdc-paced"})
                self._hurry.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc

    def finish(self) -> int:
        """Produce whatever is left at once, wait, re-raise a producer error; return the count."""
        self._hurry.set()
        self.join(120)
        assert not self.is_alive(), "paced producer did not finish"
        if self.error is not None:
            raise self.error
        return self.produced


def committed_total(bootstrap: str, group: str, topic: str) -> int:
    return sum(committed_offsets(bootstrap, group, topic).values())


# --------------------------------------------------------------------------- the test


@pytest.mark.slow
@pytest.mark.parametrize("case_name", list(CASES))
def test_sink_mirrors_the_source_table_through_sigkills(case_name, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                        tmp_path, request) -> None:
    case = CASES[case_name]
    started = time.monotonic()
    seed = seed_for(f"cdc mirror {case_name}")
    rng = random.Random(seed)
    source = SourceTable(seed, keys=KEYS, partitions=PARTITIONS, delete_frac=0.2, schemas=True,
                         snapshot_keys=SNAPSHOT, replica_identity=case["replica_identity"])
    records = source.events(EVENTS)
    # Every version each key was upserted with (for the audit); the final state is source.rows.
    history = {k: {lsn for op, lsn in changes if op != "d"} for k, changes in source.history.items()}
    print(f"{case_name}: {source.describe()}; {len(records)} records")
    assert source.events_made >= EVENTS and source.counts["d"] > EVENTS // 10
    reinserted = sum(1 for changes in source.history.values()
                     if any(a[0] == "d" and b[0] == "c" for a, b in itertools.pairwise(changes)))
    assert source.deleted and reinserted > KEYS // 10, "keys must be deleted and re-inserted"

    topic = new_topic(PARTITIONS)
    chdb = request.getfixturevalue("chdb") if case["sink"] == "clickhouse" else None
    cfg = write_config(tmp_path, mirror_config(case, bootstrap=kafka_bootstrap, topic=topic, group=group_id,
                                               pg_dsn=pg_dsn, chdb_url=chdb.url if chdb else None))
    assert_exit_ok(run_ingest(["migrate", "--config", cfg], timeout_s=60, log_dir=tmp_path))
    postgres = case["sink"] == "postgres"
    soft = case["deletes"] == "soft"
    if postgres:
        install_audit(pg_dsn, soft)

    head = int(len(records) * HEAD_FRAC)
    reserve_from = len(records) - RESERVE_SLICE * KILLS
    produced = produce_stream(kafka_bootstrap, topic, records[:head])
    producer = PacedProducer(kafka_bootstrap, topic, records[head:reserve_from], STREAM_S)

    def uncommitted() -> int:
        """Records produced and not committed; when a run has caught up with a finished producer,
        the next slice of the reserve is produced (in order: the paced part is all out)."""
        nonlocal produced, reserve_from
        lag = (produced + producer.produced) - committed_total(kafka_bootstrap, group_id, topic)
        if lag <= 0 and not producer.is_alive() and reserve_from < len(records):
            produced += produce_stream(kafka_bootstrap, topic, records[reserve_from:reserve_from + RESERVE_SLICE])
            reserve_from += RESERVE_SLICE
        return lag

    kills: list[tuple[int, int]] = []  # (committed after the kill, uncommitted records just before it)
    last_kill = 0.0
    try:
        for i in range(KILLS):
            proc = start_ingest(run_args(cfg), log_dir=tmp_path)
            wait_assigned(proc, timeout_s=60)
            if not producer.is_alive() and producer.ident is None:
                producer.start()
            before = committed_total(kafka_bootstrap, group_id, topic)
            wait_until(lambda before=before: committed_total(kafka_bootstrap, group_id, topic) > before, 60,
                       interval_s=0.05, what=f"run {i + 1} committing progress", proc=proc)
            # Every other kill lands while the run still drains the backlog that piled up while
            # ingest was down (big batches in flight), the others at a random later moment.
            time.sleep(rng.uniform(0.0, 0.2) if i % 2 else rng.uniform(0.05, 1.5))
            # Kill while it has work in hand: records produced that are not committed yet.
            lag = wait_until(uncommitted, 30, interval_s=0.01, what=f"run {i + 1} having uncommitted records", proc=proc)
            proc.kill9()
            assert proc.returncode == -signal.SIGKILL
            last_kill = time.monotonic()
            kills.append((committed_total(kafka_bootstrap, group_id, topic), lag))
    finally:
        if producer.ident is None:
            producer.start()
        produced += producer.finish()
    produced += produce_stream(kafka_bootstrap, topic, records[reserve_from:])
    assert produced == len(records)
    assert len(kills) == KILLS >= 1
    kill_s = time.monotonic() - started

    time.sleep(max(0.0, last_kill + CONSUMER_SETTINGS["session.timeout.ms"] / 1000 + 0.5 - time.monotonic()))
    summary_path = tmp_path / "final-summary.json"
    res = run_ingest(run_args(cfg, until_idle=2, summary=summary_path), timeout_s=180, log_dir=tmp_path)
    assert_exit_ok(res)
    stats = read_summary(summary_path)["pipelines"][PIPELINE]

    # The sink is the source's final state, exactly.
    if postgres:
        live, soft_deleted = pg_table(pg_dsn, soft)
    else:
        live, final_count, stored = ch_table(chdb)
    if live != source.rows:
        raise AssertionError(diff_summary(live, source.rows))
    if soft:
        # Every key that existed and is deleted now: its row marked, with the values it held before
        # its delete and the delete's version (as applying the changes one by one leaves it).
        absent = source.deleted - soft_deleted.keys()
        assert soft_deleted.keys() == source.deleted, (
            f"soft-deleted rows: {len(soft_deleted)}, expected {len(source.deleted)} (every key that existed and "
            f"is deleted now); {len(absent)} deleted keys have no row at all, e.g. "
            + "; ".join(f"id {k}: source history {source.history[k]}" for k in sorted(absent)[:4])
            + f"; marked but live in the source: {sorted(soft_deleted.keys() - source.deleted)[:8]}")
        if soft_deleted != source.deleted_rows:
            raise AssertionError("soft-deleted rows: " + diff_summary(soft_deleted, source.deleted_rows))
    if not postgres:
        assert final_count == len(source.rows), f"FINAL shows {final_count} rows, {len(source.rows)} live ones"
    committed = assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert sum(committed.values()) == len(records)
    if case["delivery"] == "exactly_once":
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            stored_offsets = dict(conn.execute(
                'SELECT "partition", next_offset FROM ingest_offsets WHERE pipeline = %s AND topic = %s',
                (PIPELINE, topic)).fetchall())
        ends = {p: e for p, e in log_end_offsets(kafka_bootstrap, topic).items() if e > 0}
        assert stored_offsets == ends, f"ingest_offsets {stored_offsets} != log end {ends}"
    assert dlq_rows(pg_dsn) == []
    assert stats["dead_lettered"] == 0, stats
    # The final run re-reads at least the tail produced while the last run was down: deletes among it.
    fresh = stats["records_consumed"] - (stats.get("already_written") or 0)
    assert stats["rows_deleted"] > 0 or fresh < 1000, f"the final run wrote no delete: {stats}"
    audit = check_audit(pg_dsn, history, exactly_once=case["delivery"] == "exactly_once", soft=soft) \
        if postgres else None
    elapsed = time.monotonic() - started
    print(f"{case_name}: {len(kills)} SIGKILLs at (committed after, uncommitted before) {kills}; kill phase {kill_s:.1f}s; "
          f"final run read {stats['records_consumed']} records, {stats['rows_written']} rows written, "
          f"{stats['rows_deleted']} deleted, {stats.get('already_written')} already written; "
          + (f"audit {audit}; " if audit else f"chDB rows stored before merge {stored}; ")
          + f"total {elapsed:.1f}s")

"""Exactly-once delivery into PostgreSQL (issue 10): ``sink.delivery: exactly_once`` against the
real broker and PostgreSQL, with ``python -m ingest`` as a subprocess that is SIGKILLed and
restarted while it writes.

The sink is an *append-only* table (``on_conflict: none``, no key, plain INSERT): nothing in the
database can absorb a replayed record, so every record written twice shows up as a second row.
Each row carries the Kafka position of its record (``part`` = ``@partition``, ``off`` =
``@offset``) besides its payload (``id`` is unique per produced record), so the end state is
compared record by record with the topic itself, read back from offset 0:

- exactly_once: the table holds every record exactly once, ``ingest_offsets`` and the Kafka
  committed offsets equal the true log end -- after >= 10 SIGKILLs and a rebalance;
- at_least_once: the same kind of run leaves duplicates, which is why the exactly-once mode
  exists (idempotent upserts hide replays only for tables with a key);
- poison records in exactly-once mode land in the DLQ exactly once (``attempts == 1`` although
  a SIGKILL made ingest re-read them), the table holds exactly the good records (with both
  ``write_method``s: poison isolation runs several SAVEPOINT pieces in one transaction);
- the advisory Kafka commit catches up with the stored offsets after a crash between the two;
- a batch that exhausts its retries loses nothing, although later batches of its lane were
  queued behind it.

How a kill cycle works (:meth:`Scenario.kill_cycle`): start ``ingest run``, wait for its
partition assignment (with ``session.timeout.ms=6000`` a restart after a SIGKILL is assigned
after ~8-11 s, once the broker has expired the dead member), then stream a chunk of records
(~3 s, 25 records a time) and, once new rows reach the table, SIGKILL it 0.05-1.5 s later,
while the stream is still running. Every other kill (every kill in the at-least-once test)
then also waits for the next write to show up and kills right after it: the broker hands a
trickle out in bursts, so a purely random moment misses the window between a batch
transaction's commit and the offset commit about half the time. Small batches (100 ms / 1000
rows, 4 lanes) and a 200 ms commit interval keep transactions in flight. After each kill the test measures how many rows lie above the restart position (rows
an at-least-once restart writes again: the *exposed* rows) and, in exactly-once mode, checks
that the table has no duplicate and that the stored watermark of every partition is backed by
exactly that prefix of the partition in the table.

Random choices come from one seed per test (printed); ``INGEST_TEST_SEED`` replays one.
``INGEST_TEST_EO_KILLS`` (default 10) and ``INGEST_TEST_EO_RECORDS`` (default 100000) size the
big exactly-once test.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from harness import IngestProcess, run_ingest, start_ingest
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    log_end_offsets,
    produce,
)
from pipeline_helpers import (
    SteadyProducer,
    assert_exit_ok,
    assignments,
    count_rows,
    log_events,
    read_summary,
    read_topic,
    seed_for,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(300)

PIPELINE = "events"
TABLE = "events"
LANES = 4
KEYS = 5000
#: How long the chunk stream of one kill cycle lasts (the kill comes 0.05-1.5 s after new rows show up).
STREAM_SECONDS = 3.0




# --------------------------------------------------------------------------- config and records


def events_config(*, bootstrap: str, topic: str, group: str, dsn: str, delivery: str,
                  lanes: int = LANES, write_method: str = "copy", columnar: bool | None = None) -> dict[str, Any]:
    """One pipeline ``events`` into the append-only table ``events`` (no key, plain INSERT); ``columnar``:
    the pipeline's setting (None: unset, so the columnar tier writes it, as it fits)."""
    config = {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": PIPELINE,
            "topics": [topic],
            "group_id": group,
            "lanes": lanes,
            "commit_interval_ms": 200,
            "shutdown_timeout_s": 10,
            "batch": {"max_rows": 1000, "max_latency_ms": 100},
            "sink": {
                "kind": "postgres",
                "dsn": dsn,
                "table": TABLE,
                "on_conflict": "none",
                "delivery": delivery,
                "write_method": write_method,
                "columns": {
                    "id": {"type": "bigint", "source": "$.id", "required": True},
                    "k": {"type": "bigint", "source": "$.k"},
                    "payload": {"type": "text", "source": "$.payload"},
                    "part": {"type": "bigint", "source": "@partition"},
                    "off": {"type": "bigint", "source": "@offset"},
                },
            },
            "dlq": {"kind": "postgres"},
        }],
    }
    if columnar is not None:
        config["pipelines"][0]["columnar"] = columnar
    return config


def run_args(config: Path, *, until_idle: float | None = None, summary: Path | None = None) -> list[Any]:
    args: list[Any] = ["run", "--config", config, "--metrics-port", "0"]
    if until_idle is not None:
        args += ["--until-idle", str(until_idle)]
    if summary is not None:
        args += ["--summary-json", summary]
    return args


BAD_JSON = (b'{"id": 1, "k": ', b"not json", b'{"id": 2 "k": 3}', b"\x00\x01", b"[1, 2")


class EventGen:
    """Keyed events ``{id, k, payload}``: ``id`` counts up from 0 (unique per record), the Kafka key
    is ``str(k)`` with ``k = id % KEYS``. With ``poison_frac`` some records are poison instead:
    invalid JSON, or ``k = -1`` (violates the CHECK the poison test adds). Thread-safe."""

    def __init__(self, seed: int, *, poison_frac: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.poison_frac = poison_frac
        self._next_id = 0
        self._lock = threading.Lock()

    def next(self, n: int) -> list[tuple[bytes, bytes]]:
        out = []
        with self._lock:
            rng = self.rng
            for _ in range(n):
                i = self._next_id
                self._next_id += 1
                k = i % KEYS
                payload = f"event {i} " + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=rng.randint(20, 90)))
                if self.poison_frac and rng.random() < self.poison_frac:
                    if rng.random() < 0.5:
                        out.append((str(k).encode(), rng.choice(BAD_JSON)))
                    else:
                        out.append((str(k).encode(), orjson.dumps({"id": i, "k": -1, "payload": payload})))
                    continue
                out.append((str(k).encode(), orjson.dumps({"id": i, "k": k, "payload": payload})))
        return out


def classify_value(value: bytes | None) -> tuple[str, int | None]:
    """``("good", id)``, ``("check", id)`` or ``("bad_json", None)`` for a produced value."""
    try:
        doc = orjson.loads(value)  # type: ignore[arg-type]
    except (orjson.JSONDecodeError, TypeError):
        return "bad_json", None
    if not isinstance(doc, dict):
        return "bad_json", None
    return ("check" if doc["k"] < 0 else "good"), doc["id"]


# --------------------------------------------------------------------------- database reads


def table_positions(dsn: str) -> list[tuple[int, int, int]]:
    """Every row as ``(part, off, id)`` (duplicates kept)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(f"SELECT part, off, id FROM {TABLE}").fetchall()]  # noqa: S608


def stored_offsets(dsn: str, topic: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute('SELECT "partition", next_offset FROM ingest_offsets WHERE pipeline = %s AND topic = %s',
                            (PIPELINE, topic)).fetchall()
    return {p: off for p, off in rows}


def lane_offsets(dsn: str, topic: str) -> dict[tuple[int, int, int], int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute('SELECT "partition", lanes, lane, next_offset FROM ingest_lane_offsets '
                            "WHERE pipeline = %s AND topic = %s", (PIPELINE, topic)).fetchall()
    return {(p, lanes, lane): off for p, lanes, lane, off in rows}


def rows_at_or_above(dsn: str, marks: dict[int, int], partitions: int = 6) -> int:
    """Rows whose offset is >= the partition's mark (0 for a partition without one): what a
    consumer restarting from ``marks`` reads and writes again."""
    parts = list(range(partitions))
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            f"SELECT count(*) FROM {TABLE} e JOIN unnest(%s::bigint[], %s::bigint[]) AS w(p, o) "  # noqa: S608
            "ON e.part = w.p WHERE e.off >= w.o",
            (parts, [marks.get(p, 0) for p in parts]),
        ).fetchone()[0]


def prefix_violations(dsn: str, marks: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Partitions whose stored watermark W is not backed by exactly W distinct rows with off < W
    (every record of these tests' first scenarios is good, and offsets are contiguous)."""
    bad = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for p, w in marks.items():
            n = conn.execute(f"SELECT count(DISTINCT off) FROM {TABLE} WHERE part = %s AND off < %s",  # noqa: S608
                             (p, w)).fetchone()[0]
            if n != w:
                bad[p] = (w, n)
    return bad


def dlq_entries(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute('SELECT pipeline, topic, "partition", "offset", value, stage, error_class, sqlstate, '
                           'attempts, status FROM ingest_dlq ORDER BY "partition", "offset"')
        names = [d.name for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


# --------------------------------------------------------------------------- the kill scenario


@dataclass
class Kill:
    n: int
    rows: int  # rows in the table just before the kill
    produced: int  # records produced just before the kill
    streaming: bool  # the chunk stream was still running at the kill
    exposed: int  # rows above the restart position right after the kill
    after_s: float  # seconds from "new rows seen" to the kill
    aligned: bool  # killed right after a write was seen (else at a purely random moment)


@dataclass
class Scenario:
    """A topic, a config, a record generator and the kill/restart choreography."""

    bootstrap: str
    topic: str
    group: str
    dsn: str
    config: Path
    tmp_path: Path
    gen: EventGen
    rng: random.Random
    delivery: str
    total: int
    produced: int = 0
    kills: list[Kill] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    #: ``align(i)``: whether kill ``i`` (0-based) waits for a write (see :meth:`kill`)
    align: Callable[[int], bool] = lambda i: i % 2 == 0

    def produce_now(self, n: int) -> None:
        n = min(n, self.total - self.produced)
        if n > 0:
            self.produced += produce(self.bootstrap, self.topic, self.gen.next(n))

    def stream(self, n: int, seconds: float = STREAM_SECONDS) -> SteadyProducer:
        """Produce ``n`` records (capped at the total) evenly over ``seconds`` in the background."""
        n = max(0, min(n, self.total - self.produced))
        chunk = 25  # small and frequent: a continuous flow, so a kill always finds rows in flight
        stream = SteadyProducer(self.bootstrap, self.topic, self.gen, chunk=chunk,
                                interval_s=max(0.01, seconds * chunk / max(n, 1)), limit=n)
        stream.start()
        return stream

    def settle(self, stream: SteadyProducer, *, early: bool = False) -> None:
        """Wait for ``stream`` to produce all it was given (or stop it at once with ``early``)."""
        if early:
            self.produced += stream.finish()
            return
        stream.join(60)
        assert not stream.is_alive(), "chunk stream did not finish"
        if stream.error is not None:
            raise stream.error
        self.produced += stream.produced

    def start(self, summary: Path | None = None) -> IngestProcess:
        return start_ingest(run_args(self.config, summary=summary), log_dir=self.tmp_path)

    def wait_new_rows(self, proc: IngestProcess, before: int) -> None:
        wait_until(lambda: count_rows(self.dsn, TABLE) > before, 60, interval_s=0.05,
                   what="new rows being written", proc=proc)

    def restart_marks(self) -> dict[int, int]:
        """Where a restarted consumer resumes: the stored offsets (exactly-once) or Kafka's."""
        if self.delivery == "exactly_once":
            return stored_offsets(self.dsn, self.topic)
        return committed_offsets(self.bootstrap, self.group, self.topic)

    def kill(self, proc: IngestProcess, stream: SteadyProducer, progress_s: float) -> Kill:
        """SIGKILL ``proc`` at a random moment 0.05-1.5 s from now; when the scenario aligns this
        kill, at the first write seen after that moment (within ~10 ms of a batch transaction's
        commit: its offsets cannot have been committed yet)."""
        aligned = self.align(len(self.kills))
        time.sleep(self.rng.uniform(0.05, 1.5))
        if aligned:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                def rows() -> int:
                    return conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]  # noqa: S608

                base = rows()
                wait_until(lambda: rows() > base, 30, interval_s=0.005, what="a write to kill after", proc=proc)
        assert proc.poll() is None, f"ingest exited on its own before kill {len(self.kills) + 1}\n{proc.describe()}"
        rows, produced, streaming = count_rows(self.dsn, TABLE), self.produced + stream.produced, stream.is_alive()
        after_s = time.monotonic() - progress_s
        proc.kill9()
        assert proc.returncode == -signal.SIGKILL
        marks = self.restart_marks()
        kill = Kill(len(self.kills) + 1, rows, produced, streaming, rows_at_or_above(self.dsn, marks), after_s,
                    aligned)
        if self.delivery == "exactly_once":
            # The invariant behind the design: below the stored watermark everything is in the
            # table, once (the poison-free scenarios only).
            if self.gen.poison_frac == 0:
                bad = prefix_violations(self.dsn, marks)
                assert not bad, f"after kill {kill.n}: stored watermark not backed by the table: {bad}"
            dup = count_rows(self.dsn, TABLE) - len({(p, o) for p, o, _ in table_positions(self.dsn)})
            assert dup == 0, f"after kill {kill.n}: {dup} duplicate rows in exactly-once mode"
        self.kills.append(kill)
        print(f"  kill {kill.n} at t={time.monotonic() - self.started:.1f}s ({'after a write' if aligned else 'random'}): "
              f"rows {rows}, produced {produced}, streaming {streaming}, {after_s:.2f}s after new rows; "
              f"exposed {kill.exposed}")
        return kill

    def kill_cycle(self, chunk: int) -> None:
        """Start, wait for assignment, stream ``chunk`` records, SIGKILL once new rows appear."""
        before = count_rows(self.dsn, TABLE)
        proc = self.start()
        wait_assigned(proc, timeout_s=90)
        stream = self.stream(chunk)
        self.wait_new_rows(proc, before)
        self.kill(proc, stream, time.monotonic())
        self.settle(stream)

    def rebalance_cycle(self, chunk: int) -> dict[str, Any]:
        """Like :meth:`kill_cycle`, but a second process B joins while A writes, gets partitions,
        and leaves with SIGTERM (a clean stop: it stores and commits its offsets); A takes all
        partitions back and is then SIGKILLed."""
        before = count_rows(self.dsn, TABLE)
        a = self.start()
        wait_assigned(a, timeout_s=90)
        stream = self.stream(chunk, seconds=30)  # runs through the whole rebalance; stopped below
        self.wait_new_rows(a, before)
        summary_b = self.tmp_path / f"summary-b-{len(self.kills)}.json"
        b = self.start(summary_b)
        b_parts = wait_assigned(b, timeout_s=90)  # B holds partitions: safe to SIGTERM
        wait_until(lambda: any(e.get("event") == "partitions revoked" for e in log_events(a)), 30,
                   what="A's revoke", proc=a)
        time.sleep(1.5)
        n_before = len(assignments(a))
        assert b.stop(signal.SIGTERM, timeout_s=30) == 0, b.describe()
        wait_until(lambda: len(assignments(a)) > n_before and len(assignments(a)[-1]) == 6, 60,
                   what="A re-assigned all 6 partitions", proc=a)
        self.settle(stream, early=True)
        stream = self.stream(chunk)
        rows_now = count_rows(self.dsn, TABLE)
        self.wait_new_rows(a, rows_now)
        self.kill(a, stream, time.monotonic())
        self.settle(stream)
        sb = read_summary(summary_b)["pipelines"][PIPELINE]
        assert sb["records_consumed"] > 0, f"B was assigned {b_parts} but consumed nothing"
        return {"b_partitions": b_parts, "b_consumed": sb["records_consumed"], "b_rows": sb["rows_written"]}

    def final_run(self) -> dict[str, Any]:
        self.produce_now(self.total - self.produced)
        assert self.produced == self.total
        summary = self.tmp_path / "summary-final.json"
        res = run_ingest(run_args(self.config, until_idle=3, summary=summary), timeout_s=150, log_dir=self.tmp_path)
        assert_exit_ok(res)
        return read_summary(summary)["pipelines"][PIPELINE]


def new_scenario(*, kafka_bootstrap: str, pg_dsn: str, topic: str, group_id: str, tmp_path: Path,
                 delivery: str, total: int, seed: int, poison_frac: float = 0.0,
                 write_method: str = "copy", columnar: bool | None = None) -> Scenario:
    config = write_and_migrate(tmp_path, events_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, delivery=delivery,
        write_method=write_method, columnar=columnar))
    return Scenario(kafka_bootstrap, topic, group_id, pg_dsn, config, tmp_path,
                    EventGen(seed, poison_frac=poison_frac), random.Random(seed), delivery, total)


def log_positions(bootstrap: str, topic: str) -> dict[tuple[int, int], bytes | None]:
    """``{(partition, offset): value}`` of every record in the topic."""
    return {(m.partition, m.offset): m.value for msgs in read_topic(bootstrap, topic).values() for m in msgs}


def assert_offsets_at_log_end(s: Scenario) -> dict[int, int]:
    ends = {p: e for p, e in log_end_offsets(s.bootstrap, s.topic).items() if e > 0}
    stored = stored_offsets(s.dsn, s.topic)
    assert stored == ends, f"ingest_offsets {stored} != true log end {ends}"
    for (p, _lanes, lane), off in lane_offsets(s.dsn, s.topic).items():
        assert off <= ends.get(p, 0), f"lane offset of partition {p} lane {lane} is {off}, past the log end {ends}"
    committed = committed_offsets(s.bootstrap, s.group, s.topic)
    assert committed == ends, f"Kafka committed offsets {committed} != true log end {ends} (stored: {stored})"
    return ends


# --------------------------------------------------------------------------- 1. exactly once through kills


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_exactly_once_append_only_survives_sigkills_and_a_rebalance(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """100k keyed records into an append-only table with 4 lanes; ingest is SIGKILLed 10 times at
    random moments while it writes (restarted each time) and a second process joins and leaves
    in between; a final ``--until-idle`` run drains. The table holds every record exactly once,
    and ``ingest_offsets`` as well as the Kafka committed offsets equal the true log end."""
    kills = int(os.environ.get("INGEST_TEST_EO_KILLS", "10"))
    total = int(os.environ.get("INGEST_TEST_EO_RECORDS", "100000"))
    assert kills >= 1
    seed = seed_for("exactly-once")
    topic = new_topic(6)
    s = new_scenario(kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, topic=topic, group_id=group_id,
                     tmp_path=tmp_path, delivery="exactly_once", total=total, seed=seed)
    # 10 % up front (a backlog for the first process), the rest streamed during the kill cycles
    # (the rebalance cycle streams two chunks); whatever is left goes in before the final run.
    s.produce_now(total // 10)
    chunk = (total - s.produced) // (kills + 2)
    rebalance_at = kills // 2
    rebalance: dict[str, Any] = {}
    for i in range(kills):
        if i == rebalance_at:
            rebalance = s.rebalance_cycle(chunk)
        else:
            s.kill_cycle(chunk)
    assert len(s.kills) == kills
    kills_done_s = time.monotonic() - s.started
    stats = s.final_run()

    log = log_positions(kafka_bootstrap, topic)
    assert len(log) == total
    expected = {(p, o, orjson.loads(v)["id"]) for (p, o), v in log.items()}  # type: ignore[arg-type]
    rows = table_positions(pg_dsn)
    assert len(rows) == total, f"table holds {len(rows)} rows for {total} records"
    assert len(set(rows)) == len(rows), f"{len(rows) - len(set(rows))} duplicate rows"
    missing, extra = expected - set(rows), set(rows) - expected
    assert not missing and not extra, f"{len(missing)} records missing (e.g. {sorted(missing)[:5]}), " \
                                      f"{len(extra)} unexpected rows (e.g. {sorted(extra)[:5]})"
    assert {r[2] for r in rows} == set(range(total))
    ends = assert_offsets_at_log_end(s)
    assert dlq_entries(pg_dsn) == []
    assert stats["dead_lettered"] == 0
    # Every kill landed while rows were still to be written, and the kills did hit the window
    # an at-least-once restart would replay (rows above the stored watermark).
    assert all(k.rows < total for k in s.kills), [k.rows for k in s.kills]
    exposed = sum(k.exposed for k in s.kills)
    assert exposed > 0, "no kill left rows above the stored watermark: the scenario tested nothing"
    print(f"exactly-once: {total} records, {kills} SIGKILLs in {kills_done_s:.0f}s "
          f"({sum(k.streaming for k in s.kills)} while the stream ran), rebalance {rebalance}; "
          f"rows above the stored watermark at the kills: {[k.exposed for k in s.kills]} (sum {exposed}); "
          f"final run read {stats['records_consumed']}, found {stats['already_written']} already written, "
          f"wrote {stats['rows_written']}; log end {ends}; total {time.monotonic() - s.started:.0f}s")


# --------------------------------------------------------------------------- 2. at least once: duplicates


@pytest.mark.slow
def test_at_least_once_append_only_duplicates_after_sigkills(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                           tmp_path):
    """Why ``exactly_once`` exists: the same kill/restart run in the default ``at_least_once``
    mode loses nothing, but an append-only table has no key to absorb a replay, so records
    written before a kill and re-read after it (above the Kafka committed offset) are inserted
    again: the table ends with more rows than records."""
    total, kills = 30_000, 4
    seed = seed_for("at-least-once")
    topic = new_topic(6)
    s = new_scenario(kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, topic=topic, group_id=group_id,
                     tmp_path=tmp_path, delivery="at_least_once", total=total, seed=seed)
    # Every kill right after a batch transaction committed (its offsets are committed up to
    # commit_interval_ms later): the crash window this test is about. A purely random moment
    # misses it about half the time, because the broker hands out a trickle in bursts.
    s.align = lambda i: True
    s.produce_now(total // 10)
    chunk = (total - s.produced) // (2 * kills + 1)
    for _ in range(kills):
        s.kill_cycle(chunk)
    if sum(k.exposed for k in s.kills) == 0:
        # Every kill happened to land right after a commit: nothing to replay. Once more.
        print("  no kill left rows above the committed offsets; repeating the kill sequence")
        for _ in range(kills):
            s.kill_cycle(chunk)
    stats = s.final_run()

    log = log_positions(kafka_bootstrap, topic)
    assert len(log) == total
    expected = {(p, o, orjson.loads(v)["id"]) for (p, o), v in log.items()}  # type: ignore[arg-type]
    rows = table_positions(pg_dsn)
    assert set(rows) == expected, "at-least-once lost or invented records"
    duplicates = len(rows) - total
    exposed = [k.exposed for k in s.kills]
    assert duplicates > 0, f"no duplicates after {len(s.kills)} SIGKILLs (exposed rows per kill {exposed})"
    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    ends = {p: e for p, e in log_end_offsets(kafka_bootstrap, topic).items() if e > 0}
    assert committed == ends
    print(f"at-least-once: {total} records, {len(s.kills)} SIGKILLs; table has {len(rows)} rows "
          f"({duplicates} duplicates); rows above the committed offsets at the kills: {exposed}; "
          f"final run read {stats['records_consumed']}")


# --------------------------------------------------------------------------- 3. poison, exactly once


@pytest.mark.parametrize(("write_method", "columnar"), [("copy", None), ("values", None), ("copy", False)])
def test_exactly_once_poison_records_dead_lettered_once(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path,
                                                        write_method, columnar):
    """Exactly-once with poison mixed in: invalid JSON (decode) and rows that violate a CHECK
    constraint the table got after ``migrate`` (write, isolated with savepoints inside the batch
    transaction -- several pieces per transaction, with both write methods). One SIGKILL mid-run
    makes ingest re-read part of the stream. At the end: the table holds exactly the good
    records, each once; every poison record is one DLQ row with ``attempts == 1`` (its DLQ
    insert committed with the batch and was not repeated on the re-read); stored and committed
    offsets are at the log end. By default the columnar tier writes the stream (a batch with a row the
    database refuses goes by rows, inside the same transaction); ``columnar: false``, by rows."""
    total = 8_000
    seed = seed_for("eo-poison")
    topic = new_topic(6)
    s = new_scenario(kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, topic=topic, group_id=group_id,
                     tmp_path=tmp_path, delivery="exactly_once", total=total, seed=seed, poison_frac=0.01,
                     write_method=write_method, columnar=columnar)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT events_k_nonneg CHECK (k >= 0)")  # noqa: S608
    s.produce_now(2_000)
    s.kill_cycle(3_000)
    stats = s.final_run()

    log = log_positions(kafka_bootstrap, topic)
    assert len(log) == total
    kinds = {pos: classify_value(v) for pos, v in log.items()}
    good = {(p, o, i) for (p, o), (kind, i) in kinds.items() if kind == "good"}
    poison = {pos: kind for pos, (kind, _) in kinds.items() if kind != "good"}
    n_bad_json = sum(1 for k in poison.values() if k == "bad_json")
    assert n_bad_json and len(poison) - n_bad_json, f"the seed produced no poison of some kind: {poison}"

    rows = table_positions(pg_dsn)
    assert len(rows) == len(set(rows)), f"{len(rows) - len(set(rows))} duplicate rows"
    assert set(rows) == good, f"{len(good - set(rows))} good records missing, {len(set(rows) - good)} unexpected rows"

    dlq = dlq_entries(pg_dsn)
    by_pos = {(d["partition"], d["offset"]): d for d in dlq}
    assert len(by_pos) == len(dlq)
    assert set(by_pos) == set(poison), f"DLQ positions differ: missing {set(poison) - set(by_pos)}, " \
                                       f"extra {set(by_pos) - set(poison)}"
    for pos, kind in poison.items():
        d = by_pos[pos]
        want = ("decode", "invalid_json", None) if kind == "bad_json" else \
            ("write", "integrity_constraint_violation", "23514")
        assert (d["stage"], d["error_class"], d["sqlstate"]) == want, (pos, kind, d)
        assert (d["pipeline"], d["topic"], bytes(d["value"])) == (PIPELINE, topic, log[pos])
        assert d["attempts"] == 1 and d["status"] == "pending", f"DLQ row written more than once: {d}"
    ends = assert_offsets_at_log_end(s)
    assert stats["write_tier"] == ("rows (columnar: false)" if columnar is False else "columnar"), stats["write_tier"]
    print(f"eo-poison: {total} records, {len(good)} good, {n_bad_json} bad JSON, "
          f"{len(poison) - n_bad_json} CHECK violations; kill {s.kills[0]}; final run read "
          f"{stats['records_consumed']}, already written {stats['already_written']}, "
          f"dead-lettered {stats['dead_lettered_by_class']}; log end {ends}")


# --------------------------------------------------------------------------- 3b. the columnar tier, killed


def test_exactly_once_columnar_survives_sigkills(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """The columnar tier under exactly-once (issue #38 item 1): 6000 keyed records (1 % poison; the
    invalid JSON is dead-lettered beside the columnar write, the table has no CHECK here, so a batch
    goes by rows only where it holds records already written) into the append-only table with 4
    lanes; ingest is SIGKILLed right after a write, three times, and a final ``--until-idle`` run
    drains. The table holds every good record exactly once, every poison record is one DLQ row
    written once, stored and committed offsets are at the log end, and the final run wrote on the
    columnar tier. (Rows the database refuses under kills: the poison test above, on the tier by
    default.)"""
    total, kills = 6_000, 3
    seed = seed_for("eo-columnar-kills")
    topic = new_topic(6)
    config = events_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                           delivery="exactly_once", columnar=True)
    # Batches of at most 250: the final run's first batch of each lane holds records already written
    # (written by rows: the columnar payload stands for every record of its batch), its later ones not.
    config["pipelines"][0]["batch"]["max_rows"] = 250
    s = Scenario(kafka_bootstrap, topic, group_id, pg_dsn, write_and_migrate(tmp_path, config), tmp_path,
                 EventGen(seed, poison_frac=0.01), random.Random(seed), "exactly_once", total)
    s.align = lambda i: True  # every kill right after a batch committed: the window exactly-once closes
    s.produce_now(total // 10)
    chunk = (total - s.produced) // (2 * kills + 2)
    for _ in range(kills):
        s.kill_cycle(chunk)
    if sum(k.exposed for k in s.kills) == 0:  # every kill landed right after an offset store: once more
        for _ in range(kills):
            s.kill_cycle(chunk)
    stats = s.final_run()

    log = log_positions(kafka_bootstrap, topic)
    assert len(log) == total
    kinds = {pos: classify_value(v) for pos, v in log.items()}
    good = {(p, o, i) for (p, o), (kind, i) in kinds.items() if kind != "bad_json"}  # k = -1 is a row here
    poison = {pos for pos, (kind, _) in kinds.items() if kind == "bad_json"}
    assert poison, "the seed produced no poison"
    rows = table_positions(pg_dsn)
    assert len(rows) == len(set(rows)), f"{len(rows) - len(set(rows))} duplicate rows"
    missing, extra = good - set(rows), set(rows) - good
    assert not missing and not extra, f"{len(missing)} records missing (e.g. {sorted(missing)[:5]}), " \
                                      f"{len(extra)} unexpected rows (e.g. {sorted(extra)[:5]})"
    dlq = dlq_entries(pg_dsn)
    assert sorted((d["partition"], d["offset"]) for d in dlq) == sorted(poison)
    assert all(d["attempts"] == 1 for d in dlq), [d for d in dlq if d["attempts"] != 1]
    ends = assert_offsets_at_log_end(s)
    assert stats["write_tier"] == "columnar" and stats["columnar_records"] > 0, stats
    exposed = sum(k.exposed for k in s.kills)
    assert exposed > 0, "no kill left rows above the stored watermark: the scenario tested nothing"
    print(f"eo-columnar-kills: {total} records, {len(poison)} poison, {len(s.kills)} SIGKILLs, rows above the "
          f"stored watermark at the kills {[k.exposed for k in s.kills]}; final run read {stats['records_consumed']}, "
          f"already written {stats['already_written']}, columnar {stats['columnar_records']}; log end {ends}")


# --------------------------------------------------------------------------- 4. the advisory Kafka commit


def test_exactly_once_kafka_commit_catches_up_with_stored_offsets(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                  tmp_path):
    """A crash between the two offset writes of a commit tick (``ingest_offsets`` saved, the Kafka
    commit not sent) leaves Kafka's committed offsets behind the stored ones. The next run seeks to
    the stored offsets; it must still bring the advisory Kafka commit up to them (lag tooling reads
    it), even when no new record arrives for that partition.

    The crash state is made directly: a first run drains the topic, then the group's Kafka
    offsets are set back by 100 per partition (what the crash would have left), and a second
    ``--until-idle`` run starts."""
    total = 3_000
    seed = seed_for("eo-kafka-commit")
    topic = new_topic(6)
    s = new_scenario(kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, topic=topic, group_id=group_id,
                     tmp_path=tmp_path, delivery="exactly_once", total=total, seed=seed)
    s.final_run()
    ends = assert_offsets_at_log_end(s)

    from confluent_kafka import Consumer, TopicPartition

    behind = {p: max(0, e - 100) for p, e in ends.items()}
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group_id, "enable.auto.commit": False})
    try:  # a commit without subscribe(): the group is empty, so a simple-consumer commit is accepted
        c.commit(offsets=[TopicPartition(topic, p, off) for p, off in behind.items()], asynchronous=False)
    finally:
        c.close()
    assert committed_offsets(kafka_bootstrap, group_id, topic) == behind

    stats = s.final_run()
    assert stats["records_consumed"] == 0, "the stored offsets are at the log end: nothing to re-read"
    assert stored_offsets(pg_dsn, topic) == ends
    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    assert committed == ends, f"Kafka committed offsets {committed} stay behind the stored ones {ends}"


# --------------------------------------------------------------------------- 5. a batch that gives up


def test_exactly_once_batch_that_gave_up_loses_nothing(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """A batch whose transaction keeps failing (the table is locked: every attempt hits
    ``statement_timeout``) exhausts its retries and stops the pipeline (exit 1) while later
    batches of the same lane are already queued. The lock is released right after the failure.
    Nothing of the failed batch may be lost: a restarted run must still write every record --
    so no later batch of that lane may advance the lane's stored offsets past the failed one."""
    total = 8_000
    seed = seed_for("eo-gave-up")
    topic = new_topic(6)
    config = events_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                           delivery="exactly_once", lanes=1)
    pipeline = config["pipelines"][0]
    pipeline["sink"]["statement_timeout_ms"] = 300
    pipeline["retry"] = {"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 100}
    pipeline["shutdown_timeout_s"] = 20
    s = Scenario(kafka_bootstrap, topic, group_id, pg_dsn, write_and_migrate(tmp_path, config), tmp_path,
                 EventGen(seed), random.Random(seed), "exactly_once", total)
    s.produce_now(1_000)
    before = count_rows(pg_dsn, TABLE)
    proc = s.start()
    wait_assigned(proc, timeout_s=90)
    stream = s.stream(6_000, seconds=6)
    s.wait_new_rows(proc, before)
    with psycopg.connect(pg_dsn) as locker:
        # EXCLUSIVE blocks INSERT (ROW EXCLUSIVE) but not the test's SELECTs.
        locker.execute(f"LOCK TABLE {TABLE} IN EXCLUSIVE MODE")  # noqa: S608
        rows_locked = count_rows(pg_dsn, TABLE)
        wait_until(lambda: any(e.get("event") == "batch failed" for e in log_events(proc)), 60, interval_s=0.02,
                   what="a batch giving up", proc=proc)
        rows_failed = count_rows(pg_dsn, TABLE)  # no insert can have committed while the lock is held
        locker.rollback()
    code = proc.wait(60)
    rows_exit = count_rows(pg_dsn, TABLE)
    assert code == 1, proc.describe()
    s.settle(stream)
    stats = s.final_run()

    log = log_positions(kafka_bootstrap, topic)
    expected = {(p, o, orjson.loads(v)["id"]) for (p, o), v in log.items()}  # type: ignore[arg-type]
    rows = table_positions(pg_dsn)
    missing = expected - set(rows)
    print(f"eo-gave-up: rows when locked {rows_locked}, when the batch gave up {rows_failed}, at exit {rows_exit} "
          f"(written by the lane after its batch gave up: {rows_exit - rows_failed}); final run read "
          f"{stats['records_consumed']}, already written {stats['already_written']}; missing {len(missing)}")
    assert len(rows) == len(set(rows)), f"{len(rows) - len(set(rows))} duplicate rows"
    assert not missing, f"{len(missing)} records lost, e.g. (partition, offset, id) {sorted(missing)[:5]}; " \
                        f"lane offsets {lane_offsets(pg_dsn, topic)}, stored {stored_offsets(pg_dsn, topic)}"
    assert set(rows) == expected
    assert_offsets_at_log_end(s)

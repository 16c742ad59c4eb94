"""Chaos runner: inject faults while ``ingest run`` works, then check the invariants.

Each fault case (``case_*``) builds its own world -- a fresh PostgreSQL role and
database, a fresh topic and consumer group -- produces a known stream while
``python -m ingest run`` (subprocesses, 4 lanes, small batches, ``--metrics-port 0``)
consumes it, injects its faults (restarting ingest where a fault killed it),
finally runs ``ingest run --until-idle`` and checks, against the log read back
from the broker:

* every good key is in the sink exactly once, with the value of its last record
  (the highest ``seq``; nothing lost, nothing extra);
* every poison record (bad JSON, or a row violating the sink's CHECK) is in the
  DLQ exactly once: unique (topic, partition, offset), the set equals the known
  poison set, with the expected stage / error class and the record's bytes;
* committed offsets equal the true log end of every non-empty partition;
* no key was applied out of order: an ``AFTER UPDATE`` trigger on the sink
  records every update with ``NEW.seq <= OLD.seq``; updates that go backwards,
  or rewrite a seq with a different value, land in ``sink_audit`` (must stay
  empty), idempotent re-applications of the identical record (an at-least-once
  replay after a crash) are only counted (``sink_reapplied``).

The stream: keys ``k00000..`` (skewed: a few hot keys, many cold ones) with
per-key sequence numbers 1..n in produce order (one key always lands in one
partition, so the log order per key is the seq order), values ``{"k", "seq",
"val"}``; poison records (~0.4 %, half bad JSON, half CHECK violations) have
keys of their own, ``poison-*``. The sink uses ``version_column: seq``: at-least-once delivery
replays records after a crash, and without a version guard a replay would
legitimately rewind a key for a moment (that is what the product documents
``version_column`` for); with it, any backwards update is a real ordering bug.

Usable three ways:

* from pytest: ``tests/chaos/test_chaos.py`` (marked ``slow``; short version by
  default, the long one with ``INGEST_CHAOS_LONG=1``);
* as a script: ``python tests/chaos/run.py [--long] [--case NAME ...] [--seed N]``;
* as a module: ``python -m tests.chaos.runner [--long] ...`` from the repo root.

Outside pytest the services come from ``tests/harness/services.py`` (the same
rules as the test fixtures: ``INGEST_TEST_PG_DSN`` / ``INGEST_TEST_KAFKA`` or
the local PostgreSQL and a Tansu broker subprocess).

Broker quirks designed around (see /work/shared/INFRA.md): a member killed with
SIGKILL is replaced after about session timeout + join, so the consumers run
with ``session.timeout.ms=2000`` / ``heartbeat.interval.ms=200`` (a join takes
about 1 s, a killed member is replaced in about 4 s); a member killed while its
join was in progress can still be given partitions in the next round (Tansu; the
final run waits a session timeout after the last kill, see ``final_run``); a
consumer is never stopped cleanly before its first assignment (that wedges the
group); every case uses a fresh group; broker restarts (memory storage loses
everything) happen only on a broker the case owns, PostgreSQL restarts only on
a throwaway cluster the case owns (never the machine's shared server).

PostgreSQL faults need ingest to connect as a non-superuser (superusers are
exempt from ``CONNECTION LIMIT``): each case creates a role with a password and
a database it owns, and drops both at the end.

Extra cases reproduce product bugs this runner found (``case_poison_same_key``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:  # outside pytest: the harness lives in tests/
    sys.path.insert(0, str(_TESTS))
if str(_TESTS / "integration") not in sys.path:  # pipeline_helpers
    sys.path.append(str(_TESTS / "integration"))

import orjson  # noqa: E402
import psycopg  # noqa: E402
from harness import IngestProcess, run_ingest, start_ingest, write_config  # noqa: E402
from harness.kafka import (  # noqa: E402
    close_producers,
    committed_offsets,
    create_topic,
    delete_topics,
    log_end_offsets,
    produce,
    unique_name,
)
from harness.services import (  # noqa: E402
    die_with_parent,
    dsn_with_dbname,
    free_port,
    kafka_check,
    stop_process,
    tansu_binary,
)
from pipeline_helpers import (  # noqa: E402
    Msg,
    assignments,
    log_events,
    read_topic,
    wait_assigned,
    wait_until,
)
from psycopg import conninfo, sql  # noqa: E402

PIPELINE = "chaos"
TABLE = "sink"
DLQ_TABLE = "ingest_dlq"
PARTITIONS = 6
LANES = 4
#: Consumer settings: a SIGKILLed member is replaced after about session timeout + join.
CONSUMER_SETTINGS = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 200}
#: Poison kinds and what the DLQ must say about them (stage, error_class).
BAD_JSON, CHECK_VIOLATION = "bad_json", "check_violation"
EXPECTED_DLQ = {BAD_JSON: ("decode", "invalid_json"), CHECK_VIOLATION: ("write", "integrity_constraint_violation")}
#: Exit statuses of ``ingest run``.
EXIT_OK, EXIT_ABORTED, KILLED = 0, 130, -signal.SIGKILL


# --------------------------------------------------------------------------- environment and results


@dataclass
class ChaosEnv:
    """Where a chaos run happens. ``long`` picks the big version of every case."""

    bootstrap: str
    pg_admin_dsn: str
    work_dir: Path
    long: bool = False
    seed: int = field(default_factory=lambda: int(os.environ.get("INGEST_CHAOS_SEED") or time.time_ns() % 2**31))
    echo: Callable[[str], None] = field(default=lambda line: print(line, flush=True))

    def size(self, short: Any, long: Any) -> Any:
        return long if self.long else short


@dataclass
class CaseResult:
    case: str
    faults: Counter[str] = field(default_factory=Counter)
    records: int = 0
    keys: int = 0
    poison: int = 0
    lost: int = 0
    duplicated: int = 0
    misordered: int = 0
    wrong: int = 0
    dlq_exact: bool = False
    committed_at_end: bool = False
    reapplied: int = 0
    stale_suppressed: int = 0
    restarts: int = 0
    seconds: float = 0.0
    seed: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    @property
    def ok(self) -> bool:
        return (not self.problems and self.lost == 0 and self.duplicated == 0 and self.misordered == 0
                and self.wrong == 0 and self.dlq_exact and self.committed_at_end and self.faults_injected > 0)

    def explain(self) -> str:
        lines = [f"chaos case {self.case} (seed {self.seed}) FAILED:"]
        lines += [f"  - {p}" for p in self.problems] or ["  - (see counters)"]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(render_table([self]))
        return "\n".join(lines)


COLUMNS = ("fault", "faults injected", "records checked", "lost", "duplicated", "misordered", "DLQ exact",
           "commit=end", "re-applied", "restarts", "time s", "result")


def _row(r: CaseResult) -> list[str]:
    detail = ", ".join(f"{k} {v}" for k, v in sorted(r.faults.items()))
    return [r.case, f"{r.faults_injected} ({detail})" if detail else "0",
            f"{r.records} ({r.keys} keys, {r.poison} poison)", str(r.lost), str(r.duplicated),
            str(r.misordered), "yes" if r.dlq_exact else "NO", "yes" if r.committed_at_end else "NO",
            str(r.reapplied), str(r.restarts), f"{r.seconds:.1f}", "ok" if r.ok else "FAIL"]


def render_table(results: Sequence[CaseResult]) -> str:
    rows = [list(COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    out = []
    for n, row in enumerate(rows):
        out.append(" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            out.append("-+-".join("-" * w for w in widths))
    if len(results) > 1:
        out.append(f"total {sum(r.seconds for r in results):.1f} s, "
                   f"{sum(r.faults_injected for r in results)} faults, "
                   f"{sum(r.records for r in results)} records, "
                   f"{sum(1 for r in results if r.ok)}/{len(results)} cases ok")
    return "\n".join(out)


class ChaosFailure(AssertionError):
    """A step of a case could not be carried out (ingest died, a wait timed out...)."""


# --------------------------------------------------------------------------- the stream


class Stream:
    """Known records: good ones (per-key seq 1..n in generation order) and poison ones.

    Poison records normally have keys of their own (``poison-*``); :meth:`pattern` mixes CHECK
    violations into the records of live keys (each takes the key's next seq). Whatever the key,
    a record is poison by its content (:func:`poison_kind`). Thread-safe; ``lock`` is also held while
    a generated chunk is produced, so the produce order equals the generation order.
    """

    def __init__(self, seed: int, n_keys: int, poison_frac: float, *, prefix: str = "k", pad: int = 60) -> None:
        self.rng = random.Random(seed)
        self.prefix = prefix
        self.keys = [f"{prefix}{i:05d}" for i in range(n_keys)]
        self.poison_frac = poison_frac
        self.pad = "x" * pad
        self.seq: dict[str, int] = {}  # last seq given to a key (good or poison)
        self.last: dict[str, tuple[int, str]] = {}  # last *good* (seq, val) of a key
        self.poison = 0
        self.good = 0
        self.lock = threading.RLock()

    def _good(self, k: str | None = None) -> tuple[bytes, bytes]:
        # Skewed: low key numbers are hot (many seqs), high ones rare.
        k = k or self.keys[int(len(self.keys) * self.rng.random() ** 1.6)]
        seq = self.seq[k] = self.seq.get(k, 0) + 1
        val = f"{k}/{seq}/{self.rng.getrandbits(40):010x}/{self.pad}"
        self.last[k] = (seq, val)
        self.good += 1
        return k.encode(), orjson.dumps({"k": k, "seq": seq, "val": val})

    def _poison(self, live_key: str | None = None) -> tuple[bytes, bytes]:
        j = self.poison
        self.poison += 1
        if live_key is not None:  # valid JSON that maps fine and violates the sink's CHECK
            seq = self.seq[live_key] = self.seq.get(live_key, 0) + 1
            return live_key.encode(), orjson.dumps({"k": live_key, "seq": seq, "val": f"POISON {j}"})
        key = f"poison-{self.prefix}{j:05d}"
        if j % 2 == 0:
            return key.encode(), f'{{"k": "{key}", "seq": 1, "val": "truncated'.encode()
        return key.encode(), orjson.dumps({"k": key, "seq": 1, "val": f"POISON {j}"})

    def next(self, n: int, poison_frac: float | None = None) -> list[tuple[bytes, bytes]]:
        frac = self.poison_frac if poison_frac is None else poison_frac
        with self.lock:
            return [self._poison() if self.rng.random() < frac else self._good() for _ in range(n)]

    def pattern(self, keys: Sequence[str], pattern: str) -> list[tuple[bytes, bytes]]:
        """For each key, records in ``pattern`` order: ``g`` a good record, ``p`` a CHECK violation."""
        with self.lock:
            return [self._good(k) if c == "g" else self._poison(live_key=k) for k in keys for c in pattern]

    @property
    def total(self) -> int:
        return self.good + self.poison


def poison_kind(value: bytes | None) -> str | None:
    """BAD_JSON / CHECK_VIOLATION for a poison record, None for a good one."""
    try:
        doc = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return BAD_JSON
    return CHECK_VIOLATION if str(doc.get("val", "")).startswith("POISON") else None


# --------------------------------------------------------------------------- SQL

SCHEMA_SQL = """
CREATE TABLE sink (
    k   text PRIMARY KEY,
    seq bigint NOT NULL,
    val text,
    CONSTRAINT sink_val_not_poison CHECK (val IS NULL OR val NOT LIKE 'POISON%%')
);
-- Updates that go backwards (or rewrite a seq with another value): must stay empty.
CREATE TABLE sink_audit (
    id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp(),
    k text NOT NULL, old_seq bigint, new_seq bigint, old_val text, new_val text
);
-- Idempotent re-applications of the identical record (at-least-once replays): counted only.
CREATE TABLE sink_reapplied (k text NOT NULL, seq bigint NOT NULL);
-- Writes the version column suppressed (older seq than stored): counted only.
CREATE TABLE sink_stale (k text NOT NULL, new_seq bigint, cur_seq bigint);
-- Fault knobs read by the delay triggers (seconds).
CREATE TABLE chaos_knobs (name text PRIMARY KEY, value double precision NOT NULL);
INSERT INTO chaos_knobs VALUES ('flush_delay_s', 0), ('dlq_delay_s', 0);

CREATE FUNCTION chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.seq < OLD.seq OR (NEW.seq = OLD.seq AND NEW.val IS DISTINCT FROM OLD.val) THEN
        INSERT INTO sink_audit (k, old_seq, new_seq, old_val, new_val)
            VALUES (OLD.k, OLD.seq, NEW.seq, OLD.val, NEW.val);
    ELSE
        INSERT INTO sink_reapplied VALUES (NEW.k, NEW.seq);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sink_audit AFTER UPDATE ON sink FOR EACH ROW WHEN (NEW.seq <= OLD.seq)
    EXECUTE FUNCTION chaos_audit();

CREATE FUNCTION chaos_stale() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE cur bigint;
BEGIN
    SELECT s.seq INTO cur FROM sink s WHERE s.k = NEW.k;
    IF cur IS NOT NULL AND NEW.seq < cur THEN
        INSERT INTO sink_stale VALUES (NEW.k, NEW.seq, cur);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER sink_stale BEFORE INSERT ON sink FOR EACH ROW EXECUTE FUNCTION chaos_stale();

-- A knob-controlled pause at the end of every sink write statement: widens the window in
-- which a batch is being written (for "kill / SIGTERM during a flush").
CREATE FUNCTION chaos_flush_delay() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE d double precision;
BEGIN
    SELECT value INTO d FROM chaos_knobs WHERE name = 'flush_delay_s';
    IF d > 0 THEN PERFORM pg_sleep(d); END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sink_flush_delay AFTER INSERT ON sink FOR EACH STATEMENT EXECUTE FUNCTION chaos_flush_delay();

CREATE FUNCTION chaos_dlq_delay() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE d double precision;
BEGIN
    SELECT value INTO d FROM chaos_knobs WHERE name = 'dlq_delay_s';
    IF d > 0 THEN PERFORM pg_sleep(d); END IF;
    RETURN NEW;
END $$;
"""

# After `ingest migrate` created the DLQ table: a knob-controlled pause per DLQ row.
DLQ_TRIGGER_SQL = (f"CREATE TRIGGER dlq_delay BEFORE INSERT ON {DLQ_TABLE} FOR EACH ROW "
                   "EXECUTE FUNCTION chaos_dlq_delay()")

#: pg_stat_activity patterns of what ingest is doing.
ACTIVITY = {"flush": r"^\s*(COPY|INSERT)\M.*ingest_stage", "dlq": rf"^\s*INSERT\M.*{DLQ_TABLE}"}


# --------------------------------------------------------------------------- a case's world


class Scenario:
    """One case: a PostgreSQL role + database, a topic, a group, a stream, ingest processes.

    Use as a context manager; everything it created is removed on exit.
    """

    def __init__(self, env: ChaosEnv, case: str, *, keys: int, poison_frac: float = 0.004,
                 bootstrap: str | None = None, pg_admin_dsn: str | None = None) -> None:
        self.env = env
        self.case = case
        self.rng = random.Random(f"{env.seed}/{case}")
        self.bootstrap = bootstrap or env.bootstrap
        self.pg_admin = pg_admin_dsn or env.pg_admin_dsn
        self.dir = Path(env.work_dir) / case
        self.dir.mkdir(parents=True, exist_ok=True)
        self.topic = unique_name("chaos", case, max_len=80)
        self.group = unique_name("chaos-g", case, max_len=80)
        self.stream = Stream(self.rng.randrange(2**31), keys, poison_frac)
        self.result = CaseResult(case, seed=env.seed)
        self.procs: list[IngestProcess] = []
        self.expect: dict[int, set[int]] = {}  # pid -> exit statuses the case caused / allows
        self.labels: dict[int, str] = {}
        self._t0 = time.monotonic()
        self._last_kill = 0.0
        self._names = itertools.count(1)
        self._db_ready = False
        suffix = secrets.token_hex(5)
        self.role = f"chaos_{suffix}"
        self.dbname = f"ingest_chaos_{suffix}"
        self.password = secrets.token_hex(16)
        self.dsn = ""  # ingest's DSN (the case's own non-superuser role, so connection limits apply to it)
        self.admin_db_dsn = ""  # superuser, in the case's database

    # -- logging -----------------------------------------------------------------
    def say(self, msg: str) -> None:
        self.env.echo(f"[chaos {self.case} +{time.monotonic() - self._t0:5.1f}s] {msg}")

    # -- setup / teardown ----------------------------------------------------------
    def __enter__(self) -> Scenario:
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _setup(self) -> None:
        with psycopg.connect(self.pg_admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(self.role), sql.Literal(self.password)))
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(self.dbname), sql.Identifier(self.role)))
        self._db_ready = True
        self.admin_db_dsn = dsn_with_dbname(self.pg_admin, self.dbname)
        self.dsn = conninfo.make_conninfo(self.admin_db_dsn, user=self.role, password=self.password)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA_SQL.replace("%%", "%"))
        create_topic(self.bootstrap, self.topic, PARTITIONS)
        self.migrate()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(DLQ_TRIGGER_SQL)

    def _teardown(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill9()
        with contextlib.suppress(Exception):
            delete_topics(self.bootstrap, [self.topic])
        if self._db_ready:
            try:
                with psycopg.connect(self.pg_admin, autocommit=True) as conn:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))
                    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(self.role)))
            except psycopg.Error as exc:
                self.say(f"cleanup: could not drop database/role: {exc}")
        else:
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.pg_admin, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(self.role)))

    # -- config and processes ------------------------------------------------------
    def config(self, *, max_rows: int = 200, max_latency_ms: int = 100, statement_timeout_ms: int = 30_000,
               shutdown_timeout_s: float = 15.0, max_attempts: int = 40, name: str | None = None,
               sink: dict[str, Any] | None = None) -> Path:
        """Write a config; ``sink`` overrides sink settings (a None value removes one)."""
        data = {
            "kafka": {"bootstrap_servers": self.bootstrap, "client": dict(CONSUMER_SETTINGS)},
            "pipelines": [{
                "name": PIPELINE,
                "topics": [self.topic],
                "group_id": self.group,
                "lanes": LANES,
                "commit_interval_ms": 200,
                "shutdown_timeout_s": shutdown_timeout_s,
                "batch": {"max_rows": max_rows, "max_latency_ms": max_latency_ms},
                "retry": {"max_attempts": max_attempts, "initial_backoff_ms": 50, "max_backoff_ms": 1000},
                "sink": {
                    "kind": "postgres",
                    "dsn": self.dsn,
                    "table": TABLE,
                    "conflict_key": ["k"],
                    "version_column": "seq",
                    "statement_timeout_ms": statement_timeout_ms,
                    "columns": {
                        "k": {"type": "text", "source": "$.k", "required": True},
                        "seq": {"type": "bigint", "source": "$.seq", "required": True},
                        "val": {"type": "text", "source": "$.val"},
                    },
                },
                "dlq": {"kind": "postgres", "table": DLQ_TABLE},
            }],
        }
        for key, value in (sink or {}).items():
            if value is None:
                data["pipelines"][0]["sink"].pop(key, None)  # type: ignore[index]
            else:
                data["pipelines"][0]["sink"][key] = value  # type: ignore[index]
        return write_config(self.dir, data, name or f"ingest-{next(self._names)}.yaml")

    def migrate(self) -> None:
        """What ``ingest migrate`` does, in-process (saves a Python start per case)."""
        from ingest.config import load_settings
        from ingest.migrate import migrate_pipeline

        migrate_pipeline(load_settings(self.config(name="migrate.yaml")).pipelines[0])

    def start(self, config: Path, label: str, *, until_idle: float | None = None) -> IngestProcess:
        args: list[Any] = ["run", "--config", config, "--metrics-port", "0"]
        if until_idle is not None:
            args += ["--until-idle", str(until_idle)]
        proc = start_ingest(args, log_dir=self.dir)
        self.procs.append(proc)
        self.labels[proc.pid] = label
        self.expect[proc.pid] = set()
        self.say(f"started ingest {label} (pid {proc.pid})")
        return proc

    def label(self, proc: IngestProcess) -> str:
        return self.labels.get(proc.pid, str(proc.pid))

    def alive(self, proc: IngestProcess, doing: str) -> None:
        """Fail the step (not just the invariants) when ingest died on its own."""
        if proc.poll() is not None:
            raise ChaosFailure(f"ingest {self.label(proc)} exited {proc.returncode} unexpectedly while {doing}\n"
                               f"{proc.describe()}")

    def kill9(self, proc: IngestProcess, kind: str) -> None:
        self.alive(proc, f"waiting to SIGKILL it ({kind})")
        self.expect[proc.pid].add(KILLED)
        proc.kill9()
        self._last_kill = time.monotonic()
        self.result.faults[f"kill9 {kind}"] += 1
        self.say(f"SIGKILL {self.label(proc)} ({kind})")

    def stop(self, proc: IngestProcess, timeout_s: float = 40.0) -> int:
        """SIGTERM and wait; a clean stop must exit 0."""
        self.alive(proc, "stopping it")
        self.expect[proc.pid].add(EXIT_OK)
        code = proc.stop(signal.SIGTERM, timeout_s)
        if code != EXIT_OK:
            self.result.problems.append(f"SIGTERM of {self.label(proc)}: exit {code}, expected 0\n{proc.describe()}")
        return code

    def wait_assigned(self, proc: IngestProcess, timeout_s: float = 60.0) -> list[str]:
        try:
            return wait_assigned(proc, timeout_s)
        except AssertionError as exc:
            raise ChaosFailure(str(exc)) from None

    def final_run(self, timeout_s: float = 180.0, config: Path | None = None) -> dict[str, Any]:
        """``ingest run --until-idle 1.5`` to the end of the log; must exit 0.

        Tansu quirk: a member SIGKILLed less than a session timeout ago can still be given
        partitions in the next join round (found by this runner; see INFRA.md), and ``--until-idle``
        stops once *its own* partitions are drained. So the final run starts a session timeout
        after the last kill, and if it still ended with partitions undrained (committed offsets
        short of the log end), another run follows (noted, not a failure: that is liveness under a
        broker quirk, the invariants are checked on the end state).
        """
        session_s = CONSUMER_SETTINGS["session.timeout.ms"] / 1000
        time.sleep(max(0.0, self._last_kill + session_s + 0.5 - time.monotonic()))
        stats: dict[str, Any] = {}
        for attempt in range(1, 4):
            summary = self.dir / f"final-summary-{attempt}.json"
            self.say(f"final run --until-idle{f' (again: {attempt})' if attempt > 1 else ''}")
            res = run_ingest(["run", "--config", config or self.config(name="final.yaml"), "--metrics-port", "0",
                              "--until-idle", "1.5", "--summary-json", summary], timeout_s=timeout_s,
                             log_dir=self.dir)
            if res.returncode != 0:
                self.result.problems.append(f"final run exited {res.returncode}\n{res.stderr[-4000:]}")
                return stats
            stats = orjson.loads(summary.read_bytes())["pipelines"][PIPELINE]
            ends = {p: e for p, e in log_end_offsets(self.bootstrap, self.topic).items() if e > 0}
            committed = committed_offsets(self.bootstrap, self.group, self.topic)
            if committed == ends:
                return stats
            held = [e.get("partitions") for e in _events(res.stderr) if e.get("event") == "partitions assigned"]
            self.result.notes.append(f"final run {attempt} ended with committed {committed} short of the log end "
                                     f"{ends}; its assignments: {held}")
        return stats

    def check_exits(self) -> None:
        """Every process ended the way the case made it end (or still runs: then it is killed)."""
        for proc in self.procs:
            code = proc.poll()
            if code is None:
                continue
            if code not in self.expect.get(proc.pid, set()):
                self.result.problems.append(f"ingest {self.label(proc)} exited {code} on its own\n{proc.describe()}")

    # -- producing -------------------------------------------------------------------
    def produce(self, n: int, poison_frac: float | None = None,
                make: Callable[[Stream], list[tuple[bytes, bytes]]] | None = None) -> int:
        """Produce ``n`` new records of the stream (or what ``make(stream)`` generates), in order."""
        with self.stream.lock:
            records = make(self.stream) if make is not None else self.stream.next(n, poison_frac)
            return produce(self.bootstrap, self.topic, records, config={"client.id": f"chaos-{self.case}"})

    @contextlib.contextmanager
    def feeding(self, rate_per_s: float, chunk: int = 100) -> Iterator[Feeder]:
        feeder = Feeder(self, rate_per_s, chunk)
        feeder.start()
        try:
            yield feeder
        finally:
            feeder.finish()
            self.say(f"producer stopped; {self.stream.total} records produced")

    # -- the database ------------------------------------------------------------------
    def sql_admin(self, query: str, params: Sequence[Any] | None = None, *, in_db: bool = True) -> list[tuple]:
        """Run one statement as the superuser (in the case's database, or in ``postgres``)."""
        with psycopg.connect(self.admin_db_dsn if in_db else self.pg_admin, autocommit=True) as conn:
            cur = conn.execute(query, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def knob(self, name: str, value: float) -> None:
        self.sql_admin("UPDATE chaos_knobs SET value = %s WHERE name = %s", (value, name))

    def pg_now(self) -> Any:
        return self.sql_admin("SELECT now()")[0][0]

    def ingest_backends(self) -> list[int]:
        return [r[0] for r in self.sql_admin(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND usename = %s AND backend_type = 'client backend'",
            (self.dbname, self.role), in_db=False)]

    def terminate_ingest_backends(self) -> int:
        rows = self.sql_admin(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND usename = %s AND backend_type = 'client backend'",
            (self.dbname, self.role), in_db=False)
        return int(rows[0][0])

    def wait_activity(self, what: str, proc: IngestProcess, since: Any, timeout_s: float = 60.0) -> str:
        """Poll pg_stat_activity until ingest (a backend started after ``since``) runs a ``what`` statement."""
        pattern = ACTIVITY[what]
        deadline = time.monotonic() + timeout_s
        with psycopg.connect(self.pg_admin, autocommit=True) as conn:
            while True:
                row = conn.execute(
                    "SELECT left(query, 70) FROM pg_stat_activity WHERE datname = %s AND usename = %s "
                    "AND state = 'active' AND backend_start >= %s AND query ~* %s LIMIT 1",
                    (self.dbname, self.role, since, pattern)).fetchone()
                if row:
                    return row[0]
                self.alive(proc, f"waiting for a {what} write")
                if time.monotonic() > deadline:
                    raise ChaosFailure(f"no {what} write by {self.label(proc)} within {timeout_s}s\n{proc.describe()}")
                time.sleep(0.01)

    def progress(self) -> tuple[int, int]:
        """(rows, sum of seq) of the sink: changes whenever ingest writes something new."""
        count, total = self.sql_admin("SELECT count(*), coalesce(sum(seq), 0) FROM sink")[0]
        return int(count), int(total)

    def wait_progress(self, proc: IngestProcess, timeout_s: float = 60.0) -> None:
        before = self.progress()

        def moved() -> bool:
            self.alive(proc, "waiting for rows to be written")
            return self.progress() != before

        try:
            wait_until(moved, timeout_s, interval_s=0.05, what="new rows in the sink")
        except AssertionError as exc:
            raise ChaosFailure(f"{exc}\n{proc.describe()}") from None

    def wait_committed(self, proc: IngestProcess, timeout_s: float = 60.0) -> int:
        """Wait until this run committed something beyond what was committed before; returns the total."""
        before = sum(committed_offsets(self.bootstrap, self.group, self.topic).values())

        def more() -> int:
            self.alive(proc, "waiting for a commit")
            total = sum(committed_offsets(self.bootstrap, self.group, self.topic).values())
            return total if total > before else 0

        try:
            return wait_until(more, timeout_s, interval_s=0.2, what="offsets being committed")
        except AssertionError as exc:
            raise ChaosFailure(f"{exc}\n{proc.describe()}") from None

    def dlq_positions(self) -> set[tuple[str, int, int]]:
        return {(t, p, o) for t, p, o in self.sql_admin(
            f'SELECT topic, "partition", "offset" FROM {DLQ_TABLE} WHERE pipeline = %s', (PIPELINE,))}

    # -- the invariants --------------------------------------------------------------------
    def read_log(self) -> dict[int, list[Msg]]:
        return read_topic(self.bootstrap, self.topic)

    def verify(self, *, log: dict[int, list[Msg]] | None = None,
               extra_keys: dict[str, int] | None = None) -> CaseResult:
        """Check every invariant against the log and fill in the result.

        ``extra_keys``: keys from data the broker lost (broker case) that may be in the sink with a
        seq up to the given one.
        """
        r = self.result
        log = self.read_log() if log is None else log
        expected, poison = self._expected(log)
        r.records = sum(len(m) for m in log.values())
        r.keys = len(expected)
        r.poison = len(poison)

        with psycopg.connect(self.admin_db_dsn, autocommit=True) as conn:
            rows = conn.execute("SELECT k, seq, val FROM sink").fetchall()
            audit = conn.execute("SELECT k, old_seq, new_seq, old_val, new_val FROM sink_audit ORDER BY id").fetchall()
            r.reapplied = conn.execute("SELECT count(*) FROM sink_reapplied").fetchone()[0]
            r.stale_suppressed = conn.execute("SELECT count(*) FROM sink_stale").fetchone()[0]
            dlq = conn.execute(
                f'SELECT topic, "partition", "offset", key, value, stage, error_class, attempts FROM {DLQ_TABLE} '
                "WHERE pipeline = %s", (PIPELINE,)).fetchall()

        # The sink: one row per good key, with the last value.
        seen = Counter(k for k, _, _ in rows)
        r.duplicated = sum(n - 1 for n in seen.values())
        sink = {k: (seq, val) for k, seq, val in rows}
        missing = [k for k in expected if k not in sink]
        stale = [k for k in expected if k in sink and sink[k][0] < expected[k][0]]
        wrong_val = [k for k in expected if k in sink and sink[k][0] == expected[k][0] and sink[k][1] != expected[k][1]]
        ahead = [k for k in expected if k in sink and sink[k][0] > expected[k][0]]
        allowed = extra_keys or {}
        extra = [k for k in sink if k not in expected and not (k in allowed and sink[k][0] <= allowed[k])]
        r.lost = len(missing) + len(stale)
        r.wrong = len(wrong_val) + len(ahead) + len(extra)
        if missing:
            r.problems.append(f"{len(missing)} keys missing from the sink, e.g. {missing[:5]} "
                              f"(expected {[expected[k][0] for k in missing[:5]]})")
        if stale:
            r.problems.append(f"{len(stale)} keys with an older seq than their last record, e.g. "
                              f"{[(k, sink[k][0], expected[k][0]) for k in stale[:5]]}")
        if wrong_val or ahead:
            r.problems.append(f"wrong values: {[(k, sink[k], expected[k]) for k in (wrong_val + ahead)[:5]]}")
        if extra:
            r.problems.append(f"{len(extra)} unexpected keys in the sink, e.g. {extra[:5]}")
        if r.duplicated:
            r.problems.append(f"{r.duplicated} duplicate rows in the sink")

        # No key applied out of order.
        r.misordered = len(audit)
        if audit:
            r.problems.append(f"{len(audit)} out-of-order updates (k, old seq, new seq): "
                              f"{[(a[0], a[1], a[2]) for a in audit[:8]]}")

        # The DLQ: exactly the poison records, once each.
        positions = Counter((t, p, o) for t, p, o, *_ in dlq)
        dup = sum(n - 1 for n in positions.values())
        want = {(self.topic, p, o) for (p, o) in poison}
        got = set(positions)
        problems = []
        if dup:
            problems.append(f"{dup} duplicate DLQ rows")
        if got - want:
            problems.append(f"{len(got - want)} DLQ rows that are not poison records, e.g. {sorted(got - want)[:5]}")
        if want - got:
            problems.append(f"{len(want - got)} poison records missing from the DLQ, e.g. {sorted(want - got)[:5]}")
        for t, p, o, key, value, stage, error_class, _attempts in dlq:
            known = poison.get((p, o))
            if t != self.topic or known is None:
                continue
            kind, msg = known
            if (stage, error_class) != EXPECTED_DLQ[kind] or bytes(value) != msg.value or bytes(key) != msg.key:
                problems.append(f"DLQ row {p}:{o} is {stage}/{error_class} (want {EXPECTED_DLQ[kind]}) or has "
                                "other bytes than the record")
        r.duplicated += dup
        r.lost += len(want - got)
        r.wrong += len(got - want)
        r.dlq_exact = not problems
        r.problems += problems
        redone = sum(1 for row in dlq if row[7] > 1)
        if redone:
            r.notes.append(f"{redone} DLQ rows dead-lettered more than once (attempts > 1: replays after faults)")

        # Committed offsets at the log end.
        ends = {p: (msgs[-1].offset + 1 if msgs else 0) for p, msgs in log.items()}
        want_committed = {p: e for p, e in ends.items() if e > 0}
        committed = committed_offsets(self.bootstrap, self.group, self.topic)
        r.committed_at_end = committed == want_committed
        if not r.committed_at_end:
            r.problems.append(f"committed offsets {committed} != log end {want_committed}")

        self.check_exits()
        r.seconds = time.monotonic() - self._t0
        if r.faults_injected == 0:
            r.problems.append("no fault was injected")
        r.notes.append(f"{r.reapplied} idempotent re-applications, {r.stale_suppressed} stale writes suppressed "
                       "by the version column")
        return r

    def _expected(self, log: dict[int, list[Msg]]
                  ) -> tuple[dict[str, tuple[int, str]], dict[tuple[int, int], tuple[str, Msg]]]:
        """Last (seq, val) per good key and the poison records by (partition, offset), from the log.

        Also checks the premise: per key, the log holds seq 1..n in offset order in one partition,
        and the log holds exactly what was produced.
        """
        last: dict[str, tuple[int, str]] = {}
        seqs: dict[str, int] = {}
        home: dict[str, int] = {}
        poison: dict[tuple[int, int], tuple[str, Msg]] = {}
        for p, msgs in log.items():
            for m in msgs:
                key = (m.key or b"").decode()
                kind = poison_kind(m.value)
                if kind is not None:
                    poison[(p, m.offset)] = (kind, m)
                if kind == BAD_JSON or key.startswith("poison-"):
                    continue
                doc = orjson.loads(m.value)  # type: ignore[arg-type]
                if home.setdefault(key, p) != p:
                    raise ChaosFailure(f"premise: key {key} in partitions {home[key]} and {p}")
                if doc["seq"] != seqs.get(key, 0) + 1:
                    raise ChaosFailure(f"premise: key {key} seq {doc['seq']} after {seqs.get(key)}")
                seqs[key] = doc["seq"]
                if kind is None:
                    last[key] = (doc["seq"], doc["val"])
        if last != self.stream.last or len(poison) != self.stream.poison:
            raise ChaosFailure(f"premise: the log holds {len(last)} keys / {len(poison)} poison records, "
                               f"produced {len(self.stream.last)} / {self.stream.poison}")
        return last, poison

    def committed_prefix_check(self, *, exact: bool) -> None:
        """Nothing is committed beyond what is written (right after a stop, before any other run).

        For each partition, every record below the committed offset must be in the sink (its key at
        that seq or later) or in the DLQ. ``exact`` (a clean stop): the sink holds exactly the
        records below the committed offsets, nothing newer.
        """
        committed = committed_offsets(self.bootstrap, self.group, self.topic)
        log = self.read_log()
        below: dict[str, int] = {}
        poison_below = set()
        for p, msgs in log.items():
            upto = committed.get(p, 0)
            for m in msgs:
                if m.offset >= upto:
                    break
                if poison_kind(m.value) is not None:
                    poison_below.add((self.topic, p, m.offset))
                else:
                    below[(m.key or b"").decode()] = orjson.loads(m.value)["seq"]  # type: ignore[arg-type]
        sink = dict(self.sql_admin("SELECT k, seq FROM sink"))
        behind = [(k, sink.get(k), s) for k, s in below.items() if sink.get(k, 0) < s]
        missing_dlq = poison_below - self.dlq_positions()
        what = f"committed {sum(committed.values())} of {sum(len(m) for m in log.values())} records"
        if behind:
            self.result.problems.append(f"{what}, but {len(behind)} keys are behind their committed records "
                                        f"(key, sink seq, committed seq): {behind[:5]}")
        if missing_dlq:
            self.result.problems.append(f"{what}, but {len(missing_dlq)} committed poison records are not in the "
                                        f"DLQ: {sorted(missing_dlq)[:5]}")
        if exact:
            ahead = [(k, s, below.get(k)) for k, s in sink.items() if s > below.get(k, 0)]
            if ahead:
                self.result.problems.append(f"clean stop: {len(ahead)} keys written beyond the committed offsets "
                                            f"(key, sink seq, committed seq): {ahead[:5]}")
            dlq_ahead = self.dlq_positions() - poison_below
            if dlq_ahead:
                self.result.problems.append(f"clean stop: {len(dlq_ahead)} DLQ rows beyond the committed offsets: "
                                            f"{sorted(dlq_ahead)[:5]}")
        self.say(f"prefix check ({'exact' if exact else 'covered'}): {what}, {len(below)} keys, "
                 f"{len(poison_below)} poison below the commit: "
                 f"{'ok' if not (behind or missing_dlq) else 'VIOLATED'}")


class Feeder(threading.Thread):
    """Produces ``rate_per_s`` records per second in chunks until finished."""

    def __init__(self, scn: Scenario, rate_per_s: float, chunk: int) -> None:
        super().__init__(name=f"chaos-feeder-{scn.case}", daemon=True)
        self.scn, self.rate, self.chunk = scn, rate_per_s, chunk
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                t0 = time.monotonic()
                self.scn.produce(self.chunk)
                self._stop_event.wait(max(0.0, self.chunk / self.rate - (time.monotonic() - t0)))
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc

    def finish(self) -> None:
        self._stop_event.set()
        self.join(60)
        if self.error is not None:
            raise ChaosFailure(f"producer failed: {self.error!r}")


def _events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(orjson.loads(line))
    return out


def revokes(proc: IngestProcess) -> int:
    return sum(1 for e in log_events(proc) if e.get("event") == "partitions revoked")


def log_count(proc: IngestProcess, needle: str) -> int:
    _, err = proc.output()
    return err.count(needle)


def _run_case(env: ChaosEnv, case: str, body: Callable[[Scenario], None], **scenario: Any) -> CaseResult:
    """Run ``body`` in a fresh Scenario; a failed step becomes a problem of the result, not a crash."""
    t0 = time.monotonic()
    with Scenario(env, case, **scenario) as scn:
        scn.say(f"seed {env.seed}, {'long' if env.long else 'short'} version")
        try:
            body(scn)
        except AssertionError as exc:  # ChaosFailure and wait_until's timeouts
            scn.result.problems.append(f"step failed: {exc}")
            scn.result.seconds = time.monotonic() - t0
        scn.say(("ok" if scn.result.ok else "FAILED") + f" in {scn.result.seconds:.1f}s")
        return scn.result


# --------------------------------------------------------------------------- fault cases


def case_sigkill(env: ChaosEnv) -> CaseResult:
    """SIGKILL at random moments, during a large flush, during a DLQ write; restart each time."""
    kills = env.size(3, 12)
    kinds = ["flush", "dlq", "random"]

    def body(scn: Scenario) -> None:
        small = scn.config(name="small.yaml")
        large = scn.config(max_rows=4000, max_latency_ms=2000, name="large.yaml")
        scn.produce(env.size(6_000, 30_000))
        with scn.feeding(env.size(1500, 2500)):
            for i in range(kills):
                kind = kinds[i % len(kinds)]
                since = scn.pg_now()
                proc = scn.start(large if kind == "flush" else small, f"run{i + 1}")
                scn.wait_assigned(proc)
                if kind == "flush":
                    scn.knob("flush_delay_s", 0.3)
                    seen = scn.wait_activity("flush", proc, since)
                    time.sleep(scn.rng.uniform(0.0, 0.2))
                elif kind == "dlq":
                    scn.knob("dlq_delay_s", 0.3)
                    scn.produce(300, poison_frac=0.05)  # poison arriving now
                    seen = scn.wait_activity("dlq", proc, since)
                    time.sleep(scn.rng.uniform(0.0, 0.2))
                else:
                    scn.wait_progress(proc)
                    time.sleep(scn.rng.uniform(0.1, 2.5))
                    seen = "random point"
                scn.kill9(proc, kind)
                scn.say(f"  killed during: {seen}")
                scn.knob("flush_delay_s", 0)
                scn.knob("dlq_delay_s", 0)
        scn.final_run()
        scn.verify()

    return _run_case(env, "sigkill", body, keys=env.size(1500, 6000))


def case_sigkill_rebalance(env: ChaosEnv) -> CaseResult:
    """Two processes; right after one logs "partitions revoked", SIGKILL one of them (alternately the
    joining one and the revoking one); the survivor must take everything over."""
    rounds = env.size(2, 6)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        with scn.feeding(env.size(1500, 2500)):
            a = scn.start(cfg, "A0")
            scn.wait_assigned(a)
            scn.wait_progress(a)
            for i in range(rounds):
                n_rev = revokes(a)
                b = scn.start(cfg, f"B{i}")
                try:
                    wait_until(lambda: revokes(a) > n_rev, 60, interval_s=0.02, what="A's revoke", proc=a)
                except AssertionError as exc:
                    raise ChaosFailure(str(exc)) from None
                victim, survivor = (b, a) if i % 2 == 0 else (a, b)
                n_assign = len(assignments(survivor))
                scn.kill9(victim, "rebalance " + ("joiner" if victim is b else "revoker"))
                try:
                    wait_until(lambda: len(assignments(survivor)) > n_assign
                               and len(assignments(survivor)[-1]) == PARTITIONS, 60, interval_s=0.05,
                               what=f"{scn.label(survivor)} holding all partitions", proc=survivor)
                except AssertionError as exc:
                    raise ChaosFailure(str(exc)) from None
                scn.wait_progress(survivor)
                a = survivor
            scn.stop(a)
        scn.final_run()
        scn.verify()

    return _run_case(env, "sigkill-rebalance", body, keys=env.size(1500, 6000))


def case_sigterm_flush(env: ChaosEnv) -> CaseResult:
    """SIGTERM while a large batch is being written: exit 0, and exactly the written records committed."""
    rounds = env.size(1, 3)

    def body(scn: Scenario) -> None:
        cfg = scn.config(max_rows=4000, max_latency_ms=60_000, shutdown_timeout_s=30)
        scn.produce(env.size(12_000, 40_000))
        with scn.feeding(env.size(1000, 2000)):
            for i in range(rounds):
                since = scn.pg_now()
                proc = scn.start(cfg, f"run{i + 1}")
                scn.wait_assigned(proc)
                scn.knob("flush_delay_s", 0.5)
                seen = scn.wait_activity("flush", proc, since)
                sent = time.monotonic()
                scn.alive(proc, "sending SIGTERM")
                scn.expect[proc.pid].add(EXIT_OK)
                proc.send_signal(signal.SIGTERM)
                scn.knob("flush_delay_s", 0)  # the flush in progress stays slow, the shutdown's are not
                try:
                    code = proc.wait(60)
                except subprocess.TimeoutExpired:
                    code = proc.kill9()
                took = time.monotonic() - sent
                if code != EXIT_OK:
                    scn.result.problems.append(f"SIGTERM during a flush: exit {code}, expected 0\n{proc.describe()}")
                scn.result.faults["sigterm during flush"] += 1
                scn.say(f"SIGTERM during {seen!r}: exit {proc.returncode} after {took:.1f}s")
                if took > 30:
                    scn.result.problems.append(f"SIGTERM took {took:.1f}s, over shutdown_timeout_s")
                scn.committed_prefix_check(exact=True)
        scn.final_run()
        scn.verify()

    return _run_case(env, "sigterm-flush", body, keys=env.size(1500, 6000))


def case_sigterm_twice(env: ChaosEnv) -> CaseResult:
    """SIGTERM during a slow flush, then a second SIGTERM: exit 130 at once, nothing committed that is
    not written; then the final run completes everything."""
    rounds = env.size(1, 3)

    def body(scn: Scenario) -> None:
        cfg = scn.config(max_rows=1500, max_latency_ms=60_000, shutdown_timeout_s=30)
        scn.produce(env.size(10_000, 30_000))
        with scn.feeding(env.size(1000, 2000)):
            for i in range(rounds):
                since = scn.pg_now()
                proc = scn.start(cfg, f"run{i + 1}")
                scn.wait_assigned(proc)
                scn.wait_committed(proc)  # so that "nothing committed beyond what is written" means something
                scn.knob("flush_delay_s", 2.0)  # every flush now takes > 2 s
                seen = scn.wait_activity("flush", proc, since)
                scn.alive(proc, "sending SIGTERM")
                scn.expect[proc.pid].add(EXIT_ABORTED)
                proc.send_signal(signal.SIGTERM)
                time.sleep(scn.rng.uniform(0.2, 0.6))
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                try:
                    code = proc.wait(20)
                except subprocess.TimeoutExpired:
                    code = None
                    scn.result.problems.append(f"second SIGTERM: no exit within 20s\n{proc.describe()}")
                    proc.kill9()
                took = time.monotonic() - sent
                scn.knob("flush_delay_s", 0)
                scn.result.faults["sigterm twice"] += 1
                scn.say(f"SIGTERM x2 during {seen!r}: exit {code} {took:.1f}s after the second signal")
                if code is not None and code != EXIT_ABORTED:
                    scn.result.problems.append(
                        f"second SIGTERM: exit {code}, expected {EXIT_ABORTED}\n{proc.describe()}")
                if took > 10:
                    scn.result.problems.append(f"second SIGTERM: exit took {took:.1f}s (should abort at once)")
                # Leftover statements of the aborted process end when their client is gone.
                wait_until(lambda: not scn.ingest_backends(), 30, interval_s=0.1, what="aborted backends gone")
                scn.committed_prefix_check(exact=False)
        scn.final_run()
        scn.verify()

    return _run_case(env, "sigterm-twice", body, keys=env.size(1500, 6000))


def case_pg_connections_killed(env: ChaosEnv) -> CaseResult:
    """pg_terminate_backend on every ingest connection, repeatedly, while it writes."""
    rounds = env.size(8, 40)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        with scn.feeding(env.size(1500, 2500)):
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_progress(proc)
            for _ in range(rounds):
                n = scn.terminate_ingest_backends()
                if n:
                    scn.result.faults["backends terminated"] += 1
                time.sleep(scn.rng.uniform(0.2, 0.8))
                scn.alive(proc, "its connections were being killed")
            scn.wait_progress(proc)
            retries = log_count(proc, "transient failure, retrying")
            scn.say(f"{scn.result.faults_injected} rounds of kills, {retries} retries logged")
            if retries == 0:
                scn.result.problems.append("connection kills never hit a write (no retry logged)")
            scn.stop(proc)
        scn.final_run()
        scn.verify()

    return _run_case(env, "pg-connections-killed", body, keys=env.size(1500, 6000))


def case_pg_slow(env: ChaosEnv) -> CaseResult:
    """The sink table locked (ACCESS EXCLUSIVE) for longer than the sink's statement_timeout_ms."""
    rounds = env.size(2, 6)
    hold_s = env.size(3.0, 5.0)

    def body(scn: Scenario) -> None:
        cfg = scn.config(statement_timeout_ms=1000)
        scn.produce(env.size(4_000, 20_000))
        with scn.feeding(env.size(1500, 2500)):
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_progress(proc)
            for _ in range(rounds):
                with psycopg.connect(scn.admin_db_dsn) as conn:  # one transaction
                    conn.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
                    scn.result.faults[f"sink locked {hold_s:.0f}s"] += 1
                    time.sleep(hold_s)
                scn.alive(proc, "the sink was locked")
                scn.wait_progress(proc)
            timeouts = log_count(proc, "statement timeout")
            scn.say(f"statement timeouts logged: {timeouts}")
            if timeouts == 0:
                scn.result.problems.append("the lock never made a write time out (no 'statement timeout' logged)")
            scn.stop(proc)
        scn.final_run()
        scn.verify()

    return _run_case(env, "pg-slow", body, keys=env.size(1500, 6000))


def case_pg_out_of_connections(env: ChaosEnv) -> CaseResult:
    """The database refuses new connections for a while (CONNECTION LIMIT 0, then 1) and ingest's
    connections are killed, so it must reconnect against the limit; then the limit is lifted."""
    rounds = env.size(2, 6)
    hold_s = env.size(3.0, 6.0)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        db = sql.Identifier(scn.dbname)
        with scn.feeding(env.size(1500, 2500)):
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_progress(proc)
            for i in range(rounds):
                limit = i % 2  # 0: no connection at all; 1: one connection for two pools
                with psycopg.connect(scn.pg_admin, autocommit=True) as conn:  # from `postgres`: not counted
                    conn.execute(sql.SQL("ALTER DATABASE {} CONNECTION LIMIT {}").format(db, sql.Literal(limit)))
                    try:
                        killed = scn.terminate_ingest_backends()
                        scn.result.faults[f"connection limit {limit}"] += 1
                        time.sleep(hold_s)
                        held = len(scn.ingest_backends())
                    finally:
                        conn.execute(sql.SQL("ALTER DATABASE {} CONNECTION LIMIT -1").format(db))
                scn.say(f"limit {limit} for {hold_s:.0f}s: killed {killed} connections, ingest held {held} meanwhile")
                scn.alive(proc, "the database refused connections")
                scn.wait_progress(proc)
            refused = log_count(proc, "too many connections")
            scn.say(f"'too many connections' seen {refused} times in ingest's log")
            if refused == 0:
                scn.result.problems.append(
                    "the connection limit never refused ingest ('too many connections' not logged)")
            scn.stop(proc)
        scn.final_run()
        scn.verify()

    return _run_case(env, "pg-out-of-connections", body, keys=env.size(1500, 6000))


def case_rebalance_storm(env: ChaosEnv) -> CaseResult:
    """A second process joins and leaves (SIGTERM after its assignment) again and again."""
    rounds = env.size(3, 10)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        with scn.feeding(env.size(1500, 2500)):
            a = scn.start(cfg, "A")
            scn.wait_assigned(a)
            scn.wait_progress(a)
            for i in range(rounds):
                n_a = len(assignments(a))
                b = scn.start(cfg, f"B{i}")
                scn.wait_assigned(b)  # only stopped after it got an assignment (see INFRA.md)
                time.sleep(scn.rng.uniform(0.2, 1.0))
                scn.stop(b)
                scn.result.faults["join+leave"] += 1
                try:
                    wait_until(lambda: len(assignments(a)) >= n_a + 2 and len(assignments(a)[-1]) == PARTITIONS,
                               60, interval_s=0.05, what="A holding all partitions again", proc=a)
                except AssertionError as exc:
                    raise ChaosFailure(str(exc)) from None
            scn.wait_progress(a)
            scn.stop(a)
        scn.final_run()
        scn.verify()

    return _run_case(env, "rebalance-storm", body, keys=env.size(1500, 6000))


def case_dlq_blocked(env: ChaosEnv) -> CaseResult:
    """The DLQ table locked, then renamed away and back, while poison records arrive: no committed
    offset passes an unwritten poison record meanwhile, and everything completes after."""
    faults = ["locked", "renamed"] * env.size(1, 3)
    hold_s = env.size(4.0, 6.0)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        windows: list[tuple[str, set[tuple[str, int, int]], list[dict[int, int]], dict[int, int]]] = []
        with scn.feeding(env.size(1500, 2500)):
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_progress(proc)
            for kind in faults:
                samples: list[dict[int, int]] = []
                stop = threading.Event()

                def sample() -> None:
                    while not stop.is_set():
                        with contextlib.suppress(Exception):
                            samples.append(committed_offsets(scn.bootstrap, scn.group, scn.topic))
                        stop.wait(0.2)

                sampler = threading.Thread(target=sample, daemon=True)
                with psycopg.connect(scn.admin_db_dsn) as conn:
                    if kind == "locked":
                        conn.execute(f"LOCK TABLE {DLQ_TABLE} IN ACCESS EXCLUSIVE MODE")
                        before = {(t, p, o) for t, p, o in conn.execute(
                            f'SELECT topic, "partition", "offset" FROM {DLQ_TABLE}').fetchall()}
                    else:
                        conn.execute(f"ALTER TABLE {DLQ_TABLE} RENAME TO {DLQ_TABLE}_away")
                        before = {(t, p, o) for t, p, o in conn.execute(
                            f'SELECT topic, "partition", "offset" FROM {DLQ_TABLE}_away').fetchall()}
                        conn.commit()  # the rename is visible; nothing can write the renamed table
                    scn.result.faults[f"DLQ {kind} {hold_s:.0f}s"] += 1
                    scn.produce(400, poison_frac=0.05)  # poison arriving while the DLQ cannot take it
                    sampler.start()
                    time.sleep(hold_s)
                    stop.set()
                    sampler.join(10)
                    ends = log_end_offsets(scn.bootstrap, scn.topic)  # what had arrived while blocked
                    if kind == "renamed":
                        conn.execute(f"ALTER TABLE {DLQ_TABLE}_away RENAME TO {DLQ_TABLE}")
                # (the transaction commits here: lock released / name restored)
                windows.append((kind, before, samples, ends))
                scn.alive(proc, f"the DLQ was {kind}")
                scn.say(f"DLQ {kind} for {hold_s:.0f}s: {len(samples)} commit samples")
                # Wait until the blocked poison records made it to the DLQ.
                wait_until(lambda: len(scn.dlq_positions()) > len(before), 60, interval_s=0.2,
                           what="dead-lettering to resume", proc=proc)
            scn.stop(proc)
        scn.final_run()
        log = scn.read_log()
        poison = [(scn.topic, p, m.offset) for p, msgs in log.items() for m in msgs
                  if poison_kind(m.value) is not None]
        for kind, before, samples, ends in windows:
            held = [x for x in poison if x not in before]  # could not be in the DLQ during the window
            arrived = [x for x in held if x[2] < ends.get(x[1], 0)]  # ... and were in the log meanwhile
            bad = [(x, s[x[1]]) for s in samples for x in held if s.get(x[1], 0) > x[2]]
            advanced = bool(samples) and any(samples[-1].get(p, 0) > samples[0].get(p, 0) for p in range(PARTITIONS))
            scn.say(f"DLQ {kind}: {len(samples)} commit samples; {len(arrived)} poison records arrived while the DLQ "
                    f"could not take them; commits {'moved' if advanced else 'did not move'} during the window; "
                    f"violations {len(bad)}")
            if not samples:
                scn.result.problems.append(f"DLQ {kind}: no committed-offset samples taken")
            if not arrived:
                scn.result.problems.append(f"DLQ {kind}: no poison record arrived while the DLQ was blocked")
            if bad:
                scn.result.problems.append(
                    f"DLQ {kind}: committed offsets passed unwritten poison records ((topic, partition, offset), "
                    f"committed): {bad[:5]}")
        scn.verify(log=log)

    return _run_case(env, "dlq-blocked", body, keys=env.size(1500, 6000))


# --------------------------------------------------------------------------- broker down (own broker)


class OwnBroker:
    """A Tansu broker (memory storage) this case owns: stop() / start() on the same port."""

    def __init__(self, work_dir: Path) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = Path(work_dir) / "tansu.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ChaosFailure(f"own broker exited {self.proc.returncode}; log {self.log_path}")
            try:
                kafka_check(self.bootstrap, timeout_s=1.0)
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise ChaosFailure(f"own broker not answering on {self.bootstrap}; log {self.log_path}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5)


def case_broker_down(env: ChaosEnv) -> CaseResult:
    """The broker (the case's own Tansu, memory storage) stops for a while and comes back empty; the
    topic is recreated. Checks that ingest neither crashes unrecoverably nor commits offsets that do
    not exist on the new log, and that data produced after the restart is ingested completely."""
    down_s = env.size(4.0, 8.0)
    broker = OwnBroker(Path(env.work_dir))
    broker.start()
    try:
        def body(scn: Scenario) -> None:
            cfg = scn.config()
            before = scn.stream
            before.poison_frac = 0.0  # DLQ rows are keyed by offset: keep poison to the post-restart log
            scn.produce(3_000)
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_committed(proc)
            close_producers(scn.bootstrap)
            broker.stop()
            scn.result.faults[f"broker down {down_s:.0f}s"] += 1
            scn.say(f"broker stopped for {down_s:.0f}s")
            time.sleep(down_s)
            broker.start()
            create_topic(scn.bootstrap, scn.topic, PARTITIONS)
            scn.say("broker back (empty); topic recreated")
            lost = {k: seq for k, (seq, _) in before.last.items()}
            scn.stream = Stream(scn.rng.randrange(2**31), env.size(1000, 4000), 0.004, prefix="b")  # new keys
            nonsense: list[str] = []
            stop = threading.Event()

            def sample() -> None:  # committed offsets must exist on the new log
                while not stop.is_set():
                    with contextlib.suppress(Exception):
                        ends = log_end_offsets(scn.bootstrap, scn.topic)
                        committed = committed_offsets(scn.bootstrap, scn.group, scn.topic)
                        over = {p: (c, ends.get(p, 0)) for p, c in committed.items() if c > ends.get(p, 0)}
                        if over:
                            nonsense.append(f"committed beyond the log end (partition: (committed, end)) {over}")
                    stop.wait(0.3)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                with scn.feeding(env.size(1500, 2500)):
                    time.sleep(env.size(5.0, 15.0))
                if proc.poll() is None:
                    want = {k: s for k, (s, _) in scn.stream.last.items()}

                    def caught_up() -> bool:
                        sink = dict(scn.sql_admin("SELECT k, seq FROM sink WHERE k LIKE 'b%'"))
                        return all(sink.get(k) == s for k, s in want.items())

                    try:
                        wait_until(caught_up, 30, interval_s=0.3, what="the running ingest to ingest the "
                                   "records produced after the broker restart", proc=proc)
                    except AssertionError as exc:
                        if proc.poll() is None:
                            scn.result.problems.append(f"after the broker restart: {str(exc)[:3000]}")
            finally:
                stop.set()
                sampler.join(10)
            if proc.poll() is None:
                scn.say(f"ingest survived the broker restart and ingested the new records; "
                        f"{len(nonsense)} samples with offsets beyond the log end")
                scn.stop(proc)
            else:
                scn.result.notes.append(f"ingest exited {proc.returncode} after the broker restart "
                                        "(a fresh run completed it)")
                scn.expect[proc.pid].add(proc.returncode)
                scn.result.restarts += 1
            if nonsense:
                scn.result.problems.append(f"{len(nonsense)} samples: " + "; ".join(nonsense[:3]))
            scn.final_run()
            scn.verify(extra_keys=lost)

        return _run_case(env, "broker-down", body, keys=env.size(1000, 4000), bootstrap=broker.bootstrap)
    finally:
        close_producers(broker.bootstrap)
        broker.stop()


# --------------------------------------------------------------------------- PostgreSQL restarted (own cluster)


def _pg_bindir() -> Path:
    """The newest local PostgreSQL server binaries (Debian layout, or pg_config --bindir)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: float(p.parts[-3])
                   if p.parts[-3].replace(".", "").isdigit() else 0.0)
    if found:
        return found[-1].parent
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if (Path(out) / "initdb").is_file():
            return Path(out)
    raise ChaosFailure("no PostgreSQL server binaries (initdb) found for the throwaway cluster")


class OwnPostgres:
    """A throwaway PostgreSQL cluster this case owns (initdb on a free port): restart() at will.

    Never the machine's shared server. As root the cluster runs as the ``postgres`` user.
    """

    def __init__(self) -> None:
        self.bindir = _pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="ingest-chaos-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            import pwd

            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as_owner = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str, timeout_s: float = 60.0) -> None:
        res = subprocess.run([*self._as_owner, *args], capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise ChaosFailure(f"{' '.join(args[:2])} failed ({res.returncode}): {res.stdout}{res.stderr}\n"
                               f"{_tail_file(self.root / 'pg.log')}")

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--no-sync")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w",
                  "-o", f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=50", "start")

    def restart(self, mode: str) -> None:
        """``fast`` (clean shutdown) or ``immediate`` (no shutdown checkpoint: crash recovery on start)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w",
                  "-m", mode, "restart")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-m", "immediate", "stop")
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


def _tail_file(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def case_pg_restart(env: ChaosEnv) -> CaseResult:
    """The case's own PostgreSQL cluster restarted while ingest writes (alternately a clean fast
    shutdown and an immediate one, which is crash recovery on start)."""
    rounds = env.size(2, 6)
    pg = OwnPostgres()
    try:
        pg.start()

        def body(scn: Scenario) -> None:
            cfg = scn.config()
            scn.produce(env.size(4_000, 20_000))
            with scn.feeding(env.size(1500, 2500)):
                proc = scn.start(cfg, "run1")
                scn.wait_assigned(proc)
                scn.wait_progress(proc)
                for i in range(rounds):
                    mode = ("fast", "immediate")[i % 2]
                    t0 = time.monotonic()
                    pg.restart(mode)
                    scn.result.faults[f"postgres restart {mode}"] += 1
                    scn.say(f"PostgreSQL restarted ({mode}) in {time.monotonic() - t0:.1f}s")
                    scn.alive(proc, "PostgreSQL restarted")
                    scn.wait_progress(proc)
                scn.stop(proc)
            scn.final_run()
            scn.verify()

        return _run_case(env, "pg-restart", body, keys=env.size(1500, 6000), pg_admin_dsn=pg.dsn)
    finally:
        pg.remove()


# --------------------------------------------------------------------------- a bug this runner found


def case_pg_read_only(env: ChaosEnv) -> CaseResult:
    """A failover seen from ingest: its sessions become read-only (``default_transaction_read_only`` for
    its role, and its connections killed so they reconnect into it), every write fails with 25006;
    then new sessions are writable again while the pooled ones stay read-only (the old primary, now a
    replica, still answers them). Expected: retried, never dead-lettered, and writing again without a
    restart -- a connection whose session is read-only must be replaced, not retried forever."""
    rounds = env.size(2, 4)
    hold_s = env.size(3.0, 5.0)

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        role, db = sql.Identifier(scn.role), sql.Identifier(scn.dbname)
        with scn.feeding(env.size(1500, 2500)):
            proc = scn.start(cfg, "run1")
            scn.wait_assigned(proc)
            scn.wait_progress(proc)
            for _ in range(rounds):
                with psycopg.connect(scn.pg_admin, autocommit=True) as conn:
                    conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} SET default_transaction_read_only = on")
                                 .format(role, db))
                    try:
                        scn.terminate_ingest_backends()
                        scn.result.faults[f"read-only sessions {hold_s:.0f}s"] += 1
                        time.sleep(hold_s)
                    finally:
                        conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} RESET default_transaction_read_only")
                                     .format(role, db))
                scn.alive(proc, "its sessions were read-only")
                scn.wait_progress(proc, timeout_s=30)  # with the read-only sessions still pooled
            refused = log_count(proc, "read-only transaction")
            scn.say(f"'read-only transaction' seen {refused} times in ingest's log")
            if refused == 0:
                scn.result.problems.append("no write ever met a read-only session ('read-only transaction' not logged)")
            scn.stop(proc)
        scn.final_run()
        scn.verify()

    return _run_case(env, "pg-read-only", body, keys=env.size(1500, 6000))


def case_sigstop(env: ChaosEnv) -> CaseResult:
    """Two members; one is frozen (SIGSTOP) -- at a random moment or in the middle of a flush -- for
    longer than the session timeout, so the group gives its partitions to the other; then SIGCONT. The
    frozen one wakes up with a write or a commit in hand for partitions it no longer owns: it must
    learn it lost them, commit nothing for them, and rejoin; no row may go backwards meanwhile."""
    rounds = env.size(2, 5)
    session_s = CONSUMER_SETTINGS["session.timeout.ms"] / 1000

    def body(scn: Scenario) -> None:
        cfg = scn.config()
        scn.produce(env.size(4_000, 20_000))
        with scn.feeding(env.size(1500, 2500)):
            a = scn.start(cfg, "A")
            scn.wait_assigned(a)
            b = scn.start(cfg, "B")
            scn.wait_assigned(b)
            scn.wait_progress(b)
            for i in range(rounds):
                frozen, other = (a, b) if i % 2 == 0 else (b, a)
                if i % 2 == 1:  # both members flush slowly now: the one frozen is likely in its own
                    scn.knob("flush_delay_s", 0.5)
                    seen = scn.wait_activity("flush", frozen, "-infinity")
                else:
                    time.sleep(scn.rng.uniform(0.1, 1.5))
                    seen = "random point"
                n_other, n_frozen = len(assignments(other)), len(assignments(frozen))
                gone_before = log_count(frozen, "partitions lost") + revokes(frozen)
                scn.alive(frozen, "freezing it")
                frozen.send_signal(signal.SIGSTOP)
                try:
                    scn.result.faults["SIGSTOP past the session timeout"] += 1
                    scn.say(f"SIGSTOP {scn.label(frozen)} during {seen!r}")
                    scn.knob("flush_delay_s", 0)
                    try:
                        wait_until(lambda: len(assignments(other)) > n_other
                                   and len(assignments(other)[-1]) == PARTITIONS, 60, interval_s=0.05,
                                   what=f"{scn.label(other)} holding all partitions", proc=other)
                    except AssertionError as exc:
                        raise ChaosFailure(str(exc)) from None
                    time.sleep(scn.rng.uniform(0.0, session_s))
                finally:
                    frozen.send_signal(signal.SIGCONT)
                scn.say(f"SIGCONT {scn.label(frozen)}")
                scn.alive(frozen, "it was frozen")
                try:
                    wait_until(lambda: log_count(frozen, "partitions lost") + revokes(frozen) > gone_before, 60,
                               interval_s=0.05, what=f"{scn.label(frozen)} noticing it lost its partitions",
                               proc=frozen)
                    wait_until(lambda: len(assignments(frozen)) > n_frozen, 60, interval_s=0.05,
                               what=f"{scn.label(frozen)} rejoining", proc=frozen)
                except AssertionError as exc:
                    raise ChaosFailure(str(exc)) from None
                scn.wait_progress(other)
            lost = log_count(a, "partitions lost") + log_count(b, "partitions lost")
            scn.say(f"'partitions lost' logged {lost} times")
            n_b = len(assignments(b))
            scn.stop(a)
            try:  # B is stopped only once its join after A left is over (a leave mid-join wedges Tansu's group)
                wait_until(lambda: len(assignments(b)) > n_b and len(assignments(b)[-1]) == PARTITIONS, 60,
                           interval_s=0.05, what="B holding all partitions", proc=b)
            except AssertionError as exc:
                raise ChaosFailure(str(exc)) from None
            scn.stop(b)
        scn.final_run()
        scn.verify()

    return _run_case(env, "sigstop", body, keys=env.size(1500, 6000))


def case_poison_same_key(env: ChaosEnv) -> CaseResult:
    """CHECK-violating records as the latest record of live keys, in one batch. Expected: the good
    records land (each key at its last good seq) and every poison record is in the DLQ. No outside
    fault: the "fault" is the data.

    A batch is collapsed by key to the latest record before the database judges it; when that
    record fails alone it is dead-lettered and the key's previous record is written instead
    (``ingest.core.isolation.write_groups_isolating``). Found by this runner: before that
    fallback, the earlier good records of such a key were neither written nor dead-lettered.
    (A constraint-violating record *superseded* inside its batch by a later good record of the
    same key is never sent to the database, so it is not detected; that is the documented upsert
    semantics, hence no "good, poison, good" pattern here.)
    """
    n = env.size(30, 150)

    def body(scn: Scenario) -> None:
        scn.produce(env.size(2_000, 10_000))  # an ordinary stream around it (keys k*)
        scn.produce(0, make=lambda st: st.pattern([f"c{i:05d}" for i in range(n)], "ggp"))
        scn.result.faults["CHECK violation latest of its key in a batch"] += n
        scn.produce(env.size(2_000, 10_000))
        scn.final_run()
        scn.verify()

    return _run_case(env, "poison-same-key", body, keys=env.size(1500, 6000))


CASES: dict[str, Callable[[ChaosEnv], CaseResult]] = {
    "sigkill": case_sigkill,
    "sigkill-rebalance": case_sigkill_rebalance,
    "sigterm-flush": case_sigterm_flush,
    "sigterm-twice": case_sigterm_twice,
    "pg-connections-killed": case_pg_connections_killed,
    "pg-slow": case_pg_slow,
    "pg-out-of-connections": case_pg_out_of_connections,
    "rebalance-storm": case_rebalance_storm,
    "dlq-blocked": case_dlq_blocked,
    "broker-down": case_broker_down,
    "pg-restart": case_pg_restart,
    "poison-same-key": case_poison_same_key,
    "pg-read-only": case_pg_read_only,
    "sigstop": case_sigstop,
}


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="the long version (>= 10 kills, bigger streams)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only this case (repeatable)")
    parser.add_argument("--seed", type=int, help="random seed (default: time; INGEST_CHAOS_SEED)")
    parser.add_argument("--work-dir", type=Path, help="where configs and ingest logs go (default: a temp dir)")
    args = parser.parse_args(argv)

    from harness.services import start_kafka, start_postgres

    kafka, pg = start_kafka(), start_postgres()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ingest-chaos-"))
    env = ChaosEnv(kafka.endpoint, pg.endpoint, work, long=args.long or os.environ.get("INGEST_CHAOS_LONG") == "1")
    if args.seed is not None:
        env.seed = args.seed
    print(f"chaos: {'long' if env.long else 'short'} run, seed {env.seed}, logs in {work}", flush=True)
    results = []
    try:
        for name in args.case or list(CASES):
            results.append(CASES[name](env))
            print(render_table(results[-1:]), flush=True)
    finally:
        close_producers(kafka.endpoint)
        kafka.stop()
        pg.stop()
    print("\n" + render_table(results))
    for r in results:
        if not r.ok:
            print("\n" + r.explain())
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Kafka → PostgreSQL benchmark: end-to-end beside its bounds, measured in one run.

    .venv/bin/python bench/pg_pipeline.py [--records 200000] [--naive-records 5000] [--rounds 3]
                                          [--format json|avro|protobuf|json_schema|both|all|json+json_schema|every]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded
PostgreSQL (pgserver), produces one topic of JSON records (6 partitions, ~110 B
each, 1/3 as many keys as records so many are updates), then measures on those
same records:

  (a) consume only     -- the broker's delivery rate to one confluent-kafka consumer
  (b) write path alone -- the same records pre-decoded, deduplicated per batch and
                          written by the same sink (COPY -> stage -> upsert), serially
  (c) plain COPY       -- the decoded rows COPY'd into a table without keys
  (d) naive consumer   -- one INSERT .. ON CONFLICT + one commit + one offset commit per record
  (e) end to end       -- ``ingest run`` as a subprocess (first record → last batch handled),
                          its peak RSS, and ingest's own CPU per record: user + sys of its
                          processes, less an ``ingest run`` of the same configuration on an
                          empty topic (start-up, group join, idle wait)

(e) runs with 1 and 4 lanes in one process, and with ``--processes 2`` and 1 or 2 lanes each, all
with the default settings (a pipeline of this stream has the columnar tier with any number of lanes,
issue #38), and once more as ``lanes=1, rows`` (``columnar: false``: the row path beside it).
``--configs version_column exactly-once`` adds, with 1 process and 1 lane, the same pipeline with
``version_column: ts`` and with ``delivery: exactly_once`` (each into a table of its own).
Two more streams run end to end in the first configuration (1 process, the first of ``--lanes``),
each right after its clean run in every round: (p) the same records with 0.1 % poison
(``common.poison_event``; the run must dead-letter exactly those) and (w) a wide stream
(``common.wide_event``: 16 columns, ~760 B, nested paths, a jsonb array), reported in records/s,
MB/s (key + value bytes) and CPU per record (ingest's own, the machine's). The script ends with
the hot-path targets (issue #19): every ratio from this run's medians, the fast path's hit rate
per configuration (the share written by the columnar tier, ``columnar_records``, or by rows
``records_mapped`` / ``fast_path_misses`` of the run summary); the poison stream also runs in
``lanes=1, rows``.
(a), (b), (c) and every (e) are measured ``--rounds`` times, interleaved (one round measures
each once), because this shared machine has slow spells of many seconds: the script prints
the best and the median of each and the ratios of the best figures (and of the medians)
e/min(a,b) and e/d. (a) and (b) each run
with the whole machine; end to end does both on the same cores, so the script
also measures the machine's busy CPU-seconds per record in (a) and (b) (every
process: broker, PostgreSQL, Python; from /proc/stat) and prints the cap that
puts on end to end: cores / (cpu_a + cpu_b).

``--format avro`` runs (e) on the same records in the Schema Registry wire format (a second topic:
same records, keys and partitions, values made by confluent-kafka's own AvroSerializer against the
Schema Registry stand-in of tests/harness/schema_registry.py, which the script starts), with
``format: avro`` and a ``schema_registry`` section in an otherwise identical configuration.
``--format protobuf`` does the same with Protobuf (bench/common.py's ``bench.Event`` message: the
decimal as text, ``ts`` a Timestamp; one ProtobufSerializer for every record) and ``format: protobuf``.
(a)-(d) always measure the JSON stream: the decoded rows are the same, so (b) and (c) do not
depend on the format. ``--format both`` runs every (e) on both streams, JSON and Avro back to
back in each round (their order alternating per round), prints the JSON table as ``--format
json`` does and then one table of both formats: records/s (best, median) and ingest's own CPU
per record (median) per configuration, the share of the records the columnar tier wrote (``lanes=1,
rows`` runs each format by rows: Avro's there is the row path it had before issue #38's tier), and
the ratios Avro/JSON of the medians. ``--format all``
does the same with JSON, Avro and Protobuf (their order rotating per round), adding Protobuf rows
and the ratios Protobuf/JSON. ``--format json_schema`` reads the records as confluent-kafka's
JSONSerializer makes them (the JSON after the wire-format prefix of a registered JSON Schema), and
``--format json+json_schema`` runs JSON and JSON Schema side by side as ``both`` does, and ``--format every``
all four formats. With Avro or Protobuf, the script checks that each of their
end-to-end tables (and, with ``both`` or ``all``, each JSON one) holds the stream's last record
per key, and exits non-zero when it does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
import psycopg
import yaml
from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.core.mapping import Mapper  # noqa: E402
from ingest.drivers.postgres import execute_ddl  # noqa: E402
from ingest.embedded import start_all  # noqa: E402
from ingest.sinks.postgres.schema import sink_table_sql  # noqa: E402
from ingest.sinks.postgres.settings import PostgresSinkSettings  # noqa: E402
from ingest.sinks.postgres.sink import PostgresSink  # noqa: E402
from ingest.tuning import tune_for_throughput  # noqa: E402
from ingest.types import Record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    CONSUMER,
    EVENT_AVRO_SCHEMA,
    PARTITIONS,
    WIDE_COLUMNS,
    BusySampler,
    Window,
    consume_all,
    cpu_cap,
    create_topic,
    event,
    event_avro_doc,
    event_message,
    event_message_class,
    hit_rate,
    paths,
    poison_count,
    poison_event,
    produce,
    records_cap,
    run_measured,
    wide_event,
)

#: tests/, for the test harness's Schema Registry stand-in and serializer helpers (``harness.*``).
TESTS = Path(__file__).resolve().parents[1] / "tests"

BATCH_ROWS = 5000
#: The end-to-end configuration by rows (``columnar: false``; 1 process, 1 lane, JSON): the default
#: configuration (``lanes=1``) has the columnar tier, this one measures the row path beside it.
ROWS = "lanes=1, rows"
#: ``--configs``: more configurations end to end (1 process, 1 lane, JSON), by label: (table tag, sink settings)
EXTRA_CONFIGS: dict[str, tuple[str, dict]] = {
    "lanes=1, version_column": ("_version", {"version_column": "ts"}),
    "lanes=1, exactly-once": ("_eo", {"delivery": "exactly_once"}),
}
COLUMNS = {
    "event_id": {"type": "bigint", "source": "$.id", "required": True},
    "user_id": {"type": "bigint", "source": "$.user"},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
}


#: Values of the configured columns in a mapped row (the sink appends its hidden source columns).
WIDTH = len(COLUMNS)

#: ``--format`` → the formats end to end reads, in the order of their first round.
FORMATS = {"json": ["json"], "avro": ["avro"], "protobuf": ["protobuf"], "json_schema": ["json_schema"],
           "both": ["json", "avro"], "all": ["json", "avro", "protobuf"], "json+json_schema": ["json", "json_schema"],
           "every": ["json", "avro", "protobuf", "json_schema"]}
#: The formats read through the Schema Registry (the script then starts its stand-in).
REGISTRY_FORMATS = ("avro", "protobuf", "json_schema")
NAMES = {"json": "JSON", "avro": "Avro", "protobuf": "Protobuf", "json_schema": "JSON Schema"}


def make_table(dsn: str, name: str, keyed: bool, columns: dict | None = None) -> None:
    """A keyed table exactly as ``ingest migrate`` creates it; an unkeyed one of the configured columns only."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')
        if not keyed:
            conn.execute(f'CREATE TABLE "{name}" (event_id bigint NOT NULL, user_id bigint, kind text, '
                         f'amount numeric(12,2), ts timestamptz)')
    if keyed:
        execute_ddl(dsn, "bench", sink_table_sql(sink_settings(dsn, name, columns)))


def sink_settings(dsn: str, table: str, columns: dict | None = None) -> PostgresSinkSettings:
    return PostgresSinkSettings(dsn=dsn, table=table, conflict_key=["event_id"], columns=columns or COLUMNS)


def write_path(dsn: str, rows: list[tuple]) -> Window:
    make_table(dsn, "bench_write_path", keyed=True)
    sink = PostgresSink(sink_settings(dsn, "bench_write_path"), pool_size=1)
    sink.write(rows[:1])  # open the pool outside the timing
    window = Window()
    window.start()
    for i in range(0, len(rows), BATCH_ROWS):
        dedup = {row[0]: row for row in rows[i:i + BATCH_ROWS]}
        sink.write(list(dedup.values()))
    window.stop()
    sink.close()
    return window


def plain_copy(dsn: str, rows: list[tuple]) -> float:
    make_table(dsn, "bench_copy", keyed=False)
    rows = [row[:WIDTH] for row in rows]  # the configured columns only (outside the timing)
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        with conn.cursor() as cur, cur.copy('COPY "bench_copy" (event_id, user_id, kind, amount, ts) FROM STDIN') as cp:
            for row in rows:
                cp.write_row(row)
        conn.commit()
        return time.perf_counter() - start


def naive(bootstrap: str, topic: str, dsn: str, mapper: Mapper, n: int) -> float:
    make_table(dsn, "bench_naive", keyed=True)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-naive-{uuid.uuid4().hex}", **CONSUMER})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    sql = ('INSERT INTO "bench_naive" (event_id, user_id, kind, amount, ts) VALUES (%s, %s, %s, %s, %s) '
           "ON CONFLICT (event_id) DO UPDATE SET user_id = EXCLUDED.user_id, kind = EXCLUDED.kind, "
           "amount = EXCLUDED.amount, ts = EXCLUDED.ts")
    done = 0
    start = None
    with psycopg.connect(dsn) as conn:
        while done < n:
            m = c.poll(1.0)
            if m is None or m.error() is not None:
                continue
            start = start or time.perf_counter()
            rec = Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
            row, _ = mapper.map(rec)
            conn.execute(sql, row[:WIDTH])
            conn.commit()
            c.commit(message=m, asynchronous=False)
            done += 1
    elapsed = time.perf_counter() - (start or time.perf_counter())
    c.close()
    return elapsed


def e2e_config(bootstrap: str, topic: str, dsn: str, table: str, lanes: int, registry_url: str | None = None,
               fmt: str = "avro", columns: dict | None = None, columnar: bool | None = None,
               sink_extra: dict | None = None) -> dict:
    """The end-to-end configuration; with ``registry_url``, the same one reading ``fmt`` (``avro``,
    ``protobuf`` or ``json_schema``; schemas from that Schema Registry); ``columnar``: the ``columnar`` setting (None: unset,
    the default: the columnar tier wherever it fits)."""
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "bench", "topics": [topic], "group_id": f"bench-e2e-{uuid.uuid4().hex}",
            "lanes": lanes, "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 200},
            "sink": {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": ["event_id"],
                     "columns": columns or COLUMNS, **(sink_extra or {})},
            "dlq": {"kind": "postgres", "table": "bench_dlq"},
        }],
    }
    if columnar is not None:
        cfg["pipelines"][0]["columnar"] = columnar
    if registry_url is not None:
        cfg["schema_registry"] = {"url": registry_url}
        cfg["pipelines"][0]["format"] = fmt
    return cfg


def start_registry():  # -> harness.schema_registry.SchemaRegistryStandIn
    """The test harness's Schema Registry stand-in, on an ephemeral port (no real registry installs here)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from harness.schema_registry import SchemaRegistryStandIn

    return SchemaRegistryStandIn()


def produce_avro(bootstrap: str, topic: str, n: int, registry_url: str) -> None:
    """The records :func:`common.produce` makes -- same values, keys, order, so the same partitions --
    as Avro in the wire format: one AvroSerializer (registering :data:`EVENT_AVRO_SCHEMA` under
    ``<topic>-value`` on its first call), reused for every record."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext
    from harness.serde import client

    serializer = AvroSerializer(client(registry_url), EVENT_AVRO_SCHEMA)
    ctx = SerializationContext(topic, MessageField.VALUE)
    produce(bootstrap, topic, n, value=lambda i, key: serializer(event_avro_doc(i, key), ctx))


def produce_protobuf(bootstrap: str, topic: str, n: int, registry_url: str) -> None:
    """The same records as Protobuf in the wire format: :func:`common.event_message` (the values of
    :func:`common.event_avro_doc`), one ProtobufSerializer (registering ``bench/event.proto`` under
    ``<topic>-value``, its Timestamp import as a reference, on its first call) reused for every record."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext
    from harness.serde import client

    cls = event_message_class()
    serializer = ProtobufSerializer(cls, client(registry_url), conf={"use.deprecated.format": False})
    ctx = SerializationContext(topic, MessageField.VALUE)
    produce(bootstrap, topic, n, value=lambda i, key: serializer(event_message(cls, i, key), ctx))


#: The benchmark record's JSON Schema (:func:`common.event`'s fields), for ``--format json_schema``.
EVENT_JSON_SCHEMA = {"type": "object", "title": "Event", "required": ["id"], "properties": {
    "id": {"type": "integer"}, "user": {"type": "integer"}, "kind": {"type": "string"},
    "amount": {"type": "number"}, "ts": {"type": "integer"}}}


def produce_json_schema(bootstrap: str, topic: str, n: int, registry_url: str) -> None:
    """The same records as JSON Schema values in the wire format: :func:`common.event`'s documents through
    one JSONSerializer (registering :data:`EVENT_JSON_SCHEMA` under ``<topic>-value`` on its first call,
    validating each record against it), reused for every record."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from confluent_kafka.schema_registry.json_schema import JSONSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext
    from harness.serde import client

    serializer = JSONSerializer(orjson.dumps(EVENT_JSON_SCHEMA).decode(), client(registry_url))
    ctx = SerializationContext(topic, MessageField.VALUE)
    produce(bootstrap, topic, n, value=lambda i, key: serializer(orjson.loads(event(i, key)), ctx))


#: ``format`` → how to produce the stream of it (JSON's is the main topic, produced first).
PRODUCERS = {"avro": produce_avro, "protobuf": produce_protobuf, "json_schema": produce_json_schema}
PRODUCED_AS = {"avro": "AvroSerializer", "protobuf": "ProtobufSerializer", "json_schema": "JSONSerializer"}


def check_table(dsn: str, table: str, expected: dict) -> int:
    """Whether ``table``'s configured columns hold exactly ``expected`` (event_id → row); its row count.
    Raises SystemExit naming the first difference otherwise."""
    with psycopg.connect(dsn) as conn:
        got = {row[0]: row for row in conn.execute(f'SELECT event_id, user_id, kind, amount, ts FROM "{table}"')}
    if got != expected:
        missing = sorted(expected.keys() - got.keys())[:3]
        extra = sorted(got.keys() - expected.keys())[:3]
        differ = [(k, expected[k], got[k]) for k in sorted(expected.keys() & got.keys()) if expected[k] != got[k]][:2]
        raise SystemExit(f"end-to-end table {table}: {len(got)} rows, expected {len(expected)}; "
                         f"missing {missing}, unexpected {extra}, different {differ}")
    return len(got)


def run_command(path: Path, processes: int, summary: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "ingest", "run", "-c", str(path), "--until-idle", "3",
           "--processes", str(processes), "--metrics-port", "0", "--log-level", "warning"]
    return cmd + (["--summary-json", str(summary)] if summary is not None else [])


def idle_cpu_s(bootstrap: str, dsn: str, lanes: int, processes: int, registry_url: str | None = None,
               fmt: str = "avro", columns: dict | None = None, columnar: bool | None = None,
               label: str = "") -> float:
    """CPU-seconds of ``ingest run`` (its own processes only) on an empty topic: start-up, group join
    and the idle wait, which the end-to-end runs also pay; subtracted to give ingest's CPU per record."""
    topic = f"bench-idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    table = f"bench_idle_{lanes}_{processes}{EXTRA_CONFIGS.get(label, ('', None))[0]}"
    make_table(dsn, table, keyed=True, columns=columns)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "idle.yaml"
        path.write_text(yaml.safe_dump(e2e_config(bootstrap, topic, dsn, table, lanes, registry_url, fmt, columns,
                                                  columnar, EXTRA_CONFIGS.get(label, ("", None))[1])))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return run_measured(run_command(path, processes), env=env)


def forget_stored_offsets(dsn: str, pipeline: str) -> None:
    """Delete what exactly-once delivery stored for ``pipeline`` (its partitions' and lanes' offsets), so a
    later round's run into a fresh table reads its topic from the start."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in ("ingest_offsets", "ingest_lane_offsets"):
            if conn.execute("SELECT to_regclass(%s)", [table]).fetchone()[0] is not None:
                conn.execute(f"DELETE FROM {table} WHERE pipeline = %s", [pipeline])


def end_to_end(bootstrap: str, topic: str, dsn: str, lanes: int, processes: int = 1,
               registry_url: str | None = None, fmt: str = "avro", tag: str = "", columns: dict | None = None,
               columnar: bool | None = None, label: str = "") -> dict:
    """``ingest run`` of ``topic`` (``fmt``, a registry format, with ``registry_url``; else JSON) into a fresh
    table (``tag`` in its name: another stream's table); ``columnar``: the ``columnar`` setting (None: unset)."""
    tag += "_rows" if columnar is False else ""
    extra_tag, sink_extra = EXTRA_CONFIGS.get(label, ("", None))
    tag += extra_tag
    table = (f"bench_e2e{tag}_{lanes}_{processes}" if registry_url is None
             else f"bench_e2e_{fmt}{tag}_{lanes}_{processes}")
    make_table(dsn, table, keyed=True, columns=columns)
    if (sink_extra or {}).get("delivery") == "exactly_once":
        forget_stored_offsets(dsn, "bench")  # a fresh table: the offsets an earlier round stored beside it too
    cfg = e2e_config(bootstrap, topic, dsn, table, lanes, registry_url, fmt, columns, columnar, sink_extra)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        with BusySampler() as busy:
            process_cpu_s = run_measured(run_command(path, processes, summary), env=env)
        data = orjson.loads(summary.read_bytes())
    stats = data["pipelines"]["bench"]
    # The machine's busy CPU inside the window: what end to end costs per record, every process counted.
    window = stats.get("busy_window_s") or [None, None]
    cpu_us = (busy.cpu_s(*window) / stats["records_consumed"] * 1e6
              if None not in window and stats["records_consumed"] else None)
    rate = stats["records_consumed"] / stats["busy_s"] if stats.get("busy_s") else stats["rate_per_s"]
    # With --processes, busy_s spans all children; how far apart they started (group join) is part of it.
    starts = [p["summary"]["pipelines"]["bench"]["busy_window_s"][0] for p in data.get("processes", [])
              if p.get("summary") and p["summary"]["pipelines"]["bench"].get("busy_window_s", [None])[0] is not None]
    # Pipelining (issue #38 item 4): the share of the window each lane spent writing (database round trips
    # and their waits) and the pipeline threads spent planning batches (decode, map) -- planning overlaps
    # the lanes' writes, so the two may add up past 100 %.
    busy_s = stats.get("busy_s") or 0
    lane_share = stats.get("lane_write_s", 0) / (lanes * processes * busy_s) if busy_s else None
    prepare_share = stats.get("prepare_s", 0) / (processes * busy_s) if busy_s else None
    return {"rate": rate, "rss": data.get("peak_rss_bytes", 0), "rows": stats["rows_written"], "cpu_us": cpu_us,
            "lane_share": lane_share, "prepare_share": prepare_share,
            "hit_rate": hit_rate(stats), "typed_hit_rate": hit_rate(stats, "typed_misses"), "dead_lettered": stats["dead_lettered"],
            "columnar_share": stats.get("columnar_records", 0) / stats["records_consumed"] if stats["records_consumed"] else None,
            "process_cpu_s": process_cpu_s, "table": table,
            "consumed": stats["records_consumed"], "stagger_s": max(starts) - min(starts) if len(starts) > 1 else None}


def print_targets(e2e: dict[str, list[dict]], e_med: dict[str, float], configs: list[tuple[str, int, int]],
                  poison_label: str, poison_runs: list[dict], a_med: float, b_med: float, cpu_a: float, cpu_b: float,
                  cores: int, idle: dict[str, float], n: int, rounds: int,
                  rows_poison_runs: list[dict] | None = None) -> dict:
    """The hot-path targets (medians of the rounds, every baseline from this run): one process with the
    default settings against min(a, b), ``--processes`` against b (beside the machine's CPU cap), ingest's
    own CPU per record, the poison stream against the clean one; returned for ``--json``."""
    one = configs[0][0]  # lanes = the first of --lanes (1 by default: the default settings)
    own_us = statistics.median((r["process_cpu_s"] - idle[one]) / n * 1e6 for r in e2e[one])
    out: dict = {"one_process": one, "one_process_vs_min_ab": e_med[one] / min(a_med, b_med),
                 "own_cpu_us_per_record": own_us}
    cap = records_cap(cores, cpu_a + cpu_b)
    print(f"\ntargets (medians of {rounds} rounds; a, b and the cap measured in this run):")
    print(f"  1 process ({one}): e / min(a,b) = {out['one_process_vs_min_ab']:.2f}   (target >= 0.9); "
          f"{paths(e2e[one])}")
    multi = [label for label, _, processes in configs if processes > 1]
    if multi:
        best = max(multi, key=e_med.__getitem__)
        out.update(processes=best, processes_vs_b=e_med[best] / b_med, cpu_cap=cap)
        print(f"  {best}: e / b = {out['processes_vs_b']:.2f}   (target >= 1.2; this machine's CPU caps e at "
              f"{cores} / ({cpu_a:.1f} + {cpu_b:.1f}) us = {cap:,.0f} records/s = {cap / b_med:.2f} x b)")
    print(f"  ingest's own CPU per record, {one}: {own_us:.2f} us   (target <= 4)")
    out["columnar_share"] = min(r["columnar_share"] or 0.0 for r in e2e[one])
    if poison_runs:
        poison_med = statistics.median(r["rate"] for r in poison_runs)
        out.update(poison_rate=poison_med, poison_vs_clean=poison_med / e_med[one],
                   poison_columnar_share=min(r["columnar_share"] or 0.0 for r in poison_runs))
        print(f"  0.1 % poison stream, {one}: {poison_med:,.0f} records/s, poison / clean = "
              f"{out['poison_vs_clean']:.2f}   (target >= 0.8); {paths(poison_runs)}, "
              f"{poison_runs[0]['dead_lettered']} dead letters = the poison records")
    if ROWS in e2e:
        rows_own = statistics.median((r["process_cpu_s"] - idle[ROWS]) / n * 1e6 for r in e2e[ROWS])
        out.update(rows_vs_min_ab=e_med[ROWS] / min(a_med, b_med), rows_own_cpu_us_per_record=rows_own,
                   rows_hit_rate=min(r["hit_rate"] or 0.0 for r in e2e[ROWS]))
        print(f"  row path ({ROWS}): e / min(a,b) = {out['rows_vs_min_ab']:.2f}, own CPU {rows_own:.2f} us per "
              f"record; {paths(e2e[ROWS])}; {one} / row path = x{e_med[one] / e_med[ROWS]:.2f} records/s")
        if rows_poison_runs:
            rate = statistics.median(r["rate"] for r in rows_poison_runs)
            out.update(rows_poison_vs_clean=rate / e_med[ROWS])
            print(f"  0.1 % poison stream, {ROWS}: {rate:,.0f} records/s, poison / clean = "
                  f"{out['rows_poison_vs_clean']:.2f}; {paths(rows_poison_runs)}, "
                  f"{rows_poison_runs[0]['dead_lettered']} dead letters = the poison records")
    return out


def _setting(label: str) -> bool | None:
    """The ``columnar`` setting of a configuration: false for the row path's, else unset (the default)."""
    return False if label == ROWS else None


def best_and_median(values: list[float]) -> tuple[float, float]:
    return max(values), statistics.median(values)


def compare_formats(runs: dict[str, dict[str, list[dict]]], idles: dict[str, dict[str, float]], n: int,
                    rounds: int, dsn: str, rows: list[tuple]) -> None:
    """The formats' end-to-end figures side by side (and, with JSON among them, the ratios of the medians of
    each other format to JSON's); then each format's end-to-end tables (of the last round) checked against
    the stream's last record per key."""
    for fmt, by_label in runs.items():
        for label, rs in by_label.items():
            for r in rs:
                assert r["consumed"] == n, f"end-to-end ({fmt}, {label}) consumed {r['consumed']} of {n}"
                r["ingest_cpu_us"] = (r["process_cpu_s"] - idles[fmt][label]) / n * 1e6
    # The same records as JSON (always: (a)-(d) read it) and as each registry format measured.
    names = ["JSON"] + [NAMES[fmt] for fmt in runs if fmt != "json"]
    ratios = [f"{fmt}/json" for fmt in runs if fmt != "json"] if "json" in runs else []
    width = max([12] + [len(r) + 1 for r in ratios])
    print(f"\nend to end by format: the same {n} records "
          + ", ".join(f"as {name}" for name in names[:-1]) + f" and as {names[-1]} (Schema Registry wire format); "
          f"{rounds} rounds, interleaved")
    print(f"{'configuration':<28}{'format':<{width}}{'best':>12}{'median':>12}{'own CPU us/record':>20}"
          f"{'columnar':>10}")
    for label in next(iter(runs.values())):
        med: dict[str, tuple[float, float]] = {}
        for fmt, by_label in runs.items():
            rs = by_label[label]
            best, median = best_and_median([r["rate"] for r in rs])
            med[fmt] = (median, statistics.median(r["ingest_cpu_us"] for r in rs))
            share = min(r["columnar_share"] or 0.0 for r in rs)  # the least any round wrote by columns
            print(f"{label:<28}{fmt:<{width}}{best:>12,.0f}{median:>12,.0f}{med[fmt][1]:>20.2f}{share:>10.1%}")
        for fmt in med:
            if fmt != "json" and "json" in med:
                print(f"{label:<28}{fmt + '/json':<{width}}{'':>12}"
                      f"{'x' + format(med[fmt][0] / med['json'][0], '.3f'):>12}"
                      f"{'x' + format(med[fmt][1] / med['json'][1], '.3f'):>20}")
    print("(best and median records/s; own CPU: user + sys of ingest's processes less its idle run, median; "
          "columnar: the share of the records the columnar tier wrote, the least of the rounds"
          + (f"; {', '.join(ratios)}: ratios of the medians)" if ratios else ")"))
    # What each end-to-end table must hold: the last record of each key (a key stays in one partition).
    expected = {row[0]: tuple(row[:WIDTH]) for row in rows}
    counts = {fmt: {label: check_table(dsn, rs[-1]["table"], expected) for label, rs in by_label.items()}
              for fmt, by_label in runs.items()}
    print("(end-to-end tables of the last round: " + "; ".join(
        f"{fmt} " + ", ".join(f"{label} {c} rows ({runs[fmt][label][-1]['rows']} written)" for label, c in by_label.items())
        for fmt, by_label in counts.items()) + f" -- each the stream's last record of each of its {len(expected)} keys)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--naive-records", type=int, default=5_000)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--processes", type=int, default=2, help="also run end to end with this many processes (0: skip)")
    ap.add_argument("--process-lanes", type=int, nargs="+", default=[1, 2],
                    help="lanes per process in the --processes runs")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure (a), (b), (c) and every (e) this many times, interleaved; report best and median")
    ap.add_argument("--format", choices=list(FORMATS), default="json",
                    help="the values end to end reads: JSON, Avro, Protobuf or JSON Schema (Schema Registry wire "
                         "format), JSON and Avro side by side (both), JSON, Avro and Protobuf (all), or JSON and "
                         "JSON Schema (json+json_schema), or all four (every), interleaved; "
                         "(a)-(d) always read the JSON stream")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    ap.add_argument("--no-wide", action="store_true",
                    help="skip the wide stream (16 columns, ~760 B, nested; end to end, 1 process, first of --lanes)")
    ap.add_argument("--no-rows", action="store_true",
                    help=f"skip the row path's configuration ({ROWS}, columnar: false; 1 process; every format)")
    ap.add_argument("--configs", nargs="*", default=[], choices=["version_column", "exactly-once"],
                    help="more configurations end to end (1 process, 1 lane): a version column (ts), "
                         "exactly-once delivery")
    ap.add_argument("--no-poison", action="store_true",
                    help="skip the 0.1 %%-poison stream (end to end, 1 process, lanes as the first of --lanes)")
    args = ap.parse_args()
    formats = FORMATS[args.format]
    #: The format of the main table's (e) rows (with ``both`` or ``all``, JSON: that table is then as with
    #: ``json``).
    primary = formats[0]

    services = start_all()
    registry = None
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic)
        t = time.perf_counter()
        produce(bootstrap, topic, args.records)
        print(f"produced {args.records} records in {time.perf_counter() - t:.1f} s", flush=True)
        poison_topic = None
        if not args.no_poison:
            poison_topic = f"bench-poison-{uuid.uuid4().hex[:8]}"
            create_topic(bootstrap, poison_topic)
            produce(bootstrap, poison_topic, args.records, poison_event)
            print(f"produced the same records with {poison_count(args.records)} poison ones (0.1 %) to "
                  f"{poison_topic}", flush=True)
        wide_topic, wide_bytes = None, 0
        if not args.no_wide:
            wide_topic = f"bench-wide-{uuid.uuid4().hex[:8]}"
            create_topic(bootstrap, wide_topic)
            produce(bootstrap, wide_topic, args.records, wide_event)
            keys = max(1, args.records // 3)
            wide_bytes = sum(len(wide_event(i, (i * 7919) % keys)) + len(str((i * 7919) % keys))
                             for i in range(args.records))
            print(f"produced the wide stream ({len(WIDE_COLUMNS)} columns, {wide_bytes / args.records:.0f} B of key "
                  f"and value per record) to {wide_topic}", flush=True)
        topics: dict[str, str] = {"json": topic}
        urls: dict[str, str | None] = {"json": None}
        for fmt in (f for f in formats if f in REGISTRY_FORMATS):
            if registry is None:
                registry = start_registry()
            topics[fmt], urls[fmt] = f"bench-{fmt}-{uuid.uuid4().hex[:8]}", registry.url
            create_topic(bootstrap, topics[fmt])
            t = time.perf_counter()
            PRODUCERS[fmt](bootstrap, topics[fmt], args.records, registry.url)
            print(f"produced the same {args.records} records as {NAMES[fmt]} (Schema Registry wire format, "
                  f"{PRODUCED_AS[fmt]}, registry stand-in at {registry.url}) in {time.perf_counter() - t:.1f} s",
                  flush=True)

        # (a)-(d) run under the same interpreter settings as `ingest run` (GC, switch interval).
        tune_for_throughput()
        n = args.records
        mapper = Mapper(sink_settings(dsn, "x").columns)
        configs = [(f"lanes={lanes}", lanes, 1) for lanes in args.lanes]
        if args.processes > 1:
            configs += [(f"processes={args.processes}, lanes={lanes}", lanes, args.processes)
                        for lanes in args.process_lanes]
        if not args.no_rows:  # with Avro / Protobuf too: the row path of each format beside its default
            configs.append((ROWS, 1, 1))
        configs += [(label, 1, 1) for label in EXTRA_CONFIGS if label.split(", ")[1] in args.configs]
        # One round measures everything once, so that a slow spell of this shared machine
        # hits every measure of that round rather than one measure of the whole run.
        rates: dict[str, list[float]] = {}
        windows: dict[str, list[Window]] = {"a": [], "b": []}
        by_format: dict[str, dict[str, list[dict]]] = {fmt: {label: [] for label, _, _ in configs} for fmt in formats}
        e2e = by_format[primary]
        rows: list[tuple] = []
        #: the poison stream, end to end in the first (default) configuration, right after its clean run
        poison_label = configs[0][0]
        poison_runs: list[dict] = []
        rows_poison_runs: list[dict] = []
        wide_runs: list[dict] = []
        for rnd in range(args.rounds):
            records, win_a = consume_all(bootstrap, topic, n)
            if not rows:
                rows = [mapper.map(r)[0] for r in records]
            del records
            win_b = write_path(dsn, rows)
            windows["a"].append(win_a)
            windows["b"].append(win_b)
            rates.setdefault("a", []).append(n / win_a.wall_s)
            rates.setdefault("b", []).append(n / win_b.wall_s)
            rates.setdefault("c", []).append(n / plain_copy(dsn, rows))
            for label, lanes, processes in configs:
                # With several formats, each configuration runs on each back to back, their order rotating
                # per round (both: JSON first in even rounds, Avro first in odd ones; all: JSON, Avro,
                # Protobuf first in turn), so a slow spell hits every format of it alike.
                shift = rnd % len(formats)
                for fmt in formats[shift:] + formats[:shift]:
                    by_format[fmt][label].append(end_to_end(bootstrap, topics[fmt], dsn, lanes, processes,
                                                            urls[fmt], fmt, columnar=_setting(label), label=label))
                if label == ROWS and poison_topic is not None:
                    rows_poison_runs.append(end_to_end(bootstrap, poison_topic, dsn, lanes, processes,
                                                       tag="_poison", columnar=False))
                    if rows_poison_runs[-1]["dead_lettered"] != poison_count(n):
                        raise SystemExit(f"the poison stream (by rows) dead-lettered "
                                         f"{rows_poison_runs[-1]['dead_lettered']} records, expected {poison_count(n)}")
                if label == poison_label and poison_topic is not None:
                    poison_runs.append(end_to_end(bootstrap, poison_topic, dsn, lanes, processes, tag="_poison"))
                    if poison_runs[-1]["dead_lettered"] != poison_count(n):
                        raise SystemExit(f"the poison stream dead-lettered {poison_runs[-1]['dead_lettered']} "
                                         f"records, expected {poison_count(n)}")
                if label == poison_label and wide_topic is not None:
                    wide_runs.append(end_to_end(bootstrap, wide_topic, dsn, lanes, processes, tag="_wide",
                                                columns=WIDE_COLUMNS))
                    if wide_runs[-1]["dead_lettered"] or wide_runs[-1]["consumed"] != n:
                        raise SystemExit(f"the wide stream: {wide_runs[-1]}")
            print(f"round {rnd + 1}/{args.rounds}: a {rates['a'][-1]:,.0f}  b {rates['b'][-1]:,.0f}  "
                  + "  ".join(f"e[{k if fmt == 'json' else fmt + ' ' + k}] {v[-1]['rate']:,.0f}"
                              for fmt in formats for k, v in by_format[fmt].items()), flush=True)
        d = args.naive_records / naive(bootstrap, topic, dsn, mapper, args.naive_records)
        idles = {fmt: {label: idle_cpu_s(bootstrap, dsn, lanes, processes, urls[fmt], fmt,
                                         columnar=_setting(label), label=label)
                       for label, lanes, processes in configs} for fmt in formats}
        idle = idles[primary]

        (a, a_med), (b, b_med), (c, c_med) = (best_and_median(rates[k]) for k in "abc")
        print(f"\nrecords: {n} over {PARTITIONS} partitions, {n // 3} keys, batch {BATCH_ROWS} rows; "
              f"{args.rounds} rounds (best, median)"
              + ("" if primary == "json" else f"; (e) reads the {primary} stream, (a)-(d) the JSON one"))
        print(f"{'measure':<44}{'best':>12}{'median':>12}")
        print(f"{'(a) consume only':<44}{a:>12,.0f}{a_med:>12,.0f}")
        print(f"{'(b) write path alone (COPY->stage->upsert)':<44}{b:>12,.0f}{b_med:>12,.0f}")
        print(f"{'(c) plain COPY of decoded rows':<44}{c:>12,.0f}{c_med:>12,.0f}")
        print(f"{'(d) naive consumer (' + str(args.naive_records) + ' records, once)':<44}{d:>12,.0f}")
        e_best: dict[str, float] = {}
        e_med: dict[str, float] = {}
        for label, runs in e2e.items():
            for r in runs:
                assert r["consumed"] == n, f"end-to-end consumed {r['consumed']} of {n}"
            e_best[label], e_med[label] = best_and_median([r["rate"] for r in runs])
            rss = max(r["rss"] for r in runs)
            staggers = [r["stagger_s"] for r in runs if r.get("stagger_s") is not None]
            extra = f"   peak RSS {rss / 2**20:.0f} MiB" if rss else ""
            if staggers:
                extra += f", first records {min(staggers):.2f}-{max(staggers):.2f} s apart (group join)"
            extra += f", {paths(runs)}"
            cpus = [r["cpu_us"] for r in runs if r.get("cpu_us")]
            if cpus:
                extra += f", machine CPU {statistics.median(cpus):.1f} us/record"
            own = [(r["process_cpu_s"] - idle[label]) / n * 1e6 for r in runs]
            for r, us in zip(runs, own):
                r["ingest_cpu_us"] = us
            extra += f", ingest's own CPU {statistics.median(own):.2f} us/record (median; idle run {idle[label]:.2f} s)"
            shares = [(r["lane_share"], r["prepare_share"]) for r in runs if r.get("lane_share") is not None]
            if shares:
                extra += (f", each lane writing {statistics.median(s[0] for s in shares):.0%} of the window while "
                          f"the pipeline thread planned {statistics.median(s[1] for s in shares):.0%} (medians)")
            name = "(e) ingest run, " if primary == "json" else f"(e) ingest run ({primary}), "
            print(f"{name + label:<44}{e_best[label]:>12,.0f}{e_med[label]:>12,.0f}{extra}")
        best = max(e_best.values())
        median_best = max(e_med.values())
        print(f"\nratio e/min(a,b) = {best / min(a, b):.2f} (medians: {median_best / min(a_med, b_med):.2f})   "
              f"e/b = {best / b:.2f}   e/c = {best / c:.2f}   e/d = {best / d:.0f}x")
        # (a) and (b) each had the whole machine; end to end must do both on the same cores.
        win_a = windows["a"][rates["a"].index(a)]
        win_b = windows["b"][rates["b"].index(b)]
        (cpu_a, cpu_b), cores, bound = cpu_cap(n, win_a, win_b)
        print(f"machine CPU per record (broker + PostgreSQL + Python, all processes): (a) {cpu_a:.1f} us, "
              f"(b) {cpu_b:.1f} us\n-> doing both on these {cores} cores caps end to end at "
              f"{cores} / ({cpu_a:.1f} + {cpu_b:.1f}) us = {bound:,.0f} records/s;   e / that cap = {best / bound:.2f}")
        # End to end also decodes, maps and tracks every record, which neither (a) nor (b) does: its own
        # CPU per record (in the run that gave the best e) caps it at cores / cpu_e, whatever the overlap.
        best_label = max(e_best, key=e_best.__getitem__)
        best_run = max(e2e[best_label], key=lambda r: r["rate"])
        if best_run.get("cpu_us"):
            cpu_e = best_run["cpu_us"]
            cap_e = cores * 1e6 / cpu_e
            print(f"end to end ({best_label}, best run) cost {cpu_e:.1f} us of machine CPU per record "
                  f"-> at most {cores} / {cpu_e:.1f} us = {cap_e:,.0f} records/s here, "
                  f"= {cap_e / min(a, b):.2f} x min(a,b);   e / that cap = {best / cap_e:.2f}")
        targets = print_targets(e2e, e_med, configs, poison_label, poison_runs, a_med, b_med, cpu_a, cpu_b, cores,
                                idle, n, args.rounds, rows_poison_runs)
        if wide_runs:
            lanes, processes = configs[0][1], configs[0][2]
            wide_idle = idle_cpu_s(bootstrap, dsn, lanes, processes, columns=WIDE_COLUMNS)
            wide_rate = statistics.median(r["rate"] for r in wide_runs)
            wide_own = statistics.median((r["process_cpu_s"] - wide_idle) / n * 1e6 for r in wide_runs)
            wide_cpu = [r["cpu_us"] for r in wide_runs if r.get("cpu_us")]
            targets.update(wide_rate=wide_rate, wide_mb_s=wide_rate * wide_bytes / n / 1e6,
                           wide_own_cpu_us_per_record=wide_own,
                           wide_machine_cpu_us_per_record=statistics.median(wide_cpu) if wide_cpu else None)
            print(f"  wide stream ({len(WIDE_COLUMNS)} columns, {wide_bytes / n:.0f} B, nested), {poison_label}: "
                  f"{wide_rate:,.0f} records/s = {targets['wide_mb_s']:.1f} MB/s; ingest's own CPU {wide_own:.2f} us"
                  + (f", the machine's {targets['wide_machine_cpu_us_per_record']:.1f} us" if wide_cpu else "")
                  + f" per record (median of {len(wide_runs)}; idle run {wide_idle:.2f} s)")
        if any(fmt in REGISTRY_FORMATS for fmt in formats):
            compare_formats(by_format, idles, n, args.rounds, dsn, rows)
        if args.json:
            extra_json = {} if primary == "json" and len(formats) == 1 else {"format": args.format}
            for fmt in formats[1:]:  # both: avro; all: avro, protobuf (JSON's are "end_to_end")
                extra_json[f"end_to_end_{fmt}"] = {
                    k: {"rate": max(r["rate"] for r in v), "median": statistics.median(r["rate"] for r in v),
                        "ingest_cpu_us_per_record": [r["ingest_cpu_us"] for r in v], "idle_cpu_s": idles[fmt][k],
                        "peak_rss_bytes": max(r["rss"] for r in v)} for k, v in by_format[fmt].items()}
            args.json.write_bytes(orjson.dumps({
                "records": n, "rounds": args.rounds, "consume_only": a, "write_path": b, "plain_copy": c,
                "naive": d, "medians": {"consume_only": a_med, "write_path": b_med, "plain_copy": c_med},
                "cpu_us_per_record": {"consume_only": cpu_a, "write_path": cpu_b}, "cpu_bound": bound,
                "targets": targets,
                "end_to_end": {k: {"rate": e_best[k], "median": e_med[k],
                                   "cpu_us_per_record": [r["cpu_us"] for r in e2e[k]],
                                   "ingest_cpu_us_per_record": [r["ingest_cpu_us"] for r in e2e[k]],
                                   "idle_cpu_s": idle[k],
                                   "peak_rss_bytes": max(r["rss"] for r in e2e[k])} for k in e2e},
                **extra_json,
            }, option=orjson.OPT_INDENT_2))
    finally:
        if registry is not None:
            registry.stop()
        services.close()


if __name__ == "__main__":
    main()

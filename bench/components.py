"""The per-record CPU floor of ingest's hot path, stage by stage, on the pipeline bench's stream.

    .venv/bin/python bench/components.py [--records 200000] [--rounds 3]

Runs each stage of the hot path alone over the same records of ``bench/pg_pipeline.py``'s
stream (embedded broker and PostgreSQL, or ``$INGEST_PG_DSN``), ``--rounds`` times, and prints
the CPU each costs per record (best and median of the rounds) and their sum:

  consume   -- a bare confluent-kafka ``consume()`` loop with ingest's consumer settings:
               process CPU, librdkafka's own threads included
  records   -- :class:`~ingest.sources.kafka.KafkaSource`'s ``poll`` less the bare loop: building
               a ``Record`` per message (both measured in the same round)
  map       -- ``Mapper.map`` of every record (the compiled fast path; the bench stream takes its
               typed tier), this thread's CPU
  prepare   -- ``BatchWriter.prepare`` of every batch of ``BATCH_ROWS`` items (collapse by key,
               done offsets, size and oldest timestamp), this thread's CPU
  write     -- ``PostgresSink.write`` of every prepared batch's rows (COPY → stage → upsert, one
               transaction each): the Python process's CPU, the server's excluded

What it leaves out, so the sum is a floor, not the end-to-end figure: the accept loop itself
(offset tracking, routing, the ``Item`` of each record, the batchers), the lane's bookkeeping
around the write, and what running all of it in one process under one GIL adds (cold caches,
lock hand-offs). ``bench/pg_pipeline.py`` measures ingest's own CPU end to end; the
difference between the two is that remainder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import create_topic, produce  # noqa: E402
from confluent_kafka import Consumer  # noqa: E402
from pg_pipeline import BATCH_ROWS, WIDTH, check_table, make_table, sink_settings  # noqa: E402

from ingest.config import KafkaSettings, RetrySettings  # noqa: E402
from ingest.core.collapse import CollapseRule  # noqa: E402
from ingest.core.mapping import Mapper  # noqa: E402
from ingest.embedded import start_all  # noqa: E402
from ingest.sinks.postgres.sink import PostgresSink  # noqa: E402
from ingest.sources.kafka import KafkaSource, consumer_config  # noqa: E402
from ingest.tuning import tune_for_throughput  # noqa: E402
from ingest.types import Item, Partition, Record  # noqa: E402
from ingest.runner.writer import BatchWriter  # noqa: E402

STAGES = ("consume", "records", "map", "prepare", "write")


class _Listener:
    """Takes whatever the group assigns; reads from the committed offsets (none: the earliest)."""

    def on_assign(self, partitions: list[Partition]) -> None:
        return None

    def on_revoke(self, partitions: list[Partition]) -> None:
        pass

    def on_lost(self, partitions: list[Partition]) -> None:
        pass


def _read_all(poll: Callable[[], list], n: int) -> tuple[list, float]:
    """Poll until ``n`` items came; the process CPU-seconds from the first non-empty poll on."""
    got: list = []
    cpu0 = None
    while len(got) < n:
        if cpu0 is None:
            start = time.process_time()
        batch = poll()
        if batch and cpu0 is None:
            cpu0 = start
        got += batch
    assert len(got) == n, f"read {len(got)} of {n}"
    return got, time.process_time() - (cpu0 or 0.0)


def bare_consume(kafka: KafkaSettings, topic: str, n: int) -> float:
    consumer = Consumer(consumer_config(kafka, f"bench-floor-{uuid.uuid4().hex}"))
    consumer.subscribe([topic])
    try:
        _, cpu_s = _read_all(lambda: consumer.consume(num_messages=kafka.consume_batch_size, timeout=1.0), n)
    finally:
        consumer.close()
    return cpu_s


def source_poll(kafka: KafkaSettings, topic: str, n: int) -> tuple[list[Record], float]:
    source = KafkaSource(kafka, f"bench-floor-{uuid.uuid4().hex}", [topic], _Listener())
    try:
        return _read_all(lambda: source.poll(kafka.consume_batch_size, 1.0), n)
    finally:
        source.close()


def thread_cpu_s(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def one_round(kafka: KafkaSettings, topic: str, dsn: str, n: int) -> dict[str, float]:
    """Every stage once; CPU-seconds per stage. Exits non-zero (``check_table``) when the table the
    writes filled does not hold each key's last record."""
    consume_s = bare_consume(kafka, topic, n)
    records, poll_s = source_poll(kafka, topic, n)
    mapper = Mapper(sink_settings(dsn, "bench_floor").columns)
    mapped: list[tuple] = []
    map_s = thread_cpu_s(lambda: mapped.extend(mapper.map(rec)[0] for rec in records))
    items = [Item(rec, row, None, 1, len(rec.value or b"") + len(rec.key or b"") + 64)
             for rec, row in zip(records, mapped, strict=True)]
    batches = [items[i:i + BATCH_ROWS] for i in range(0, n, BATCH_ROWS)]
    writer = BatchWriter(pipeline="bench", write=lambda rows, **_: None, dlq=None,  # type: ignore[arg-type]
                         retry=RetrySettings(), collapse_rule=CollapseRule((0,)), abort=threading.Event())
    prepared: list = []
    prepare_s = thread_cpu_s(lambda: prepared.extend(writer.prepare(batch) for batch in batches))
    make_table(dsn, "bench_floor", keyed=True)
    sink = PostgresSink(sink_settings(dsn, "bench_floor"), pool_size=1)
    try:
        sink.write([mapped[0]])  # the pool and the stage, outside the timing
        rows = [[group[0].row for group in p.groups] for p in prepared]
        start = time.process_time()
        for batch_rows in rows:
            sink.write(batch_rows)
        write_s = time.process_time() - start
    finally:
        sink.close()
    # the writes did happen: the table holds each key's last record, as end to end
    check_table(dsn, "bench_floor", {row[0]: tuple(row[:WIDTH]) for row in mapped})
    return {"consume": consume_s, "records": poll_s - consume_s, "map": map_s, "prepare": prepare_s,
            "write": write_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    services = start_all()
    kafka = KafkaSettings(bootstrap_servers=services.bootstrap)
    topic = f"bench-floor-{uuid.uuid4().hex[:8]}"
    create_topic(services.bootstrap, topic)
    produce(services.bootstrap, topic, args.records)
    tune_for_throughput()  # as `ingest run` does
    rounds = [one_round(kafka, topic, services.pg_dsn, args.records) for _ in range(args.rounds)]
    us = {stage: [r[stage] / args.records * 1e6 for r in rounds] for stage in STAGES}
    print(f"per-record CPU by stage, {args.records} records of the pipeline bench's stream, {args.rounds} rounds")
    print(f"{'stage':10s} {'best µs':>8s} {'median µs':>10s}")
    for stage in STAGES:
        print(f"{stage:10s} {min(us[stage]):8.2f} {statistics.median(us[stage]):10.2f}")
    total = [sum(r[stage] for stage in STAGES) / args.records * 1e6 for r in rounds]
    print(f"{'sum':10s} {min(total):8.2f} {statistics.median(total):10.2f}   (the issue's target for all of it: 4 µs)")


if __name__ == "__main__":
    main()

"""A real PostgreSQL failover mid-run: the primary is killed and its synchronous replica promoted.

ingest writes through a multi-host DSN (``host=a,b port=p1,p2
target_session_attrs=read-write``), as the README's "Operations" section tells
users to. Mid-run the primary is stopped with ``-m immediate`` (its connections
die, no shutdown checkpoint) and the replica promoted
(:class:`harness.pg_cluster.ReplicatedPostgres`). ingest must find the new
primary by itself and finish the topic:

- ``at_least_once`` into a keyed table: the table equals the model of the topic;
- ``exactly_once`` into an append-only table: every record exactly once (a commit
  whose acknowledgement died with the primary is on the replica, synchronous
  replication, and the stored offsets say so);

and in both: nothing dead-lettered, the committed offsets at the log end.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import start_ingest
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from harness.pg_cluster import ReplicatedPostgres

from pipeline_helpers import (
    OrderGen,
    SteadyProducer,
    assert_committed_at_log_end,
    assert_table_equals,
    count_rows,
    dlq_rows,
    expected_from_log,
    pipeline_config,
    read_topic,
    seed_for,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(300)

NETWORK = {"client_timeout_ms": 5_000, "connect_timeout_s": 2}
RETRY = {"max_attempts": 60, "initial_backoff_ms": 100, "max_backoff_ms": 1000}
RECORDS = 6000


def _keyed(bootstrap: str, topic: str, group: str, dsn: str) -> dict[str, Any]:
    cfg = pipeline_config(bootstrap=bootstrap, topic=topic, group=group, dsn=dsn, lanes=2,
                          batch={"max_rows": 500, "max_latency_ms": 100}, retry=RETRY)
    cfg["pipelines"][0]["sink"]["network"] = NETWORK
    cfg["pipelines"][0]["dlq"] = {"network": NETWORK}
    return cfg


def _append_only(bootstrap: str, topic: str, group: str, dsn: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "orders", "topics": [topic], "group_id": group, "lanes": 2, "commit_interval_ms": 200,
            "shutdown_timeout_s": 10, "batch": {"max_rows": 500, "max_latency_ms": 100}, "retry": RETRY,
            "sink": {
                "kind": "postgres", "dsn": dsn, "table": "orders", "on_conflict": "none",
                "delivery": "exactly_once", "network": NETWORK,
                "columns": {
                    "order_id": {"type": "bigint", "source": "$.order_id", "required": True},
                    "seq": {"type": "bigint"},
                    "part": {"type": "bigint", "source": "@partition"},
                    "off": {"type": "bigint", "source": "@offset"},
                },
            },
            "dlq": {"kind": "postgres", "network": NETWORK},
        }],
    }


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_a_failover_to_the_synchronous_replica_loses_and_dead_letters_nothing(delivery, kafka_bootstrap, new_topic,
                                                                             group_id, tmp_path: Path):
    topic = new_topic(partitions=3)
    gen = OrderGen(seed_for(f"pg-failover-{delivery}"))
    with ReplicatedPostgres() as pair:
        pair.create_database("app")
        build = _keyed if delivery == "at_least_once" else _append_only
        config = write_and_migrate(tmp_path, build(kafka_bootstrap, topic, group_id, pair.dsn("app")))
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc)
        producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.05, limit=RECORDS)
        producer.start()
        wait_until(lambda: count_rows(pair.direct(pair.primary_port, "app")) >= 800, 60,
                   what="rows on the primary before the failover", proc=proc)
        took_s = pair.fail_over()
        print(f"failover (immediate stop + promote) took {took_s:.2f}s")
        producer.finish()
        # Records produced after the failover can only land on the new primary (whether or not a write
        # was in flight when the primary died: the pool may replace its dead connections unnoticed).
        assert produce(kafka_bootstrap, topic, gen.next(1000)) == 1000
        try:
            proc.wait(180)
        except Exception:  # noqa: BLE001 - say where it hung
            proc.kill9()
            raise AssertionError(f"ingest did not finish after the failover\n{proc.describe()}") from None
        assert proc.returncode == 0, proc.describe()
        new_primary = pair.direct(pair.replica_port, "app")
        log = read_topic(kafka_bootstrap, topic)
        if delivery == "at_least_once":
            assert_table_equals(new_primary, expected_from_log(log))
        else:
            with psycopg.connect(new_primary) as conn:
                stored = Counter(conn.execute("SELECT part, off FROM orders").fetchall())
            want = {(p, m.offset) for p, msgs in log.items() for m in msgs}
            assert set(stored) == want, f"missing {sorted(want - set(stored))[:5]}, extra {sorted(set(stored) - want)[:5]}"
            twice = [k for k, n in stored.items() if n > 1]
            assert not twice, f"{len(twice)} records written twice by exactly_once, e.g. {twice[:5]}"
        assert dlq_rows(new_primary) == [], "the failover dead-lettered good rows"
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


"""The broker behind a fault proxy: a silent broker connection mid-run.

A broker of the test's own advertises a :class:`~harness.faultproxy.FaultProxy`'s
address (:func:`~harness.faultproxy.proxied_broker`), so every connection of
ingest's consumer -- bootstrap, group coordinator, partition leaders -- crosses
the proxy. Mid-run the proxy goes silent (no reset: a dropped flow). The
client's own timeouts (``socket.timeout.ms``, the session timeout) must notice:

- an outage shorter than the bound: the pipeline resumes on new connections
  without a restart, and ends with the table equal to the topic's model and the
  committed offsets at the log end;
- an outage that outlasts ``kafka.outage_timeout_s``: the pipeline stops with exit 1 and an error
  naming the broker outage, and commits nothing it has not written.

PostgreSQL is reached directly: only the broker's network breaks here.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from harness import start_ingest
from harness.faultproxy import proxied_broker
from harness.kafka import committed_offsets, create_topic, produce

from pipeline_helpers import (
    OrderGen,
    SteadyProducer,
    assert_committed_at_log_end,
    assert_committed_records_written,
    assert_table_equals,
    count_rows,
    dlq_rows,
    expected_from_log,
    pipeline_config,
    read_topic,
    seed_for,
    table_rows,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(240)

#: librdkafka's bound on one request (the default is 60 s): a silent connection is given up after it.
SOCKET_TIMEOUT_MS = 4_000


def _config(bootstrap: str, topic: str, group: str, dsn: str, **kafka: Any) -> dict[str, Any]:
    cfg = pipeline_config(bootstrap=bootstrap, topic=topic, group=group, dsn=dsn, lanes=2,
                          batch={"max_rows": 500, "max_latency_ms": 100},
                          retry={"max_attempts": 40, "initial_backoff_ms": 100, "max_backoff_ms": 1000})
    cfg["kafka"]["client"]["socket.timeout.ms"] = SOCKET_TIMEOUT_MS
    cfg["kafka"].update(kafka)
    return cfg


def test_a_silent_broker_connection_is_given_up_and_the_pipeline_resumes(pg_dsn, tmp_path: Path):
    gen = OrderGen(seed_for("kafka-blackhole"))
    with proxied_broker() as (proxy, bootstrap):
        topic, group = "orders-blackhole", "g-orders-blackhole"
        create_topic(bootstrap, topic, 3)
        config = write_and_migrate(tmp_path, _config(bootstrap, topic, group, pg_dsn))
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc)
        assert produce(bootstrap, topic, gen.next(2000)) == 2000
        wait_until(lambda: count_rows(pg_dsn) >= 300, 60, what="rows before the blackhole", proc=proc)
        proxy.blackhole()
        time.sleep(8)
        assert proc.poll() is None, f"ingest stopped during a short broker outage\n{proc.describe()}"
        proxy.heal()
        # A new producer: the cached one's connections died in the blackhole (its retry would land
        # the records after ingest went idle).
        assert produce(bootstrap, topic, gen.next(2000), config={"client.id": "after-the-outage"}) == 2000
        try:
            proc.wait(150)
        except Exception:  # noqa: BLE001 - say where it hung
            proc.kill9()
            raise AssertionError(f"ingest did not resume after the broker came back\n{proc.describe()}") from None
        assert proc.returncode == 0, proc.describe()
        assert_table_equals(pg_dsn, expected_from_log(read_topic(bootstrap, topic)))
        assert dlq_rows(pg_dsn) == []
        assert_committed_at_log_end(bootstrap, group, topic)


def test_a_broker_outage_past_its_bound_stops_the_pipeline_committing_only_what_it_wrote(pg_dsn, tmp_path: Path):
    gen = OrderGen(seed_for("kafka-outage-bound"))
    with proxied_broker() as (proxy, bootstrap):
        topic, group = "orders-outage", "g-orders-outage"
        create_topic(bootstrap, topic, 3)
        config = write_and_migrate(tmp_path, _config(bootstrap, topic, group, pg_dsn, outage_timeout_s=8))
        proc = start_ingest(["run", "-c", config, "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc)
        producer = SteadyProducer(bootstrap, topic, gen, chunk=100, interval_s=0.05, limit=4000)
        producer.start()
        wait_until(lambda: count_rows(pg_dsn) >= 300, 60, what="rows before the outage", proc=proc)
        # A commit before the outage, so the check below has committed records to look at.
        wait_until(lambda: sum(committed_offsets(bootstrap, group, topic).values()) > 0, 60,
                   what="a commit before the outage", proc=proc)
        proxy.blackhole()
        silenced_at = time.monotonic()
        try:
            proc.wait(90)
        except Exception:  # noqa: BLE001 - say where it hung
            proc.kill9()
            raise AssertionError(f"ingest kept waiting past kafka.outage_timeout_s\n{proc.describe()}") from None
        waited_s = time.monotonic() - silenced_at
        proxy.heal()
        with contextlib.suppress(RuntimeError):  # its records in flight met the blackhole too
            producer.finish()
        err = proc.output()[1]
        assert proc.returncode == 1, proc.describe()
        assert "kafka.outage_timeout_s" in err and ("have not answered for" in err or "waited" in err), proc.describe()
        # The bound: librdkafka notices (socket timeout, ~9 s here) + the outage bound + a probe interval.
        assert waited_s < 9 + 8 + 5 + 10, waited_s
        # Nothing committed that is not in the table: each key's row is its last record below the
        # committed offset or a later one (written, not yet committed when the process stopped).
        committed = committed_offsets(bootstrap, group, topic)
        assert sum(committed.values()) > 0, committed
        assert_committed_records_written(read_topic(bootstrap, topic), committed, table_rows(pg_dsn))
        assert dlq_rows(pg_dsn) == []

"""Shared fixtures: real PostgreSQL and a real Kafka-protocol broker.

Services start lazily, once per session, only when a test asks for them (unit
tests start nothing). Where they come from: ``INGEST_TEST_PG_DSN`` /
``INGEST_TEST_KAFKA``, else testcontainers when Docker answers, else the local
PostgreSQL on 127.0.0.1:5432 and a Tansu broker subprocess (see
``harness/services.py``). A service that cannot be had fails the test; it is
never skipped.

Fixtures:
    kafka_bootstrap  (session)  "host:port"
    kafka_service    (session)  the broker's Service (``kind``: env | docker | local = Tansu)
    pg_admin_dsn     (session)  DSN of database ``postgres`` (admin rights)
    pg_dsn           (function) ``postgresql://`` URL of a fresh empty database, dropped afterwards
    new_topic        (function) ``new_topic(partitions=6, name=None) -> str``, deleted afterwards
    group_id         (function) a fresh consumer group id
    clickhouse_server (session) the ClickHouse Service (``INGEST_TEST_CLICKHOUSE_URL``, else
                     testcontainers, else Debian's clickhouse-server 18.16 as a subprocess whose
                     ``handle`` (harness.services.LocalClickHouse) can stop/start it)
    clickhouse_url   (session)  ``http://[user:password@]host:port`` of that server
    schema_registry  (function) a fresh Schema Registry stand-in (``.url``, ``.register``, ``.fault``,
                     ``.stop``/``.start``, ``.hide``/``.reveal``; see harness/schema_registry.py)
    chdb             (function) a fresh chDB (in-process ClickHouse) path for this test:
                     ``chdb.url`` (``chdb:///...``), ``chdb.path``, ``chdb.client()``; clients
                     are closed afterwards (one engine path per process at a time)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
from harness import live_ingest_processes, reap_ingest_processes
from harness.clickhouse import ChdbSession
from harness.kafka import close_producers, create_topic, delete_topics, unique_name
from harness.schema_registry import SchemaRegistryStandIn
from harness.services import (
    Service,
    ServiceError,
    start_clickhouse,
    start_kafka,
    start_postgres,
    temp_database,
)

_started: list[Service] = []


def _start(starter: Callable[[], Service]) -> Service:
    try:
        svc = starter()
    except ServiceError as exc:
        error = str(exc)
    else:
        _started.append(svc)
        return svc
    pytest.fail(f"test service unavailable: {error}", pytrace=False)


@pytest.fixture(scope="session")
def kafka_service() -> Iterator[Service]:
    svc = _start(start_kafka)
    try:
        yield svc
    finally:
        close_producers(svc.endpoint)
        svc.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_service: Service) -> str:
    return kafka_service.endpoint


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    svc = _start(start_postgres)
    try:
        yield svc.endpoint
    finally:
        svc.stop()


@pytest.fixture
def pg_dsn(pg_admin_dsn: str) -> Iterator[str]:
    with temp_database(pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def clickhouse_server() -> Iterator[Service]:
    svc = _start(start_clickhouse)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def clickhouse_url(clickhouse_server: Service) -> str:
    return clickhouse_server.endpoint


@pytest.fixture
def chdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbSession]:
    session = ChdbSession(tmp_path_factory.mktemp("chdb") / "db")
    try:
        yield session
    finally:
        session.close()


@pytest.fixture
def new_topic(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    created: list[str] = []

    def factory(partitions: int = 6, name: str | None = None) -> str:
        topic = name or unique_name("t", request.node.name, max_len=100)
        create_topic(kafka_bootstrap, topic, partitions)
        created.append(topic)
        return topic

    yield factory
    # Best effort: frees broker memory on long runs; a failure here is not the test's fault.
    with contextlib.suppress(Exception):
        delete_topics(kafka_bootstrap, created)


@pytest.fixture
def schema_registry() -> Iterator[SchemaRegistryStandIn]:
    """A fresh Schema Registry stand-in (:mod:`harness.schema_registry`) on an ephemeral port."""
    registry = SchemaRegistryStandIn()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture
def group_id(request: pytest.FixtureRequest) -> str:
    return unique_name("g", request.node.name, max_len=100)


@pytest.fixture(autouse=True)
def _reap_ingest_processes() -> Iterator[None]:
    """Kill ``start_ingest`` processes a test left running (older ones, e.g. from a
    module-scoped fixture, are kept)."""
    before = live_ingest_processes()
    yield
    reap_ingest_processes(keep=before)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _started:
        terminalreporter.write_sep("-", "ingest test services")
        for svc in _started:
            terminalreporter.write_line(svc.describe())

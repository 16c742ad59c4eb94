"""ClickHouse helpers for tests: chDB sessions, server URLs, and the 18.16 shim.

The shim
--------
clickhouse-connect 1.12 cannot connect to ClickHouse 18.16 (Debian's, the only
server installable on the development machines): its start-up query
``SELECT name, value, readonly FROM system.settings`` names a column 18.16
lacks ("Unknown identifier: readonly"). :class:`Server1816Client` rewrites
that one query to ``SELECT name, value, toUInt8(0) AS readonly ...`` and
changes nothing else. It lives here, in test code only: the product refuses
servers older than 22.8 with a clear error (``ingest.sinks.clickhouse``), and
tests use the shim to drive the sink's HTTP write path (connection refused,
server restart) against the real 18.16 server through ``client_factory``.
On 18.16, also: no lz4 request bodies (use gzip or none), no
``insert_deduplication_token`` (the sink then sends none), and no
``non_replicated_deduplication_window`` (create tables with
:func:`create_table_sql_for`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from clickhouse_connect.driver.httpclient import HttpClient

_STARTUP_QUERY = "SELECT name, value, readonly FROM system.settings"
_STARTUP_QUERY_1816 = "SELECT name, value, toUInt8(0) AS readonly FROM system.settings"


class Server1816Client(HttpClient):
    """clickhouse-connect's HTTP client with the one start-up query 18.16 cannot run rewritten."""

    def _prep_query(self, context: Any) -> str:
        query = super()._prep_query(context)
        return query.replace(_STARTUP_QUERY, _STARTUP_QUERY_1816) if isinstance(query, str) else query


def split_url(url: str) -> tuple[str, str, str]:
    """``http://user:pw@host:port`` -> (``http://host:port``, user, password); user defaults to ``default``."""
    parts = urlsplit(url)
    plain = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], "", "", ""))
    return plain, unquote(parts.username or "default"), unquote(parts.password or "")


def sink_conn(url: str) -> dict[str, str]:
    """The ``url`` / ``user`` / ``password`` keys of a ClickHouse sink config for a test server URL."""
    plain, user, password = split_url(url)
    return {"url": plain, "user": user, "password": password}


def server_version(url: str) -> tuple[int, ...]:
    from harness.services import clickhouse_ping

    return tuple(int(p) for p in clickhouse_ping(url).split(".")[:3] if p.isdigit())


def needs_shim(url: str) -> bool:
    """True for servers clickhouse-connect cannot connect to unaided (older than 22.8)."""
    return server_version(url)[:2] < (22, 8)


def http_client(url: str, *, compress: str | bool = "gzip", **kwargs: Any) -> Any:
    """A clickhouse-connect HTTP client for a test server, with the 18.16 shim when it needs it."""
    import clickhouse_connect

    plain, user, password = split_url(url)
    parts = urlsplit(plain)
    args = dict(host=parts.hostname, port=parts.port, username=user, password=password,
                compress=compress, autogenerate_session_id=False, query_retries=0, **kwargs)
    if needs_shim(url):
        return Server1816Client(interface=parts.scheme, database="default", **args)
    return clickhouse_connect.get_client(interface=parts.scheme, **args)


def create_table_sql_for(url: str, statements: list[str]) -> list[str]:
    """``create_table_sql`` output adapted to the server: 18.16 has no deduplication-window settings."""
    if not needs_shim(url):
        return statements
    return [s.split("\nSETTINGS ")[0] for s in statements]


class ChdbSession:
    """A fresh chDB data path for one test, and the clients opened on it.

    chDB runs one engine path per process at a time: close every client (or
    the session) before another test opens another path, and before a
    subprocess is given the path, do not hold it open here.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.url = f"chdb://{self.path}"
        self._clients: list[Any] = []

    def client(self) -> Any:
        import clickhouse_connect

        client = clickhouse_connect.get_client(dsn=self.url)
        self._clients.append(client)
        return client

    def close(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()

    def __repr__(self) -> str:
        return f"ChdbSession({self.url})"

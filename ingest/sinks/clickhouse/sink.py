"""ClickHouse sink: one columnar insert per batch into a ``ReplacingMergeTree`` table.

Write path: the batch (already collapsed by ``order_by`` key in the writer,
the last consumed record of each key winning) is transposed into columns and
sent with one ``client.insert(..., column_oriented=True, column_names=...,
column_type_names=...)``: types are passed explicitly, so no ``DESCRIBE`` round
trip is needed, and the values are exactly what the mapper produced for those
types (``ingest.core.mapping``, ClickHouse dialect: range-checked, so the
Native encoder never wraps a value silently).

Guarantees, honestly:

- **At least once from Kafka**: offsets are committed only after the insert
  returned, so a crash replays the uncommitted records.
- **Effectively once in the table, at read time**: the table is
  ``ReplacingMergeTree(version)`` ordered by ``order_by``. A replayed record
  inserts a second copy of a row with the same key and version; background
  merges collapse copies to one row per key (the highest version, the last
  inserted among equal versions) *eventually*. Queries are exact with
  ``SELECT ... FINAL`` (or after ``OPTIMIZE TABLE ... FINAL``); without FINAL a
  query may see duplicates until parts merge.
- **What the insert token adds**: every insert carries
  ``insert_deduplication_token`` = :func:`ingest.sinks.base.dedup_token` of the
  exact (topic, partition, offset) set behind its rows. When a batch is retried
  unchanged (the insert timed out or the connection broke after the server
  committed it, or clickhouse-connect replayed it after a remote close), the
  server recognises the token and drops the second insert: no duplicate part is
  written at all. The table remembers the last ``deduplication_window`` tokens
  (``non_replicated_deduplication_window`` / ``replicated_deduplication_window``).
  A replay after a restart usually forms *different* batches, hence other
  tokens: those copies are the ones ReplacingMergeTree collapses. Servers
  without the setting (before 22.2) get no token.
- **Version**: ``version_column`` (UInt*, Date or DateTime64) decides which
  row wins; by default a hidden ``_version UInt64`` column holds the Kafka
  offset, which orders records of one partition -- fine when a key always maps
  to one partition (keyed topics), wrong otherwise (then configure a column).
- **Atomicity**: an insert of one block (<= ``max_insert_block_size`` rows,
  1M by default; a batch is far smaller) is atomic. A failed insert is retried
  or split whole (shared isolation in ``ingest.core.isolation``); re-inserting
  rows that did land is harmless for the reasons above.

Connections: ``http(s)://`` URLs use clickhouse-connect's HTTP client (one
client shared by the lanes; no session id, so concurrent inserts are fine).
``chdb://path`` / ``chdb://memory`` use its in-process chDB backend (modern
ClickHouse in this process; one engine path per process, so the process must
own the path; calls are serialised). A server older than
:data:`MIN_SERVER_VERSION` is refused with a clear message (clickhouse-connect
cannot even finish its start-up query against e.g. 18.16, and the insert
token needs 22.2+).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from ingest.core.dialects import ch_quote_ident, ch_type
from ingest.core.mapping.columnar import StagedColumn
from ingest.errors import (
    IngestError,
    MigrationError,
    PermanentError,
    ServiceUnreachable,
    TransientError,
    UnclassifiedError,
)
from ingest.sinks.base import InTransaction
from ingest.sinks.clickhouse.arrow import ArrowEncoder, ColumnarConverter
from ingest.sinks.clickhouse.errors import classify, error_code
from ingest.sinks.clickhouse.settings import DELETED_COLUMN, ClickHouseSinkSettings
from ingest.mirror.router import table_of, without_table
from ingest.sinks.clickhouse.children import ChildTable
from ingest.types import DeleteRow

if TYPE_CHECKING:
    from ingest.sinks.clickhouse.auto import AutoTable, ClickHouseAutoTables, InsertData

log = logging.getLogger(__name__)

#: Oldest ClickHouse server this sink supports: an LTS with insert_deduplication_token (22.2+),
#: non_replicated_deduplication_window, Bool and the system.settings.readonly column that
#: clickhouse-connect's start-up query reads.
MIN_SERVER_VERSION: tuple[int, int] = (22, 8)
_MIN_TEXT = ".".join(map(str, MIN_SERVER_VERSION))

#: Builds a connected clickhouse-connect client (tests inject one; see ``client_factory``).
ClientFactory = Callable[[], Any]


# --------------------------------------------------------------------------- SQL text helpers


#: A ClickHouse identifier in backquotes (backslash and backquote escaped).
quote_ident = ch_quote_ident


def quote_str(value: str) -> str:
    """A ClickHouse string literal in single quotes."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def parse_version(text: str) -> tuple[int, ...]:
    """``'24.8.4.13'`` -> ``(24, 8, 4, 13)``; stops at the first part that is not a number."""
    parts: list[int] = []
    for piece in text.strip().split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def is_chdb_url(url: str) -> bool:
    return url.startswith("chdb:")


def redact_url(url: str) -> str:
    """The URL without user info (a password could be written there by mistake)."""
    if is_chdb_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def too_old_message(version: str) -> str:
    try:
        from clickhouse_connect import __version__ as cc_version  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover
        cc_version = "?"
    return (
        f"ClickHouse server version {version} is older than the minimum supported {_MIN_TEXT} "
        f"(clickhouse-connect {cc_version} cannot connect to it -- its start-up query reads "
        "system.settings.readonly -- and insert_deduplication_token needs 22.2+); "
        f"upgrade the server to {_MIN_TEXT} or later"
    )


def server_version_http(cfg: ClickHouseSinkSettings, timeout_s: float | None = None) -> str:
    """Ask an HTTP(S) server for ``version()`` with a plain request (works on every version).

    Raises clickhouse-connect-independent errors: urllib3 errors when unreachable,
    ``RuntimeError`` with the server's text when it answers with an error.
    """
    import urllib3

    parts = urlsplit(cfg.url)
    base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path.rstrip("/"), "", ""))
    headers = urllib3.make_headers(basic_auth=f"{cfg.user}:{cfg.password.get_secret_value()}")
    timeout = timeout_s or cfg.connect_timeout_s
    with urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=timeout, read=timeout)) as http:
        resp = http.request("GET", f"{base}/", fields={"query": "SELECT version()"}, headers=headers)
    body = resp.data.decode("utf-8", "replace").strip()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {body[:300]}")
    return body


def _too_old(version: str) -> bool:
    parsed = parse_version(version)
    return bool(parsed) and parsed[:2] < MIN_SERVER_VERSION


# --------------------------------------------------------------------------- the sink


class ClickHouseSink:
    """Writes batches into one ClickHouse table; see the module docstring for the guarantees.

    Thread-safe. ``client_factory`` replaces how the clickhouse-connect client is
    built (tests use it for a server clickhouse-connect cannot connect to on its
    own); without it an ``http(s)`` server is first asked for its version, and
    one older than :data:`MIN_SERVER_VERSION` is refused. Construction probes an
    HTTP server once (so ``ingest run`` fails at start-up, with a clear message,
    against a too-old server) but tolerates an unreachable one: writes retry.
    """

    def __init__(self, cfg: ClickHouseSinkSettings, *, pipeline: str,
                 client_factory: ClientFactory | None = None, deletes: bool = False,
                 children: Sequence[ChildTable] = (),
                 routed: Callable[[ClickHouseSinkSettings], list[str]] | None = None) -> None:
        """``deletes``: the pipeline's records can delete: each row gets the hidden ``_ingest_deleted``
        column (1 for a :class:`~ingest.types.DeleteRow`). ``children``: the child tables of the
        pipeline's ``explode`` steps (:mod:`.children`), inserted before each batch's parent rows."""
        self._cfg = cfg
        self._children = tuple(children)
        #: ``cfg.table`` is a template and each row ends with its table's name (ingest.mirror.router):
        #: ``routed(table_cfg)`` gives the DDL that creates a table, run the first time it is seen
        self._routed = routed
        self._made: set[str] = set()
        #: ``columns: auto``: the tables made from the records' schemas (:mod:`.auto`)
        self._auto: ClickHouseAutoTables | None = None
        if cfg.auto_columns:
            from ingest.sinks.clickhouse.auto import ClickHouseAutoTables  # imports ingest.mirror.ddl, which imports this

            self._auto = ClickHouseAutoTables(cfg, deletes)
        self._pipeline = pipeline
        self._factory = client_factory
        self._deletes = deletes
        self._columns = list(cfg.columns) + ([DELETED_COLUMN] if deletes else [])
        ch_types = list(cfg.ch_types.values()) + ([ch_type("UInt8")] if deletes else [])
        self._types = [t.ddl for t in ch_types]
        #: Arrow table builder when the columns allow it (``insert_format: auto``); whether the
        #: server reads Arrow is settled when connecting (``_use_arrow``)
        self._arrow = ArrowEncoder.for_columns(self._columns, ch_types) if cfg.insert_format == "auto" else None
        self._use_arrow = False
        #: the columnar tier's conversion, once :meth:`use_columnar` was called
        self._columnar: ColumnarConverter | None = None
        self._client: Any = None
        self._token_supported = False
        self._chdb = is_chdb_url(cfg.url)
        self._lock = threading.Lock()  # client creation; every call too for chDB
        self.name = f"clickhouse sink {cfg.database}.{cfg.table} at {redact_url(cfg.url)}"
        #: inserts sent, and how many of them as Arrow (for tests and metrics)
        self.inserts = 0
        self.arrow_inserts = 0
        if client_factory is None and not self._chdb:
            try:
                version = server_version_http(cfg, timeout_s=min(3.0, cfg.connect_timeout_s))
            except Exception:  # noqa: BLE001 - unreachable now: writes will retry, check() reports it
                version = None
            if version is not None and _too_old(version):
                raise ServiceUnreachable(self.name, too_old_message(version))

    # -- connection ---------------------------------------------------------------
    def _connect(self) -> Any:
        if self._factory is not None:
            return self._factory()
        import clickhouse_connect

        cfg = self._cfg
        if self._chdb:
            return clickhouse_connect.get_client(dsn=cfg.url)
        try:
            version = server_version_http(cfg)
        except RuntimeError as exc:  # the server answered with an error (e.g. bad password)
            raise classify(exc) from None
        if _too_old(version):
            raise TransientError(too_old_message(version), error_class="server_too_old")
        parts = urlsplit(cfg.url)
        secure = parts.scheme == "https"
        return clickhouse_connect.get_client(
            interface=parts.scheme,
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (8443 if secure else 8123),
            username=cfg.user,
            password=cfg.password.get_secret_value(),
            compress=False if cfg.compression == "none" else cfg.compression,
            connect_timeout=cfg.connect_timeout_s,
            send_receive_timeout=cfg.send_receive_timeout_s,
            autogenerate_session_id=False,
            query_retries=0,
        )

    def client(self) -> Any:
        """The connected client (connecting on first use). Raises TransientError / PermanentError."""
        with self._lock:
            if self._client is None:
                try:
                    client = self._connect()
                except (TransientError, PermanentError):
                    raise
                except Exception as exc:  # noqa: BLE001 - classified below
                    err = classify(exc)
                    if isinstance(err, PermanentError):  # cannot even connect: not the data
                        err = TransientError(str(err), error_class=err.error_class)
                    raise err from exc
                settings = getattr(client, "server_settings", None) or {}
                self._token_supported = "insert_deduplication_token" in settings
                version = parse_version(str(getattr(client, "server_version", "") or ""))
                self._use_arrow = self._arrow is not None and version[:2] >= MIN_SERVER_VERSION
                if not self._token_supported:
                    log.warning(
                        "ClickHouse server has no insert_deduplication_token: retried batches rely on "
                        "ReplacingMergeTree alone", extra={"pipeline": self._pipeline, "sink": self.name},
                    )
                self._client = client
            return self._client

    def warm_up(self) -> None:
        """Connect now (for chDB: load the engine), so the first batch does not pay for it.

        Never raises: a failure is logged and the first write connects (and retries) as usual.
        """
        try:
            self.client()
        except Exception as exc:  # noqa: BLE001 - best effort; the write path owns the retries
            log.warning("ClickHouse not reachable at start; the first write will retry",
                        extra={"pipeline": self._pipeline, "sink": self.name, "error": str(exc)})

    def check(self) -> None:
        """Connect and run ``SELECT 1``; raise ServiceUnreachable naming the server (and its
        version when it is too old), never the password."""
        if self._factory is None and not self._chdb:
            try:
                version = server_version_http(self._cfg)
            except RuntimeError as exc:
                raise ServiceUnreachable(self.name, str(classify(exc))) from None
            except Exception as exc:  # noqa: BLE001 - transport errors
                raise ServiceUnreachable(self.name, str(classify(exc))) from None
            if _too_old(version):
                raise ServiceUnreachable(self.name, too_old_message(version))
        try:
            client = self.client()
            with self._call_lock():
                client.command("SELECT 1")
        except IngestError as exc:
            raise ServiceUnreachable(self.name, str(exc)) from None
        except Exception as exc:  # noqa: BLE001
            raise ServiceUnreachable(self.name, str(classify(exc))) from None

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _arrow_table(self, columns: Sequence[Sequence[Any]]) -> Any | None:
        """The batch as an Arrow table, or ``None`` (insert Native) when pyarrow refuses a value."""
        assert self._arrow is not None
        try:
            return self._arrow.table(columns)
        except Exception as exc:  # noqa: BLE001 - any refusal: Native decides (and classifies) instead
            log.debug("batch not representable in Arrow; inserting Native", extra={"error": str(exc)[:200]})
            return None

    def _call_lock(self) -> contextlib.AbstractContextManager[Any]:
        return self._lock if self._chdb else contextlib.nullcontext()

    # -- writing ----------------------------------------------------------------
    def write(self, rows: Sequence[tuple[Any, ...]], *, token: str | None = None,
              in_tx: InTransaction | None = None) -> None:
        """Insert ``rows`` (one insert; see :class:`ingest.sinks.base.Sink`).

        ``token`` becomes the insert's ``insert_deduplication_token`` (when the
        server has it). ClickHouse has no transactions: ``in_tx`` is refused (the
        backend does not declare ``transactions``). Raises TransientError /
        PermanentError only.
        """
        if in_tx is not None:
            raise TypeError("the ClickHouse sink has no transactions: in_tx is not supported")
        if not rows:
            return
        with self._classified():
            client = self.client()
            if self._auto is not None:
                self._write_auto(client, rows, token)
                return
            if self._routed is not None:
                self._write_routed(client, rows, token)
                return
            for child in self._children:  # before the parents (module .children)
                self._insert_children(client, child, rows, token)
            self._insert(client, self._cfg.table, rows, token)

    def _write_routed(self, client: Any, rows: Sequence[tuple[Any, ...]], token: str | None) -> None:
        """Each table's rows (in batch order) in one insert each; a table is created the first time
        (``CREATE TABLE IF NOT EXISTS``: a create racing another process's is a success). No
        transaction spans the tables: a batch that fails part way is written again whole, and
        ReplacingMergeTree (and each insert's token, the batch's extended by the table) absorbs the
        rows that had landed."""
        by_table: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_table.setdefault(table_of(row), []).append(without_table(row))
        assert self._routed is not None
        for table, table_rows in by_table.items():
            if table not in self._made:
                for statement in self._routed(self._cfg.model_copy(update={"table": table})):
                    with self._call_lock():
                        client.command(statement)
                self._made.add(table)
            self._insert(client, table, table_rows, None if token is None else f"{token}-{table}")

    def _write_auto(self, client: Any, rows: Sequence[tuple[Any, ...]], token: str | None) -> None:
        """``columns: auto`` (:mod:`.auto`): every table of the batch made to take its schemas first (a
        table that cannot: PermanentError ``schema_incompatible`` before any insert), then each table's
        rows in one insert (its token the batch's, extended by the table). A table altered behind ingest's
        back is forgotten and the batch's retry repairs it (TransientError ``table_changed``). A DDL
        the server refuses raises UnclassifiedError: the pipeline stops, naming it, and no row is dead-lettered."""
        auto = self._auto
        assert auto is not None
        by_table: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_table.setdefault(table_of(row), []).append(row)
        try:
            tables = auto.prepare(client, rows, call_lock=self._call_lock,
                                  window=self._cfg.deduplication_window if self._token_supported else None)
        except (MigrationError, ValueError) as exc:  # the server refused the DDL: not the rows' fault
            raise UnclassifiedError(f"columns: auto: {exc}") from exc
        for name, carriers in by_table.items():
            t = tables[name]
            data = auto.insert_data(t, carriers)
            try:
                self._insert_auto(client, t, data, None if token is None else f"{token}-{name}")
            except Exception as exc:  # noqa: BLE001 - classified, and the table read again when it changed
                raise self._auto_failure(client, t, exc) from exc

    def _insert_auto(self, client: Any, t: AutoTable, data: InsertData, token: str | None) -> None:
        """One insert of ``data`` into ``t``: Arrow where every column has an Arrow twin and pyarrow takes
        the values, else Native with the table's types passed explicitly."""
        arrow = None
        if self._use_arrow and self._cfg.insert_format == "auto":
            encoder = ArrowEncoder.for_columns(data.names, data.types)
            if encoder is not None:
                try:
                    arrow = encoder.table(data.columns)
                except Exception as exc:  # noqa: BLE001 - any refusal: Native decides (and classifies)
                    log.debug("batch not representable in Arrow; inserting Native", extra={"error": str(exc)[:200]})
        settings = self._insert_settings(token)
        with self._call_lock():
            if arrow is not None:
                client.insert_arrow(t.name, arrow, database=self._cfg.database, settings=settings)
            else:
                client.insert(t.name, data.columns, column_names=list(data.names),
                              column_type_names=[ct.ddl for ct in data.types], database=self._cfg.database,
                              column_oriented=True, settings=settings)
        self.inserts += 1
        self.arrow_inserts += arrow is not None

    def _auto_failure(self, client: Any, t: AutoTable, exc: Exception) -> IngestError:
        """The error an insert into auto table ``t`` raised, classified; when the table is not what this
        process knows (missing, a column dropped or retyped by hand) it is forgotten and the error is
        transient, so the retry reads the catalog and repairs the table instead of dead-lettering rows."""
        from ingest.sinks.clickhouse.auto import ALTERED_CODES

        err = exc if isinstance(exc, (TransientError, PermanentError)) else classify(exc)
        if error_code(exc) in ALTERED_CODES:
            changed = True
        elif isinstance(err, PermanentError):
            try:
                with self._call_lock():
                    changed = self._auto.changed(client, t)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - cannot tell: the insert's own error stands
                changed = False
        else:
            changed = False
        if not changed:
            return err
        self._auto.forget([t.name])  # type: ignore[union-attr]
        return TransientError(f"table {self._cfg.database}.{t.name} is not as ingest last read it ({err}); "
                              "it is read again from the catalog", error_class="table_changed")

    def plan_auto_table(self, name: str, shape: Any, *, dry_run: bool) -> Any:
        """``columns: auto``: create or evolve ``name`` for ``shape`` now (``ingest migrate``), or with
        ``dry_run`` say what that would run -- a :class:`~ingest.mirror.ddl.DdlResult`. Raises
        TransientError / MigrationError."""
        assert self._auto is not None, "columns: auto only"
        with self._classified():
            client = self.client()
        return self._auto.migrate(client, name, shape, dry_run=dry_run, call_lock=self._call_lock,
                                  window=self._cfg.deduplication_window if self._token_supported else None)

    def ensure_table(self, name: str) -> None:
        """Create the routed table ``name`` now if it is missing (``ingest migrate``). Raises like a write;
        ValueError with ``columns: auto`` (a table is made from its records' schemas)."""
        if self._auto is not None:
            raise ValueError("columns: auto: a table is made from its records' schemas")
        assert self._routed is not None
        with self._classified():
            client = self.client()
            for statement in self._routed(self._cfg.model_copy(update={"table": name})):
                with self._call_lock():
                    client.command(statement)
        self._made.add(name)

    def existing_tables(self) -> list[str]:
        """The tables of the sink's database (the routed case guard's seed; ClickHouse folds no case)."""
        with self._classified():
            client = self.client()
            with self._call_lock():
                return [r[0] for r in client.query("SELECT name FROM system.tables WHERE database = {d:String}",
                                                   parameters={"d": self._cfg.database}).result_rows]

    def _insert(self, client: Any, table_name: str, rows: Sequence[tuple[Any, ...]], token: str | None) -> None:
        """One insert of ``rows`` into ``table_name`` (this sink's columns), Arrow where it can."""
        data = list(zip(*rows))
        if self._deletes:
            data.append([1 if isinstance(row, DeleteRow) else 0 for row in rows])
        arrow = self._arrow_table(data) if self._use_arrow else None
        settings = self._insert_settings(token)
        with self._call_lock():
            if arrow is not None:
                client.insert_arrow(table_name, arrow, database=self._cfg.database, settings=settings)
            else:
                client.insert(table_name, data, column_names=self._columns, column_type_names=self._types,
                              database=self._cfg.database, column_oriented=True, settings=settings)
        self.inserts += 1
        self.arrow_inserts += arrow is not None

    def _insert_children(self, client: Any, child: ChildTable, rows: Sequence[tuple[Any, ...]],
                         token: str | None) -> None:
        """One insert of ``child``'s rows for the batch's parents (new children and delete markers)."""
        def query(text: str, parameters: dict[str, Any]) -> list[tuple[Any, ...]]:
            with self._call_lock():
                return list(client.query(text, parameters=parameters).result_rows)

        out = child.rows(query, rows)
        if not out:
            return
        cfg = child.settings
        settings = self._insert_settings(None if token is None else f"{token}-{cfg.table}")
        with self._call_lock():
            client.insert(cfg.table, list(zip(*out)), column_names=child.columns, column_type_names=child.types,
                          database=cfg.database, column_oriented=True, settings=settings)
        self.inserts += 1

    def use_columnar(self, columns: Sequence[StagedColumn]) -> None:
        """Prepare :meth:`write_columns` for a columnar plan's columns. Raises ValueError, saying why,
        when the table is written by rows: other columns, deletes, ``insert_format: native``, a
        column type with no Arrow counterpart (see :mod:`ingest.sinks.clickhouse.arrow`)."""
        if self._deletes:
            raise ValueError("a table whose records delete is written by rows")
        if self._children:
            raise ValueError("a table with exploded child rows is written by rows")
        if [c.name for c in columns] != self._columns:
            raise ValueError("the columnar plan's columns are not the sink's")
        if self._arrow is None:
            raise ValueError("the sink inserts Native (insert_format: native, or a column type has no Arrow "
                             "counterpart, or pyarrow is missing)")
        self._columnar = ColumnarConverter(columns, list(self._cfg.ch_types.values()), self._arrow.schema)

    def encode_columns(self, table: Any) -> Any:
        """A columnar batch (a ``pyarrow.Table`` of this table's columns as
        :class:`~ingest.core.mapping.columnar.ColumnarPlan` stages them, one row per key) converted to
        the table's Arrow types (:class:`~ingest.sinks.clickhouse.arrow.ColumnarConverter`): the payload
        :meth:`write_encoded` inserts. Pure, any thread. Raises PermanentError for a value the
        conversion refuses. Requires :meth:`use_columnar`."""
        converter = self._columnar
        assert converter is not None, "use_columnar() first"
        with self._classified():
            return converter.convert(table)

    def write_columns(self, table: Any, *, token: str | None = None) -> None:
        """:meth:`write_encoded` of :meth:`encode_columns`."""
        self.write_encoded(self.encode_columns(table), token=token)

    def write_encoded(self, payload: Any, *, token: str | None = None) -> None:
        """Insert an encoded columnar batch (:meth:`encode_columns`) in one ``insert_arrow``. ``token``
        as in :meth:`write`. Raises like :meth:`write`. Requires :meth:`use_columnar`."""
        assert self._columnar is not None, "use_columnar() first"
        if payload.num_rows == 0:
            return
        with self._classified():
            client = self.client()
            if not self._use_arrow:
                raise PermanentError("the server does not read Arrow inserts", error_class="no_arrow")
            settings = self._insert_settings(token)
            with self._call_lock():
                client.insert_arrow(self._cfg.table, payload, database=self._cfg.database, settings=settings)
            self.inserts += 1
            self.arrow_inserts += 1

    def _insert_settings(self, token: str | None) -> dict[str, Any]:
        settings: dict[str, Any] = dict(self._cfg.settings)
        if token is not None and self._token_supported:
            settings["insert_deduplication_token"] = token
        return settings

    @contextlib.contextmanager
    def _classified(self) -> Iterator[None]:
        """Every error inside as TransientError / PermanentError (:func:`~ingest.sinks.clickhouse.errors.classify`)."""
        try:
            yield
        except (TransientError, PermanentError, UnclassifiedError):
            raise
        except Exception as exc:  # noqa: BLE001 - every driver/transport error is classified
            raise classify(exc) from exc

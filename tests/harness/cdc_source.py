"""A simulated source table and the Debezium change stream it writes (for change-data-capture tests).

:class:`SourceTable` plays a PostgreSQL table ``items`` (``id bigint`` primary key, ``name text``,
``price numeric(12,2)``, ``qty integer``, ``updated_at timestamp``) under a random workload, and
writes each change the way Debezium's PostgreSQL connector with the JSON converter does
(:mod:`harness.debezium`): a value per event, keyed by ``{"id": ...}``, every event of one key in
one partition (``crc32(str(id)) % partitions``, the partition passed to the producer explicitly, as
Kafka Connect's partitioner pins a key), and a tombstone (same key, null value) after every delete.

The workload, deterministic for a seed: with probability ``delete_frac`` an event deletes a live
row chosen uniformly (op ``d``); otherwise it picks a key uniformly from ``keys``, and a key that
is not in the table (never was, or deleted) is inserted (op ``c``; keys come back after a delete),
a live one updated (op ``u``). So about ``delete_frac`` of the events are deletes (a little more
with the key changes and short-lived rows below, which delete too; :meth:`SourceTable.describe`
says how many), from the first events on. Besides:

- ``snapshot_keys``: the stream starts with a snapshot of that many rows (op ``r``), all with one
  ``lsn`` (Debezium's snapshot events carry the snapshot's position); streaming events then
  increase ``lsn`` by a random step of 1..64 each, so ``lsn`` is a version column;
- ``rekey_frac`` of the updates change the primary key instead (to a key not in the table):
  Debezium writes a delete of the old key (header ``__debezium.newkey``), its tombstone, and a
  create of the new key (header ``__debezium.oldkey``);
- ``short_lived_frac`` of the events start a short-lived row: a key never used before (ids from
  ``keys`` up), inserted and deleted by the next event (so both usually land in one batch);
- a delete's ``before`` holds the key only (``REPLICA IDENTITY DEFAULT``: the other columns are
  null), except ``null_before_frac`` of the deletes, which have no ``before`` at all (the sink must
  fall back to the record key); with ``replica_identity="full"`` updates and deletes carry the
  whole old row.

Values exercise the encodings and COPY escaping: names with tabs, newlines, backslashes, quotes,
``\\N``, non-ASCII, empty and null; prices from ``-9999999999.99`` to ``9999999999.99`` (precision 12)
and null; ``qty`` over the whole int32 range and null; ``updated_at`` with microseconds (or whole
milliseconds, see ``encoding``) and null.

``encoding``:

- ``"precise"`` (default): the connector's defaults, ``decimal.handling.mode=precise`` (price as
  base64 of the unscaled integer) and ``time.precision.mode=adaptive`` (MicroTimestamp). Only
  decodable with the schema part (``schemas=True``);
- ``"string"``: what a schemaless deployment (``value.converter.schemas.enable=false``) must
  configure: ``decimal.handling.mode=string`` and ``time.precision.mode=connect`` (price as decimal
  text, ``updated_at`` as epoch milliseconds; values then have whole milliseconds).

``envelope="none"``: plain JSON upserts instead (no deletes): each value is the ``after`` image as
the schemaless converter writes it (``string`` encoding) plus ``"lsn"``, the record a table-shaped
topic without change events would carry (the benchmark's pure-upsert stream).

Ground truth: :attr:`SourceTable.rows` is the table now (``id -> Row``, the values as a sink holds
them: ``Decimal`` price, aware UTC ``updated_at``, and the ``lsn`` of the row's last upsert);
:attr:`SourceTable.deleted` the keys that existed and are deleted now, and
:attr:`SourceTable.deleted_rows` their rows as a soft delete leaves them (the values the row held
before its delete, and the delete's ``lsn``); :attr:`SourceTable.counts`
the events by op (and ``tombstone``, ``rekey``, ``short_lived``); :attr:`SourceTable.history` every change of each
key in order (``id -> [(op, lsn), ...]``).

Produce with :func:`produce_stream` (``harness.kafka.produce`` in chunks of ``(key, value, partition,
headers)`` tuples); :meth:`SourceTable.events` can be called again to continue the history.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

import orjson

from harness.debezium import Field, encode_event, encode_key
from harness.kafka import produce

__all__ = [
    "COLUMNS",
    "KEY_FIELDS",
    "Row",
    "SourceTable",
    "fields_for",
    "partition_of",
    "produce_stream",
]

TABLE = "items"
BASE_TS = datetime(2024, 1, 1, tzinfo=UTC)
#: ``ts_ms`` of the first event; each event is 1..5 ms after the previous one.
BASE_TS_MS = 1_704_067_200_000
FIRST_LSN = 24_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)

KEY_FIELDS: tuple[Field, ...] = (Field("id", "int64", optional=False),)
_FIELDS_PRECISE: tuple[Field, ...] = (
    Field("id", "int64", optional=False),
    Field("name", "string"),
    Field("price", "decimal(12,2)"),
    Field("qty", "int32"),
    Field("updated_at", "micro_timestamp"),
)
_FIELDS_STRING: tuple[Field, ...] = (
    Field("id", "int64", optional=False),
    Field("name", "string"),
    Field("price", "string"),  # decimal.handling.mode=string
    Field("qty", "int32"),
    Field("updated_at", "timestamp_ms"),  # time.precision.mode=connect
)

#: The table's non-key columns in :class:`Row` order (then ``lsn``).
COLUMNS = ("name", "price", "qty", "updated_at")

_NAMES = ("widget", "gadget", "ünïcødé ✓", "tab\there", "new\nline", "back\\slash", 'quote"d', "it's",
          "\\N", "NULL", "", "comma,semi;colon", "{brace}", "a" * 200, "日本語", "emoji 🚀")
_CENT = Decimal("0.01")
_MAX_UNSCALED = 10**12 - 1  # numeric(12,2)


def fields_for(encoding: str) -> tuple[Field, ...]:
    """The row fields of ``encoding`` (``precise`` or ``string``, see the module docstring)."""
    if encoding == "precise":
        return _FIELDS_PRECISE
    if encoding == "string":
        return _FIELDS_STRING
    raise ValueError(f"unknown encoding {encoding!r}")


def _plain(image: dict[str, Any]) -> dict[str, Any]:
    """A row image (``string`` encoding) as the schemaless JSON converter writes its values."""
    out = dict(image)
    ts = out.get("updated_at")
    if ts is not None:
        out["updated_at"] = (ts - _EPOCH) // _ONE_MS  # time.precision.mode=connect: epoch milliseconds
    return out


def partition_of(key_id: int, partitions: int) -> int:
    """The partition of key ``key_id``: stable across processes and runs."""
    return zlib.crc32(str(key_id).encode()) % partitions


class Row(NamedTuple):
    """A row of the source table as the sink holds it."""

    name: str | None
    price: Decimal | None
    qty: int | None
    updated_at: datetime | None
    lsn: int


#: A Kafka record for ``harness.kafka.produce``: (key, value, partition, headers).
Message = tuple[bytes, bytes | None, int, list[tuple[str, bytes]] | None]


class SourceTable:
    """A source table's history as Debezium change events; see the module docstring."""

    def __init__(self, seed: int, *, keys: int, partitions: int = 6, delete_frac: float = 0.2,
                 schemas: bool = True, encoding: str = "precise", snapshot_keys: int = 0,
                 rekey_frac: float = 0.01, null_before_frac: float = 0.05, short_lived_frac: float = 0.005,
                 replica_identity: str = "default", table: str = TABLE, envelope: str = "debezium") -> None:
        if envelope not in ("debezium", "none"):
            raise ValueError("envelope is 'debezium' or 'none'")
        if envelope == "none" and (delete_frac or rekey_frac or short_lived_frac or snapshot_keys or schemas
                                   or encoding != "string"):
            raise ValueError("envelope 'none' (plain JSON upserts) has no deletes, key changes or snapshot, "
                             "no schema part and the 'string' encoding")
        if not 0.0 <= delete_frac < 0.5:
            raise ValueError("delete_frac must be in [0, 0.5): deletes cannot outnumber inserts for long")
        if encoding == "precise" and not schemas:
            raise ValueError("encoding 'precise' without the schema part cannot be decoded by anyone: "
                             "use encoding 'string' with schemas=False")
        if replica_identity not in ("default", "full"):
            raise ValueError("replica_identity is 'default' or 'full'")
        self.rng = random.Random(seed)
        self.keys = keys
        self.partitions = partitions
        self.schemas = schemas
        self.encoding = encoding
        self.fields = fields_for(encoding)
        self.table = table
        self.envelope = envelope
        self.replica_identity = replica_identity
        self.delete_frac = delete_frac
        self.rekey_frac = rekey_frac
        self.null_before_frac = null_before_frac
        self.short_lived_frac = short_lived_frac
        self._next_short_lived = keys
        #: the table now: id -> Row
        self.rows: dict[int, Row] = {}
        #: the keys of ``rows`` as a list, and each one's index in it (a uniform pick of a live row)
        self._live: list[int] = []
        self._live_at: dict[int, int] = {}
        #: keys that existed and are deleted now
        self.deleted: set[int] = set()
        #: those keys' rows as a soft delete leaves them: the values before the delete, its ``lsn``
        self.deleted_rows: dict[int, Row] = {}
        #: every change of each key in order: id -> [(op, lsn), ...]
        self.history: dict[int, list[tuple[str, int]]] = {}
        #: events by op ("c", "r", "u", "d"), plus "tombstone", "rekey" and "short_lived"
        self.counts: Counter[str] = Counter()
        #: how many records (events + tombstones) went to each partition
        self.per_partition: Counter[int] = Counter()
        self.lsn = FIRST_LSN
        self.ts_ms = BASE_TS_MS
        self._key_cache: dict[int, bytes] = {}
        self._pending_snapshot = min(snapshot_keys, keys)

    # ------------------------------------------------------------------ values

    def _values(self) -> dict[str, Any]:
        rng = self.rng
        r = rng.random()
        name = None if r < 0.03 else (rng.choice(_NAMES) if r < 0.4 else f"item-{rng.randrange(10**6)}")
        r = rng.random()
        if r < 0.03:
            price = None
        elif r < 0.06:
            price = Decimal(rng.choice((0, _MAX_UNSCALED, -_MAX_UNSCALED, 1, -1))).scaleb(-2)
        else:
            price = Decimal(rng.randrange(-10**6, 10**9)).scaleb(-2)
        r = rng.random()
        qty = None if r < 0.03 else (rng.randint(-2**31, 2**31 - 1) if r < 0.1 else rng.randrange(1000))
        r = rng.random()
        if r < 0.03:
            updated = None
        else:
            us = rng.randrange(10**15) if r < 0.1 else (self.ts_ms - BASE_TS_MS) * 1000 + rng.randrange(10**6)
            if self.encoding == "string":
                us -= us % 1000  # epoch milliseconds carry whole milliseconds only
            updated = BASE_TS + timedelta(microseconds=us)
        return {"name": name, "price": price, "qty": qty, "updated_at": updated}

    def _encoded(self, values: dict[str, Any], key_id: int) -> dict[str, Any]:
        image = {"id": key_id, **values}
        if self.encoding == "string" and values["price"] is not None:
            image["price"] = str(values["price"])
        return image

    def key_bytes(self, key_id: int) -> bytes:
        k = self._key_cache.get(key_id)
        if k is None:
            k = encode_key({"id": key_id}, fields=KEY_FIELDS, schemas=self.schemas, table=self.table)
            self._key_cache[key_id] = k
        return k

    # ------------------------------------------------------------------ events

    def _event(self, op: str, before: dict[str, Any] | None, after: dict[str, Any] | None, lsn: int) -> bytes:
        if self.envelope == "none":
            assert after is not None
            return orjson.dumps({**_plain(after), "lsn": lsn})
        return encode_event(op, before, after, fields=self.fields, lsn=lsn, ts_ms=self.ts_ms,
                            schemas=self.schemas, table=self.table)

    def _tick(self) -> int:
        self.lsn += self.rng.randint(1, 64)
        self.ts_ms += self.rng.randint(1, 5)
        return self.lsn

    def _upsert(self, out: list[Message], op: str, key_id: int, lsn: int,
                headers: list[tuple[str, bytes]] | None = None) -> None:
        values = self._values()
        old = self.rows.get(key_id)
        before = None
        if op == "u" and self.replica_identity == "full" and old is not None:
            before = self._encoded(dict(zip(COLUMNS, old[:4])), key_id)
        value = self._event(op, before, self._encoded(values, key_id), lsn)
        out.append((self.key_bytes(key_id), value, partition_of(key_id, self.partitions), headers))
        self.rows[key_id] = Row(values["name"], values["price"], values["qty"], values["updated_at"], lsn)
        if key_id not in self._live_at:
            self._live_at[key_id] = len(self._live)
            self._live.append(key_id)
        self.deleted.discard(key_id)
        self.deleted_rows.pop(key_id, None)
        self.history.setdefault(key_id, []).append((op, lsn))
        self.counts[op] += 1

    def _delete(self, out: list[Message], key_id: int, lsn: int,
                headers: list[tuple[str, bytes]] | None = None) -> None:
        old = self.rows.pop(key_id)
        at = self._live_at.pop(key_id)
        last = self._live.pop()
        if last != key_id:
            self._live[at] = last
            self._live_at[last] = at
        if self.rng.random() < self.null_before_frac:
            before = None
        elif self.replica_identity == "full":
            before = self._encoded(dict(zip(COLUMNS, old[:4])), key_id)
        else:
            before = {"id": key_id}  # the other columns are written as null
        key = self.key_bytes(key_id)
        part = partition_of(key_id, self.partitions)
        out.append((key, self._event("d", before, None, lsn), part, headers))
        out.append((key, None, part, None))  # tombstones.on.delete=true
        self.deleted.add(key_id)
        self.deleted_rows[key_id] = old._replace(lsn=lsn)
        self.history[key_id].append(("d", lsn))
        self.counts["d"] += 1
        self.counts["tombstone"] += 1

    def events(self, n: int) -> list[Message]:
        """The next ``n`` change events (plus a tombstone after each delete) as Kafka records."""
        out: list[Message] = []
        rng = self.rng
        made = 0
        while made < n:
            if self._pending_snapshot:
                # The snapshot: keys not in the table yet, one lsn for all of them.
                key_id = self.keys - self._pending_snapshot
                self._pending_snapshot -= 1
                self.ts_ms += 1
                self._upsert(out, "r", key_id, FIRST_LSN)
                made += 1
                continue
            if made + 1 < n and rng.random() < self.short_lived_frac:
                # A short-lived row: a key never used before, inserted and deleted right after.
                key_id = self._next_short_lived
                self._next_short_lived += 1
                self._upsert(out, "c", key_id, self._tick())
                self._delete(out, key_id, self._tick())
                self.counts["short_lived"] += 1
                made += 2
                continue
            lsn = self._tick()
            if self._live and rng.random() < self.delete_frac:
                self._delete(out, self._live[rng.randrange(len(self._live))], lsn)
                made += 1
                continue
            key_id = rng.randrange(self.keys)
            if key_id not in self.rows:
                self._upsert(out, "c", key_id, lsn)
            elif rng.random() < self.rekey_frac and len(self.rows) < self.keys:
                # A primary-key update: delete of the old key, its tombstone, create of the new one.
                new_id = rng.randrange(self.keys)
                while new_id in self.rows:
                    new_id = rng.randrange(self.keys)
                new_key, old_key = self.key_bytes(new_id), self.key_bytes(key_id)
                self._delete(out, key_id, lsn, [("__debezium.newkey", new_key)])
                self._upsert(out, "c", new_id, self._tick(), [("__debezium.oldkey", old_key)])
                self.counts["rekey"] += 1
                made += 1  # two events
            else:
                self._upsert(out, "u", key_id, lsn)
            made += 1
        for _key, _value, part, _headers in out:
            self.per_partition[part] += 1
        return out

    # ------------------------------------------------------------------ summaries

    @property
    def events_made(self) -> int:
        return sum(v for k, v in self.counts.items() if k in ("c", "r", "u", "d"))

    @property
    def records_made(self) -> int:
        return self.events_made + self.counts["tombstone"]

    def describe(self) -> str:
        c = self.counts
        share = c["d"] / max(1, self.events_made)
        return (f"{self.events_made} events ({c['r']} r, {c['c']} c, {c['u']} u, {c['d']} d = {share:.1%}, "
                f"{c['rekey']} key changes, {c['short_lived']} short-lived rows) + {c['tombstone']} tombstones "
                f"over {self.keys} keys: "
                f"{len(self.rows)} rows now, {len(self.deleted)} deleted")


def produce_stream(bootstrap: str, topic: str, records: Sequence[Message] | Iterable[Message], *,
                   chunk: int = 20_000, config: dict[str, Any] | None = None) -> int:
    """Produce ``records`` (from :meth:`SourceTable.events`) in chunks; returns the count.

    Each chunk is one ``harness.kafka.produce`` call (idempotent producer, flushed), so the log
    holds many producer batches per partition, as a connector's does.
    """
    records = list(records)
    done = 0
    for start in range(0, len(records), chunk):
        done += produce(bootstrap, topic, records[start:start + chunk], config=config)
    return done

"""Records as Debezium's PostgreSQL connector writes them with the JSON converter.

:func:`encode_event` and :func:`encode_key` return the bytes of a change event's value and key, in
the shape of Debezium 2.x/3.x (``transaction``, ``ts_us``, ``ts_ns`` in the envelope), with
(``schemas=True``, the converter's ``schemas.enable=true``) or without the schema part. Columns are
described by :class:`Field`; their values are encoded as the connector's defaults encode them
(``decimal.handling.mode=precise``, ``time.precision.mode=adaptive``), schema part or not:

============================  =====================  ==================================================
``kind``                      value given            encoded (schema: type, name)
============================  =====================  ==================================================
``int64`` ``int32``           int                    as is (``int64`` / ``int32``)
``string``                    str                    as is
``boolean``                   bool                   as is
``float64``                   float                  as is
``decimal(P,S)``              Decimal (int, str)     base64 of the big-endian two's-complement unscaled
                                                     integer, as Java's ``BigInteger.toByteArray()``
                                                     (``bytes``, ``org.apache.kafka.connect.data.Decimal``,
                                                     parameters ``scale``/``connect.decimal.precision``)
``variable_decimal``          Decimal                ``{"scale": S, "value": base64}`` (PostgreSQL
                                                     ``numeric`` without a modifier;
                                                     ``io.debezium.data.VariableScaleDecimal``)
``micro_timestamp``           datetime (naive: UTC)  µs since the epoch (``int64``,
                                                     ``io.debezium.time.MicroTimestamp``; ``timestamp``)
``timestamp_ms``              datetime (naive: UTC)  ms since the epoch, floored (``int64``,
                                                     ``org.apache.kafka.connect.data.Timestamp``, as with
                                                     ``time.precision.mode=connect``)
``date``                      date                   days since 1970-01-01 (``int32``, ``io.debezium.time.Date``)
``zoned_timestamp``           aware datetime         ISO 8601 in UTC, ``Z``, fraction without trailing
                                                     zeros as Java's ``ISO_OFFSET_DATE_TIME`` writes it
                                                     (``string``, ``io.debezium.time.ZonedTimestamp``;
                                                     ``timestamptz``)
``micro_time``                time                   µs since midnight (``int64``, ``io.debezium.time.MicroTime``)
============================  =====================  ==================================================

None is null. Row images always carry every field (Debezium's structs do): a field missing from
``before``/``after`` is written as null, as for the non-key columns of a delete's ``before`` with
``REPLICA IDENTITY DEFAULT``. The schema part and the per-field encoders are built once per
``fields`` (cached), so encoding tens of thousands of events is cheap.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import orjson

__all__ = ["Field", "decimal_base64", "encode_event", "encode_key"]

DEBEZIUM_VERSION = "3.0.1.Final"
_UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)
_EPOCH_DATE = date(1970, 1, 1)
_ONE_US = timedelta(microseconds=1)
_ONE_MS = timedelta(milliseconds=1)
_DECIMAL_KIND = re.compile(r"decimal\((\d+),\s*(\d+)\)")


@dataclass(frozen=True)
class Field:
    """A column: its name and how it is encoded (``kind``, see the module docstring)."""

    name: str
    kind: str  # int64, int32, string, boolean, float64, decimal(P,S), variable_decimal, micro_timestamp,
    #            timestamp_ms, date, zoned_timestamp, micro_time
    optional: bool = True  # the schema's "optional" in the row struct (key structs: always false)


# --------------------------------------------------------------------------- value encoders


def _unscaled_bytes(n: int) -> bytes:
    """``BigInteger.toByteArray()``: minimal big-endian two's complement, at least one byte."""
    length = (n if n >= 0 else ~n).bit_length() // 8 + 1
    return n.to_bytes(length, "big", signed=True)


def _unscaled(value: Any, scale: int) -> int:
    """The unscaled integer of ``value`` at ``scale`` (ValueError if it has more decimals)."""
    d = value if isinstance(value, Decimal) else Decimal(str(value))
    if not d.is_finite():
        raise ValueError(f"{d} cannot be encoded as a Debezium decimal")
    sign, digits, exp = d.as_tuple()
    n = int("".join(map(str, digits)) or "0")
    shift = exp + scale  # type: ignore[operator]
    if shift >= 0:
        n *= 10**shift
    else:
        n, rest = divmod(n, 10**-shift)
        if rest:
            raise ValueError(f"{d} has more than {scale} decimals")
    return -n if sign else n


def decimal_base64(value: Any, scale: int) -> str:
    """The base64 text Debezium writes for ``value`` in a decimal column of ``scale``."""
    return base64.b64encode(_unscaled_bytes(_unscaled(value, scale))).decode()


def _variable_decimal(value: Any) -> dict[str, Any]:
    d = value if isinstance(value, Decimal) else Decimal(str(value))
    scale = max(0, -d.as_tuple().exponent)  # type: ignore[operator]
    return {"scale": scale, "value": decimal_base64(d, scale)}


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=_UTC)


def _micro_timestamp(dt: datetime) -> int:
    return (_aware(dt) - _EPOCH) // _ONE_US


def _timestamp_ms(dt: datetime) -> int:
    return (_aware(dt) - _EPOCH) // _ONE_MS


def _date(d: date) -> int:
    return (d - _EPOCH_DATE).days


def _zoned_timestamp(dt: datetime) -> str:
    text = _aware(dt).astimezone(_UTC).replace(tzinfo=None).isoformat(timespec="microseconds")
    text = text.rstrip("0").rstrip(".")  # the fraction only: isoformat always writes ".ffffff"
    return text + "Z"


def _micro_time(t: time) -> int:
    return ((t.hour * 60 + t.minute) * 60 + t.second) * 1_000_000 + t.microsecond


def _field_spec(f: Field, *, optional: bool) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """``(schema of the field, value encoder or None for as is)``."""
    kind = f.kind
    base: dict[str, Any]
    enc: Callable[[Any], Any] | None = None
    m = _DECIMAL_KIND.fullmatch(kind.replace(" ", ""))
    if kind in ("int64", "int32", "string", "boolean", "float64"):
        base = {"type": kind, "optional": optional}
    elif m:
        precision, scale = int(m.group(1)), int(m.group(2))
        base = {"type": "bytes", "optional": optional, "name": "org.apache.kafka.connect.data.Decimal",
                "version": 1, "parameters": {"scale": str(scale), "connect.decimal.precision": str(precision)}}
        enc = lambda v, s=scale: decimal_base64(v, s)  # noqa: E731
    elif kind == "variable_decimal":
        base = {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "scale"},
                                             {"type": "bytes", "optional": False, "field": "value"}],
                "optional": optional, "name": "io.debezium.data.VariableScaleDecimal", "version": 1,
                "doc": "Variable scaled decimal"}
        enc = _variable_decimal
    elif kind == "micro_timestamp":
        base = {"type": "int64", "optional": optional, "name": "io.debezium.time.MicroTimestamp", "version": 1}
        enc = _micro_timestamp
    elif kind == "timestamp_ms":
        base = {"type": "int64", "optional": optional, "name": "org.apache.kafka.connect.data.Timestamp",
                "version": 1}
        enc = _timestamp_ms
    elif kind == "date":
        base = {"type": "int32", "optional": optional, "name": "io.debezium.time.Date", "version": 1}
        enc = _date
    elif kind == "zoned_timestamp":
        base = {"type": "string", "optional": optional, "name": "io.debezium.time.ZonedTimestamp", "version": 1}
        enc = _zoned_timestamp
    elif kind == "micro_time":
        base = {"type": "int64", "optional": optional, "name": "io.debezium.time.MicroTime", "version": 1}
        enc = _micro_time
    else:
        raise ValueError(f"unknown field kind {kind!r}")
    return {**base, "field": f.name}, enc


# --------------------------------------------------------------------------- schema parts (cached)


def _source_schema() -> dict[str, Any]:
    def s(t: str, name: str, optional: bool = False) -> dict[str, Any]:
        return {"type": t, "optional": optional, "field": name}

    return {"type": "struct", "fields": [
        s("string", "version"), s("string", "connector"), s("string", "name"), s("int64", "ts_ms"),
        {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
         "parameters": {"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,"
                                   "incremental"},
         "default": "false", "field": "snapshot"},
        s("string", "db"), s("string", "sequence", True), s("int64", "ts_us", True), s("int64", "ts_ns", True),
        s("string", "schema"), s("string", "table"), s("int64", "txId", True), s("int64", "lsn", True),
        s("int64", "xmin", True),
    ], "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source"}


_TRANSACTION_SCHEMA = {"type": "struct", "fields": [
    {"type": "string", "optional": False, "field": "id"},
    {"type": "int64", "optional": False, "field": "total_order"},
    {"type": "int64", "optional": False, "field": "data_collection_order"},
], "optional": True, "name": "event.block", "version": 1, "field": "transaction"}


@dataclass(frozen=True)
class _Compiled:
    schema_prefix: bytes  # b'{"schema":...,"payload":' (schemas=True)
    encoders: tuple[tuple[str, Callable[[Any], Any] | None], ...]


_compiled: dict[tuple[Any, ...], _Compiled] = {}
_by_identity: dict[int, tuple[Any, tuple[Any, ...], _Compiled]] = {}


def _compile(fields: Sequence[Field], what: str, server: str, schema_name: str, table: str) -> _Compiled:
    # Fast path by identity (the caller passes the same fields object for every event); the
    # object is kept in the entry, so its id cannot be reused while the entry exists.
    ident = (what, server, schema_name, table)
    hit = _by_identity.get(id(fields))
    if hit is not None and hit[0] is fields and hit[1] == ident:
        return hit[2]
    key = (tuple(fields), *ident)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _build(tuple(fields), what, f"{server}.{schema_name}.{table}")
        _compiled[key] = compiled
    if len(_by_identity) > 1024:
        _by_identity.clear()
    _by_identity[id(fields)] = (fields, ident, compiled)
    return compiled


def _build(fields: tuple[Field, ...], what: str, prefix: str) -> _Compiled:
    key_struct = what == "key"
    specs = [_field_spec(f, optional=False if key_struct else f.optional) for f in fields]
    encoders = tuple((f.name, enc) for f, (_, enc) in zip(fields, specs))
    row_fields = [schema for schema, _ in specs]
    if key_struct:
        schema: dict[str, Any] = {"type": "struct", "fields": row_fields, "optional": False, "name": f"{prefix}.Key"}
    else:
        def image(field: str) -> dict[str, Any]:
            return {"type": "struct", "fields": row_fields, "optional": True, "name": f"{prefix}.Value",
                    "field": field}

        schema = {"type": "struct", "fields": [
            image("before"), image("after"), _source_schema(), _TRANSACTION_SCHEMA,
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
            {"type": "int64", "optional": True, "field": "ts_us"},
            {"type": "int64", "optional": True, "field": "ts_ns"},
        ], "optional": False, "name": f"{prefix}.Envelope", "version": 2}
    return _Compiled(b'{"schema":' + orjson.dumps(schema) + b',"payload":', encoders)


def _row(image: Mapping[str, Any] | None, encoders: tuple[tuple[str, Callable[[Any], Any] | None], ...]
         ) -> dict[str, Any] | None:
    if image is None:
        return None
    get = image.get
    out = {}
    for name, enc in encoders:
        v = get(name)
        out[name] = v if v is None or enc is None else enc(v)
    return out


# --------------------------------------------------------------------------- public


def encode_event(op: str, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, *,
                 fields: Sequence[Field], lsn: int, ts_ms: int, schemas: bool, table: str = "items",
                 server: str = "dbserver1", schema_name: str = "public", db: str = "postgres",
                 tx_id: int | None = None, snapshot: str | None = None) -> bytes:
    """A change event's value as the JSON converter writes it (``schemas``: with the schema part).

    ``op``: c, r, u, d or t (for t, pass None images). ``lsn`` goes to ``source.lsn`` and
    ``source.sequence``; ``ts_ms`` to ``source.ts_ms`` and the envelope's ``ts_ms`` (``ts_us``/``ts_ns``
    derived). ``tx_id`` defaults to one derived from ``lsn``; ``snapshot`` to "true" for op r, else
    "false".
    """
    compiled = _compile(fields, "value", server, schema_name, table)
    encoders = compiled.encoders
    payload = {
        "before": _row(before, encoders),
        "after": _row(after, encoders),
        "source": {
            "version": DEBEZIUM_VERSION, "connector": "postgresql", "name": server, "ts_ms": ts_ms,
            "snapshot": snapshot if snapshot is not None else ("true" if op == "r" else "false"),
            "db": db, "sequence": f'[null,"{lsn}"]', "ts_us": ts_ms * 1000, "ts_ns": ts_ms * 1_000_000,
            "schema": schema_name, "table": table,
            "txId": tx_id if tx_id is not None else 500 + lsn // 256, "lsn": lsn, "xmin": None,
        },
        "transaction": None,
        "op": op,
        "ts_ms": ts_ms,
        "ts_us": ts_ms * 1000,
        "ts_ns": ts_ms * 1_000_000,
    }
    body = orjson.dumps(payload)
    return compiled.schema_prefix + body + b"}" if schemas else body


def encode_key(key: Mapping[str, Any], *, fields: Sequence[Field], schemas: bool, table: str = "items",
               server: str = "dbserver1", schema_name: str = "public") -> bytes:
    """A change event's key (the primary key columns ``fields``) as the JSON converter writes it."""
    compiled = _compile(fields, "key", server, schema_name, table)
    body = orjson.dumps(_row(key, compiled.encoders))
    return compiled.schema_prefix + body + b"}" if schemas else body

"""Debezium change-event envelopes, decoded: a record value → :class:`Change`. Pure logic, no I/O.

Contract
--------
:func:`unwrap` takes one already-decoded record value (the Python object a
format produced: ``orjson.loads`` of Debezium's JSON converter output, or the
dict fastavro made of an Avro converter record) and returns a :class:`Change`:

- ``op``: Debezium's operation code, one of ``c`` (insert), ``r`` (snapshot
  read), ``u`` (update), ``d`` (delete), ``t`` (truncate).
- ``before`` / ``after``: the row images (dicts of column → value) or None.
  ``c``/``r``/``u`` always have ``after``; ``before`` of an update is there only
  with ``REPLICA IDENTITY FULL`` (or when the key changed). A delete's ``before``
  holds at least the key columns (with ``REPLICA IDENTITY DEFAULT`` the other
  columns are null), or is None, when the caller falls back to the record key.
  A truncate has neither.
- ``source``: Debezium's ``source`` block (``lsn``, ``txId``, ``ts_ms``, ``db``,
  ``schema``, ``table``, ...), as it came: not converted, not copied.

Anything else raises ``InvalidRecord("map", "not_a_change_event", ...)``: a value
that is not a dict, a dict without ``op`` or with an ``op`` outside the five
above (Debezium's ``m`` logical-decoding messages included), ``c``/``r``/``u``
whose ``after`` is not a dict, a ``before``/``after`` that is neither a dict
nor None, a malformed schema part. A tombstone (the null value Debezium writes
after each delete, ``tombstones.on.delete``) is no change event either: the
caller should skip null values before calling :func:`unwrap`.

:func:`unwrap_key` does the same for a record key: the key's ``payload`` (its
values converted as below) when the key has the ``schema``/``payload`` form,
otherwise the key unchanged.

Encodings
---------
*JSON converter with* ``schemas.enable=true`` (the converter's default): the
value is ``{"schema": {...}, "payload": {...envelope...}}``, i.e. a dict with
exactly those two keys and a dict payload. The Kafka Connect schema of the
``before``/``after`` structs then says which columns carry a logical type, and
their values are converted (into a copy of the image; the input is never mutated):

- ``org.apache.kafka.connect.data.Decimal``: base64 of the big-endian two's-complement
  unscaled integer, scale in ``parameters.scale`` → exact ``Decimal`` (a JSON number, as
  the converter writes with ``decimal.format=NUMERIC``, → ``Decimal`` too);
- ``io.debezium.data.VariableScaleDecimal`` (PostgreSQL ``numeric`` without a modifier):
  ``{"scale": int, "value": base64}`` → ``Decimal``;
- ``org.apache.kafka.connect.data.Date``, ``io.debezium.time.Date``: days since
  1970-01-01 → ``date``;
- ``org.apache.kafka.connect.data.Timestamp``, ``io.debezium.time.Timestamp``: ms since
  the epoch → ``datetime`` (UTC);
- ``io.debezium.time.MicroTimestamp``: µs since the epoch → ``datetime`` (UTC), exact;
- ``io.debezium.time.NanoTimestamp``: ns since the epoch → ``datetime`` (UTC), floored to
  the microsecond;
- ``io.debezium.time.ZonedTimestamp``: ISO 8601 text, left as is (the column coercers
  parse ISO 8601);
- ``io.debezium.time.MicroTime`` / ``org.apache.kafka.connect.data.Time`` /
  ``io.debezium.time.Time``: µs / ms / ms since midnight → ``time``;
- anything else (``io.debezium.data.Json``, ``Enum``, ``Uuid``, geometry, ...): unchanged.

None stays None. Timestamps without a time zone (PostgreSQL ``timestamp``,
which Debezium encodes as wall-clock time since the epoch) come out as UTC.
Top-level columns are converted, and also columns of nested unnamed structs
and arrays whose items have one of these logical types. A value that does not
decode (bad base64, a non-integer where an integer is due, a date beyond
Python's range such as PostgreSQL's ``infinity``) raises
``InvalidRecord("map", "invalid_value", ...)`` naming the column.

*JSON converter with* ``schemas.enable=false``: the value is the envelope
itself. Nothing says which column has which logical type, so values are
passed on unchanged, and Debezium's defaults then make some of them
ambiguous: a ``numeric`` column arrives as the base64 text of its unscaled
integer (``decimal.handling.mode=precise``), indistinguishable from a string,
and a ``timestamp`` column as an integer of microseconds
(``time.precision.mode=adaptive``), indistinguishable from any other number
(the column coercers would take it for milliseconds). **Without the schema
part, configure the connector with** ``decimal.handling.mode=string`` (decimals
as exact decimal text) **and** ``time.precision.mode=connect`` (timestamps as
epoch milliseconds), or enable ``value.converter.schemas.enable``. Dates still
arrive as integer days since the epoch in either mode (and times as integers
since midnight), which the ``date``/``time`` column coercers do not take.

*Avro converter* (decoded by fastavro): no ``schema`` part; the dict is the
envelope and its values pass through unchanged. Kafka Connect's own logical
types (Decimal, Date, Time, Timestamp) become Avro logical types, which
fastavro already returns as ``Decimal``/``date``/``time``/``datetime``;
Debezium's ``io.debezium.time.*`` types are plain Avro ``int``/``long`` (their
name survives only as the ``connect.name`` schema property), so with Avro too
``time.precision.mode=connect`` is what yields typed dates and timestamps.

Performance
-----------
Per record, the schema part costs one pass over the row struct's field
descriptions to build a signature (the fields that carry a logical type we
convert: field, type name, scale); the converter compiled for that signature
is cached (at most :data:`CACHE_SIZE` signatures, cleared when full). Columns
without a logical type cost nothing at conversion; an image without any is
returned as it came.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal
from typing import Any

from ingest.core.mapping.common import _show, float_decimal
from ingest.errors import InvalidRecord

__all__ = ["CACHE_SIZE", "Change", "SchemaParts", "envelope_change", "schema_plans", "unwrap", "unwrap_key"]


@dataclass(slots=True)
class Change:
    """One decoded Debezium change event (see the module docstring)."""

    op: str  # 'c', 'r', 'u', 'd', 't'
    before: dict[str, Any] | None  # the row image before (deletes: at least the key columns)
    after: dict[str, Any] | None  # the row image after (c/r/u)
    source: dict[str, Any] | None  # Debezium's ``source`` block, unconverted


#: Debezium's row-level op codes. ``m`` (logical decoding messages), ``n``, ``cmd`` are not row changes.
_OPS = frozenset({"c", "r", "u", "d", "t"})
_NEED_AFTER = frozenset({"c", "r", "u"})

#: Converters compiled per row-struct signature; cleared when it reaches CACHE_SIZE entries.
CACHE_SIZE = 256
_PLANS: dict[tuple[Any, ...], tuple[tuple[str, Callable[[Any], Any], str], ...]] = {}

# --------------------------------------------------------------------------- value converters
# Each takes a non-None value and returns the Python value, or raises ValueError / TypeError /
# OverflowError / KeyError, which the caller turns into InvalidRecord(invalid_value) naming the field.

_UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_US_PER_DAY = 86_400_000_000
_a2b = binascii.a2b_base64
_from_bytes = int.from_bytes
_td = timedelta
_fromordinal = date.fromordinal
#: scaleb in a context wide enough to be exact for any digit count and exponent.
_EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)

DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"


def _unscaled(text: Any) -> int:
    if type(text) is not str:
        raise TypeError("expected a base64 string")
    return _from_bytes(_a2b(text, strict_mode=True), "big", signed=True)


def _decimal_converter(scale_param: Any) -> Callable[[Any], Decimal]:
    exp = -int(scale_param if scale_param is not None else 0)

    def conv(v: Any) -> Decimal:
        t = type(v)
        if t is str:
            return Decimal(_from_bytes(_a2b(v, strict_mode=True), "big", signed=True)).scaleb(exp, _EXACT)
        if t is int:  # JsonConverter decimal.format=NUMERIC: the number itself
            return Decimal(v)
        if t is float:
            if v - v != 0.0:
                raise ValueError("not a finite number")
            return float_decimal(v)
        raise TypeError("expected a base64 string")

    return conv


def _variable_scale_decimal(v: Any) -> Decimal:
    if type(v) is not dict:
        raise TypeError("expected a {scale, value} struct")
    scale = v["scale"]
    if type(scale) is not int:
        raise TypeError("scale is not an integer")
    return Decimal(_unscaled(v["value"])).scaleb(-scale, _EXACT)


def _date(v: Any) -> date:
    if type(v) is not int:
        raise TypeError("expected integer days since 1970-01-01")
    return _fromordinal(_EPOCH_ORDINAL + v)


def _timestamp_ms(v: Any) -> datetime:
    if type(v) is not int:
        raise TypeError("expected integer milliseconds since the epoch")
    return _EPOCH + _td(0, 0, 0, v)


def _timestamp_us(v: Any) -> datetime:
    if type(v) is not int:
        raise TypeError("expected integer microseconds since the epoch")
    return _EPOCH + _td(0, 0, v)


def _timestamp_ns(v: Any) -> datetime:
    if type(v) is not int:
        raise TypeError("expected integer nanoseconds since the epoch")
    return _EPOCH + _td(0, 0, v // 1000)


def _time_us(v: Any) -> time:
    if type(v) is not int:
        raise TypeError("expected integer microseconds since midnight")
    if not 0 <= v < _US_PER_DAY:  # PostgreSQL's 24:00:00 has no datetime.time
        raise ValueError("not a time of day (00:00..23:59:59.999999)")
    s, us = divmod(v, 1_000_000)
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return time(h, m, s, us)


def _time_ms(v: Any) -> time:
    if type(v) is not int:
        raise TypeError("expected integer milliseconds since midnight")
    return _time_us(v * 1000)


#: Logical type name → factory(scale parameter) → converter. ZonedTimestamp is deliberately absent
#: (ISO 8601 text is left as is), so it costs nothing.
_FACTORIES: dict[str, Callable[[Any], Callable[[Any], Any]]] = {
    DECIMAL: _decimal_converter,
    VARIABLE_SCALE_DECIMAL: lambda _: _variable_scale_decimal,
    "org.apache.kafka.connect.data.Date": lambda _: _date,
    "io.debezium.time.Date": lambda _: _date,
    "org.apache.kafka.connect.data.Timestamp": lambda _: _timestamp_ms,
    "io.debezium.time.Timestamp": lambda _: _timestamp_ms,
    "io.debezium.time.MicroTimestamp": lambda _: _timestamp_us,
    "io.debezium.time.NanoTimestamp": lambda _: _timestamp_ns,
    "io.debezium.time.MicroTime": lambda _: _time_us,
    "org.apache.kafka.connect.data.Time": lambda _: _time_ms,
    "io.debezium.time.Time": lambda _: _time_ms,
}

# --------------------------------------------------------------------------- signatures and plans
# A signature token describes how one schema converts: (name, scale) for a logical type,
# ("struct", fields_signature) or ("array", item_token); None when it does not convert.
# A fields signature is a tuple of (field, token) for the fields whose token is not None.


def _fields_signature(fields: Any) -> tuple[Any, ...]:
    sig = []
    for f in fields:
        name = f.get("name")
        if name is not None:
            if name in _FACTORIES:
                if name == DECIMAL:
                    params = f.get("parameters")
                    sig.append((f["field"], (name, params.get("scale") if params else None)))
                else:
                    sig.append((f["field"], (name, None)))
            continue  # a named type we do not convert (Json, Enum, Uuid, geometry, ...)
        t = f.get("type")
        if t == "struct" or t == "array":
            token = _nested_token(f, t)
            if token is not None:
                sig.append((f["field"], token))
    return tuple(sig)


def _schema_token(s: Any) -> tuple[Any, ...] | None:
    """The token of a whole schema (an array's items, a key's schema)."""
    if type(s) is not dict:
        return None
    name = s.get("name")
    if name is not None:
        if name not in _FACTORIES:
            return None
        params = s.get("parameters") if name == DECIMAL else None
        return (name, params.get("scale") if params else None)
    t = s.get("type")
    return _nested_token(s, t) if t == "struct" or t == "array" else None


def _nested_token(s: dict[str, Any], t: str) -> tuple[Any, ...] | None:
    if t == "struct":
        sub = _fields_signature(s.get("fields") or ())
        return ("struct", sub) if sub else None
    item = _schema_token(s.get("items"))
    return ("array", item) if item is not None else None


def _converter(token: tuple[Any, ...]) -> Callable[[Any], Any]:
    kind = token[0]
    if kind == "struct":
        plan = _compile(token[1])

        def struct(v: Any) -> Any:
            if type(v) is not dict:
                raise TypeError("expected a struct")
            return _apply(v, plan)

        return struct
    if kind == "array":
        item = _converter(token[1])

        def array(v: Any) -> Any:
            if type(v) is not list:
                raise TypeError("expected an array")
            return [None if x is None else item(x) for x in v]

        return array
    return _FACTORIES[kind](token[1])


def _describe(token: tuple[Any, ...]) -> str:
    kind = token[0]
    if kind == "struct":
        return "struct"
    if kind == "array":
        return f"array of {_describe(token[1])}"
    return kind if token[1] is None else f"{kind} (scale {token[1]})"


def _compile(sig: tuple[Any, ...]) -> tuple[tuple[str, Callable[[Any], Any], str], ...]:
    return tuple((field, _converter(token), _describe(token)) for field, token in sig)


def _plan_for(struct: Any) -> tuple[tuple[str, Callable[[Any], Any], str], ...] | None:
    """The compiled converter for a row struct's schema, or None when no column needs converting."""
    try:
        sig = _fields_signature(struct["fields"])
        if not sig:
            return None
        plan = _PLANS.get(sig)
        if plan is None:
            plan = _compile(sig)
            if len(_PLANS) >= CACHE_SIZE:
                _PLANS.clear()
            _PLANS[sig] = plan
        return plan
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise InvalidRecord("map", "not_a_change_event",
                            f"Debezium event with a malformed Kafka Connect schema part: {exc!r}") from None


def _apply(row: dict[str, Any], plan: tuple[tuple[str, Callable[[Any], Any], str], ...]) -> dict[str, Any]:
    out = row.copy()
    key = ""
    v = None
    try:
        for key, conv, _ in plan:
            v = out.get(key)
            if v is not None:
                out[key] = conv(v)
    except (ValueError, TypeError, OverflowError, KeyError, ArithmeticError) as exc:
        desc = next((d for k, _, d in plan if k == key), "?")
        raise InvalidRecord("map", "invalid_value",
                            f"Debezium field {key!r} ({desc}): {_show(v)} does not decode: {exc}") from None
    return out


def _not_event(why: str) -> InvalidRecord:
    return InvalidRecord("map", "not_a_change_event", f"not a Debezium change event: {why}")


# --------------------------------------------------------------------------- entry points


Plan = tuple[tuple[str, Callable[[Any], Any], str], ...]
#: The converters of an event's row images: (before, after); None where no column needs one.
ImagePlans = tuple[Plan | None, Plan | None]


def unwrap(doc: Any) -> Change:
    """Decode one Debezium change-event value (schema form or envelope) into a :class:`Change`."""
    if type(doc) is not dict and not isinstance(doc, dict):
        raise _not_event(f"expected an object, got {_show(doc) if doc is not None else 'null (a tombstone?)'}")
    if len(doc) == 2 and "payload" in doc and "schema" in doc:
        payload = doc["payload"]
        if isinstance(payload, dict):
            schema = doc["schema"]
            return envelope_change(payload, schema_plans(schema) if type(schema) is dict else (None, None))
        if payload is None:
            raise _not_event("the schema part's payload is null (a tombstone?)")
    return envelope_change(doc, (None, None))


def schema_plans(schema: dict[str, Any]) -> ImagePlans:
    """The converters of the ``before`` and ``after`` images a schema part describes (Debezium uses one
    row schema for both: the plan is shared when the struct names match)."""
    fields = schema.get("fields")
    if type(fields) is not list:
        raise _not_event("schema part without a 'fields' list")
    before_s = after_s = None
    for f in fields:
        name = f.get("field") if type(f) is dict else None
        if name == "before":
            before_s = f
        elif name == "after":
            after_s = f
        if before_s is not None and after_s is not None:
            break
    plan_after = _plan_for(after_s) if after_s is not None else None
    if before_s is None:
        return None, plan_after
    name = before_s.get("name")
    if after_s is not None and name is not None and name == after_s.get("name"):
        return plan_after, plan_after
    return _plan_for(before_s), plan_after


def envelope_change(env: dict[str, Any], plans: ImagePlans) -> Change:
    """The :class:`Change` of an envelope (the payload of the schema form), its images converted by ``plans``."""
    op = env.get("op")
    if type(op) is not str or op not in _OPS:
        if op is None:
            raise _not_event("no 'op' field")
        raise _not_event(f"unknown op {_show(op)} (expected one of c, r, u, d, t)")
    before = env.get("before")
    after = env.get("after")
    if after is not None and not isinstance(after, dict):
        raise _not_event(f"op {op!r} with 'after' {_show(after)}, expected an object")
    if after is None and op in _NEED_AFTER:
        raise _not_event(f"op {op!r} without an 'after' row image")
    if before is not None and not isinstance(before, dict):
        raise _not_event(f"op {op!r} with 'before' {_show(before)}, expected an object or null")
    source = env.get("source")
    if source is not None and not isinstance(source, dict):
        raise _not_event(f"'source' is {_show(source)}, expected an object")
    plan_before, plan_after = plans
    if after is not None and plan_after is not None:
        after = _apply(after, plan_after)
    if before is not None and plan_before is not None:
        before = _apply(before, plan_before)
    return Change(op, before, after, source)


#: How the JSON converter joins the two parts: ``{"schema":<schema>,"payload":<envelope>}``, compact.
_SCHEMA_HEAD, _PAYLOAD_KEY = b'{"schema":', b',"payload":'


class SchemaParts:
    """Reads JSON-converter events with ``schemas.enable=true`` parsing each distinct schema part once.

    The schema part is the same for every event of a table (≈ 2-3 KB, most of the event), so parsing
    it per record would cost several times the payload. :meth:`change` looks the raw bytes before
    ``,"payload":`` up among the schema parts seen (each one verified, when first seen, to be exactly
    the event's whole ``"schema"`` value), and parses only the payload. Anything else -- another
    shape, a schema part not seen yet, a payload that does not parse alone -- is the caller's: it
    decodes the whole event and hands it to :meth:`remember`. Not thread-safe (one per mapper thread
    owner); bounded to ``CACHE_SIZE`` schema parts.
    """

    def __init__(self, loads: Callable[[bytes], Any]) -> None:
        self._loads = loads
        self._plans: dict[bytes, ImagePlans] = {}

    def change(self, value: bytes) -> Change | None:
        """The event's Change when its schema part is known and its payload parses alone, else None."""
        if not value.startswith(_SCHEMA_HEAD):
            return None
        cut = value.find(_PAYLOAD_KEY)
        plans = self._plans.get(value[:cut]) if cut > 0 else None
        if plans is None or not value.endswith(b"}"):
            return None
        try:
            payload = self._loads(value[cut + len(_PAYLOAD_KEY):-1])
        except Exception:  # noqa: BLE001 - not the simple shape after all: the whole event decides
            return None
        return envelope_change(payload, plans) if type(payload) is dict else None

    def remember(self, value: bytes, doc: Any) -> None:
        """Keep the schema part of ``value`` (decoded as ``doc``) when it is one the fast path can use."""
        if type(doc) is not dict or len(doc) != 2 or type(doc.get("schema")) is not dict \
                or type(doc.get("payload")) is not dict or not value.startswith(_SCHEMA_HEAD):
            return
        cut = value.find(_PAYLOAD_KEY)
        if cut <= 0:
            return
        head = value[:cut]
        try:  # the bytes before the payload must be the whole schema part and nothing else
            if self._loads(head + b"}") != {"schema": doc["schema"]}:
                return
            plans = schema_plans(doc["schema"])
        except Exception:  # noqa: BLE001 - a schema part that does not stand alone: never cached
            return
        if len(self._plans) >= CACHE_SIZE:
            self._plans.clear()
        self._plans[head] = plans


def unwrap_key(doc: Any) -> Any:
    """A decoded record key: ``{"schema": ..., "payload": ...}`` → the payload, its values converted per
    the schema like :func:`unwrap`'s row images; anything else unchanged."""
    if type(doc) is not dict or len(doc) != 2 or "payload" not in doc or "schema" not in doc:
        return doc
    schema = doc["schema"]
    payload = doc["payload"]
    if payload is None or type(schema) is not dict:
        return payload
    if isinstance(payload, dict):
        if schema.get("type", "struct") != "struct" or "fields" not in schema:
            return payload
        plan = _plan_for(schema)
        return payload if plan is None else _apply(payload, plan)
    try:  # a primitive key, e.g. a Decimal
        token = _schema_token(schema)
        if token is None:
            return payload
        conv = _converter(token)
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise InvalidRecord("map", "not_a_change_event",
                            f"Debezium key with a malformed Kafka Connect schema part: {exc!r}") from None
    try:
        return conv(payload)
    except (ValueError, TypeError, OverflowError, KeyError, ArithmeticError) as exc:
        raise InvalidRecord("map", "invalid_value",
                            f"Debezium key ({_describe(token)}): {_show(payload)} does not decode: {exc}") from None

"""Record → row mapping: decode a Kafka record once and coerce it into a typed row tuple.

Design
------
This code runs for every consumed record, so all the work that depends only on
the configuration is done once, in :class:`Mapper.__init__` ("compiling" the
pipeline's column specs):

* Each column becomes a plan entry ``(name, source, getter, coercer, default,
  required)``. The *getter* is a closure ``getter(record, doc)`` specialised for
  the column's source (``$``, a one-key path ``$.a``, a longer path, or a Kafka
  metadata field) and returns the raw value, or ``None`` for "missing"; the
  *coercer* is a closure specialised for the column's PostgreSQL base type that
  turns a raw value into the Python value psycopg 3 adapts to that type
  (``int``, ``Decimal``, ``float``, ``str``, ``bool``, ``datetime``, ``date``,
  ``UUID``, ``bytes``). The default value is coerced once up front, so a bad
  default is a configuration error (``ValueError``), not a per-record one.
* The value is decoded with :func:`orjson.loads` only if some column or the
  ordering key reads a ``$`` path, and the "top level must be an object" check
  runs once per record, not once per column.
* :meth:`Mapper.map` is then a tight loop: one ``loads``, one getter and at
  most one coercer call per column. Coercers raise a private lightweight
  exception carrying an error class; ``map`` adds the column name and source and
  re-raises it as :class:`~ingest.errors.InvalidRecord`. A final catch-all turns
  anything unexpected into ``InvalidRecord`` too, so a hostile record can never
  crash a pipeline: it is dead-lettered instead.

Null handling: a JSON ``null`` is treated exactly like a missing field (a
required column raises ``missing_field``; an optional one gets its default or
``None``). Records with a null value (tombstones) always raise
``InvalidRecord('decode', 'tombstone', ...)``, even when no column reads the
value; the pipeline decides whether to skip or dead-letter them.

Metadata sources (``@key``, ``@header.NAME``) hold bytes. A ``bytea`` column
takes them raw; any other column gets them decoded as UTF-8 text and then
coerced like a JSON string (so ``@key`` into ``bigint`` parses ``b"42"``, and
``@key`` into ``jsonb`` stores a JSON string). ``@topic`` is a string,
``@partition``/``@offset``/``@timestamp`` are integers (``@timestamp`` is epoch
milliseconds, so it can feed a ``timestamptz`` column directly); ``@stream`` is
the topic and partition as one signed 64-bit id (:func:`ingest.core.routing.stream_id`).
A record ``replay-dlq --to topic`` republished stands for its origin:
``@topic``, ``@partition``, ``@offset`` and ``@stream`` are the original record's.

Known limit: orjson parses integers outside the 64-bit range as ``float``, so a
JSON number such as ``123456789012345678901234567890`` loses precision in a
``numeric`` column. Send such values as JSON strings (``"1234..."``), which are
parsed exactly.
"""

from __future__ import annotations

import base64
import binascii
import re
import sys
from collections.abc import Callable, Mapping
from datetime import date, datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Context, Decimal, InvalidOperation
from typing import Any
from uuid import UUID

import orjson

from ingest.config.base import ColumnSpec
from ingest.core.dialects import CH_INT_RANGES, ChType, ch_type, pg_base_type
from ingest.core.fastmap import FastColumn, compile_fast_map
from ingest.core.routing import stream_id
from ingest.errors import InvalidRecord
from ingest.types import Record

__all__ = ["Mapper"]

Getter = Callable[[Record, Any], Any]
Coercer = Callable[[Any], Any]

_UTC = timezone.utc
_EPOCH_AWARE = datetime(1970, 1, 1, tzinfo=_UTC)
_EPOCH_NAIVE = datetime(1970, 1, 1)

_INT_RANGES: dict[str, tuple[int, int]] = {
    "smallint": (-(2**15), 2**15 - 1),
    "integer": (-(2**31), 2**31 - 1),
    "bigint": (-(2**63), 2**63 - 1),
}
_REAL_MAX = 3.4028234663852886e38
#: PostgreSQL numeric: at most 131072 digits before the decimal point, 16383 after.
_NUMERIC_MAX_ADJUSTED = 131071
_NUMERIC_MIN_EXPONENT = -16383

_INT_STR = re.compile(r"[+-]?[0-9]+")
_NUM_STR = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
#: A JSON ``\u0000`` escape preceded by an even number of backslashes (i.e. a real escape,
#: not the text ``\\u0000``).
_JSON_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_TRUE = frozenset({"true", "t", "1"})
_FALSE = frozenset({"false", "f", "0"})
_MAX_DATETIME_TEXT = 64
_fromisoformat = datetime.fromisoformat

_PATH_STEP = re.compile(r"\.([^.\[\]]+)|\[([0-9]+)\]")
_METADATA = ("@key", "@topic", "@partition", "@offset", "@stream", "@timestamp")


class _Bad(Exception):
    """Raised by getters/coercers; ``map`` wraps it into InvalidRecord with the column context."""

    __slots__ = ("error_class", "detail")

    def __init__(self, error_class: str, detail: str) -> None:
        self.error_class = error_class
        self.detail = detail


def _show(value: Any) -> str:
    """A short, safe description of a value for error messages."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    try:
        text = repr(value)
    except Exception:  # e.g. an int too long to print
        return f"a {type(value).__name__}"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


# --------------------------------------------------------------------------- coercers
# Each coercer takes a non-None raw value (JSON value, metadata str/int/bytes or a
# config default) and returns the psycopg-ready value, or raises _Bad.


def _int_coercer(base: str) -> Coercer:
    lo, hi = _INT_RANGES[base] if base in _INT_RANGES else CH_INT_RANGES[base]
    # Early rejections before int(): digits beyond any 64-bit value, floats beyond it.
    max_digits = max(19, len(str(hi)))
    float_hi = 1.8446744073709551616e19 if hi >= 2**63 else 9.223372036854775808e18

    def coerce(v: Any) -> int:
        t = type(v)
        if t is int:
            n = v
        elif t is float:
            if not v.is_integer():  # also false for inf / nan
                raise _Bad("invalid_value", f"{_show(v)} is not an integer")
            # Strict bounds: orjson parses an integer literal just below -2**63 as a float
            # that rounds to exactly -2**63, which must not pass as in range.
            if not -9.223372036854775808e18 < v < float_hi:
                raise _Bad("out_of_range", f"{_show(v)} is out of range for {base}")
            n = int(v)
        elif t is str:
            if not _INT_STR.fullmatch(v):
                raise _Bad("invalid_value", f"{_show(v)} is not an integer")
            if len(v.lstrip("+-").lstrip("0")) > max_digits:
                raise _Bad("out_of_range", f"{_show(v)} is out of range for {base}")
            n = int(v)
        else:
            raise _Bad("wrong_type", f"expected an integer, got {_show(v)}")
        if n < lo or n > hi:
            raise _Bad("out_of_range", f"{n} is out of range for {base}")
        return n

    return coerce


def _check_decimal(d: Decimal, v: Any) -> Decimal:
    if not d.is_finite():
        raise _Bad("invalid_value", f"{_show(v)} is not a finite number")
    if d.adjusted() > _NUMERIC_MAX_ADJUSTED or d.as_tuple().exponent < _NUMERIC_MIN_EXPONENT:  # type: ignore[operator]
        raise _Bad("out_of_range", f"{_show(v)} is out of range for numeric")
    return d


def _numeric(v: Any) -> Decimal:
    t = type(v)
    if t is float:
        if v - v != 0.0:  # inf or nan; any finite double fits PostgreSQL numeric
            raise _Bad("invalid_value", f"{_show(v)} is not a finite number")
        return Decimal(repr(v))  # shortest repr: no binary noise (0.1 -> Decimal('0.1'))
    if t is int:
        d = Decimal(v)
        return d if v.bit_length() <= 64 else _check_decimal(d, v)
    if t is str:
        if not _NUM_STR.fullmatch(v):
            raise _Bad("invalid_value", f"{_show(v)} is not a number")
        try:
            d = Decimal(v)
        except InvalidOperation:
            raise _Bad("invalid_value", f"{_show(v)} is not a number") from None
        # Without an exponent the digit counts are bounded by the length: no check needed.
        if len(v) <= 16000 and "e" not in v and "E" not in v:
            return d
        return _check_decimal(d, v)
    if t is Decimal:
        return _check_decimal(v, v)
    raise _Bad("wrong_type", f"expected a number, got {_show(v)}")


def _float_coercer(base: str) -> Coercer:
    limit = _REAL_MAX if base in ("real", "Float32") else sys.float_info.max

    def coerce(v: Any) -> float:
        t = type(v)
        if t is float:
            f = v
        elif t is int:
            try:
                f = float(v)
            except OverflowError:
                raise _Bad("out_of_range", f"{_show(v)} is out of range for {base}") from None
        elif t is str:
            if not _NUM_STR.fullmatch(v):
                raise _Bad("invalid_value", f"{_show(v)} is not a number")
            f = float(v)
        else:
            raise _Bad("wrong_type", f"expected a number, got {_show(v)}")
        if -limit <= f <= limit:
            return f
        if f != f:
            raise _Bad("invalid_value", f"{_show(v)} is not a number")
        raise _Bad("out_of_range", f"{_show(v)} is out of range for {base}")

    return coerce


def _text(v: Any) -> str:
    t = type(v)
    if t is str:
        if "\x00" in v:
            raise _Bad("invalid_value", "text contains a NUL character (\\x00), which PostgreSQL rejects")
        return v
    if t is bool:
        return "true" if v else "false"
    if t is int or t is float:
        return str(v)
    raise _Bad("wrong_type", f"expected a string, got {_show(v)}")


def _boolean(v: Any) -> bool:
    t = type(v)
    if t is bool:
        return v
    if t is str:
        low = v.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise _Bad("invalid_value", f"{_show(v)} is not a boolean")
    if t is int:
        if v == 1:
            return True
        if v == 0:
            return False
        raise _Bad("invalid_value", f"{_show(v)} is not a boolean (only 0 and 1 are)")
    raise _Bad("wrong_type", f"expected a boolean, got {_show(v)}")


def _parse_datetime(v: str) -> datetime:
    if len(v) > _MAX_DATETIME_TEXT:
        raise _Bad("invalid_value", f"{_show(v)} is not an ISO 8601 timestamp")
    try:
        return _fromisoformat(v)
    except ValueError:
        raise _Bad("invalid_value", f"{_show(v)} is not an ISO 8601 timestamp") from None


def _from_epoch_ms(v: int | float, epoch: datetime) -> datetime:
    try:
        return epoch + timedelta(0, 0, 0, v)  # milliseconds=v, passed by position: ~30 % cheaper
    except (OverflowError, ValueError):
        raise _Bad("invalid_value", f"{_show(v)} epoch milliseconds is out of the supported range") from None


def _timestamptz(v: Any) -> datetime:
    if type(v) is str:
        if len(v) <= _MAX_DATETIME_TEXT:
            try:
                dt = _fromisoformat(v)
            except ValueError:
                pass
            else:
                return dt if dt.tzinfo is not None else dt.replace(tzinfo=_UTC)
        raise _Bad("invalid_value", f"{_show(v)} is not an ISO 8601 timestamp")
    t = type(v)
    if t is int or t is float:
        return _from_epoch_ms(v, _EPOCH_AWARE)
    if t is datetime:
        return v if v.tzinfo is not None else v.replace(tzinfo=_UTC)
    raise _Bad("wrong_type", f"expected an ISO 8601 string or epoch milliseconds, got {_show(v)}")


def _to_naive_utc(dt: datetime) -> datetime:
    if dt.tzinfo is None:
        return dt
    try:
        return dt.astimezone(_UTC).replace(tzinfo=None)
    except OverflowError:
        raise _Bad("invalid_value", f"{dt.isoformat()} is out of the supported range in UTC") from None


def _timestamp(v: Any) -> datetime:
    t = type(v)
    if t is str:
        return _to_naive_utc(_parse_datetime(v))
    if t is int or t is float:
        return _from_epoch_ms(v, _EPOCH_NAIVE)
    if t is datetime:
        return _to_naive_utc(v)
    raise _Bad("wrong_type", f"expected an ISO 8601 string or epoch milliseconds, got {_show(v)}")


def _date(v: Any) -> date:
    t = type(v)
    if t is str:
        if len(v) <= 10:
            try:
                return date.fromisoformat(v)
            except ValueError:
                raise _Bad("invalid_value", f"{_show(v)} is not an ISO 8601 date") from None
        return _parse_datetime(v).date()
    if t is date:
        return v
    raise _Bad("wrong_type", f"expected an ISO 8601 date string, got {_show(v)}")


def _json(v: Any) -> str:
    try:
        out = orjson.dumps(v)
    except (TypeError, ValueError) as exc:  # nesting deeper than orjson's limit, non-JSON default
        raise _Bad("invalid_value", f"cannot encode as JSON: {exc}") from None
    if b"\\u0000" in out and _JSON_NUL.search(out):
        raise _Bad("invalid_value", "JSON contains a NUL character (\\u0000), which PostgreSQL rejects")
    return out.decode()


def _uuid(v: Any) -> UUID:
    if type(v) is str:
        if v.isascii():
            try:
                return UUID(v)
            except ValueError:
                pass
        raise _Bad("invalid_value", f"{_show(v)} is not a UUID")
    if type(v) is UUID:
        return v
    raise _Bad("wrong_type", f"expected a UUID string, got {_show(v)}")


def _bytea(v: Any) -> bytes:
    t = type(v)
    if t is bytes:  # raw metadata (@key, @header.NAME) or a config default
        return v
    if t is str:
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise _Bad("invalid_value", f"{_show(v)} is not valid base64") from None
    if t is bytearray or t is memoryview:
        return bytes(v)
    raise _Bad("wrong_type", f"expected a base64 string, got {_show(v)}")


def _coercer_for(base: str) -> Coercer:
    if base in _INT_RANGES:
        return _int_coercer(base)
    if base in ("real", "double precision"):
        return _float_coercer(base)
    simple: dict[str, Coercer] = {
        "numeric": _numeric,
        "text": _text,
        "varchar": _text,
        "boolean": _boolean,
        "timestamptz": _timestamptz,
        "timestamp": _timestamp,
        "date": _date,
        "json": _json,
        "jsonb": _json,
        "uuid": _uuid,
        "bytea": _bytea,
    }
    try:
        return simple[base]
    except KeyError:
        raise ValueError(f"unsupported column type {base!r}") from None


# --------------------------------------------------------------------------- ClickHouse coercers
# Python values clickhouse-connect serialises for the column's type: range-checked, because
# its Native encoder either raises a bare struct.error or, for Decimal, silently wraps.

#: Decimal256 has 76 digits: quantize in a context wide enough for all of them.
_CH_DECIMAL_CONTEXT = Context(prec=100, rounding=ROUND_HALF_UP)
_CH_DATE_MIN, _CH_DATE_MAX = date(1970, 1, 1), date(2149, 6, 6)
_CH_DT64_MIN = datetime(1900, 1, 1, tzinfo=_UTC)
_CH_DT64_MAX = datetime(2299, 12, 31, 23, 59, 59, 999999, tzinfo=_UTC)


def _ch_string(v: Any) -> str:
    t = type(v)
    if t is str:  # ClickHouse String holds any bytes, NUL included
        return v
    if t is bool:
        return "true" if v else "false"
    if t is int or t is float:
        return str(v)
    raise _Bad("wrong_type", f"expected a string, got {_show(v)}")


def _ch_json(v: Any) -> str:
    try:
        return orjson.dumps(v).decode()
    except (TypeError, ValueError) as exc:
        raise _Bad("invalid_value", f"cannot encode as JSON: {exc}") from None


def _ch_date(v: Any) -> date:
    d = _date(v)
    if not _CH_DATE_MIN <= d <= _CH_DATE_MAX:
        raise _Bad("out_of_range", f"{d.isoformat()} is out of range for Date (1970-01-01..2149-06-06)")
    return d


_ONE_MICRO = timedelta(microseconds=1)
_CH_DT64_MIN_MS = (_CH_DT64_MIN - _EPOCH_AWARE) // timedelta(milliseconds=1)
_CH_DT64_MAX_MS = (_CH_DT64_MAX - _EPOCH_AWARE) // timedelta(milliseconds=1)


def _ch_datetime64(precision: int) -> Coercer:
    """DateTime64(p) as its raw value: ticks of 10**-p s since the epoch (UTC), an ``int``.

    clickhouse-connect writes an int column as is, which spares building a datetime
    per value here and converting it back there. Input as for ``timestamptz``: ISO
    8601 (naive = UTC) or epoch milliseconds; sub-tick digits are floored.
    """
    per_ms_mul = 10 ** (precision - 3) if precision >= 3 else 0
    per_ms_div = 10 ** (3 - precision) if precision < 3 else 1
    per_second = 10**precision

    def out_of_range(v: Any) -> _Bad:
        return _Bad("out_of_range", f"{_show(v)} is out of range for DateTime64 (1900-01-01..2299-12-31)")

    def coerce(v: Any) -> int:
        if type(v) is int:  # epoch milliseconds: exact integer arithmetic
            if not _CH_DT64_MIN_MS <= v <= _CH_DT64_MAX_MS:
                raise out_of_range(v)
            return v * per_ms_mul if per_ms_mul else v // per_ms_div
        dt = _timestamptz(v)  # aware; naive input is taken as UTC
        try:
            ok = _CH_DT64_MIN <= dt <= _CH_DT64_MAX
        except OverflowError:  # pragma: no cover - exotic offsets at datetime.min/max
            ok = False
        if not ok:
            raise out_of_range(dt.isoformat())
        return (dt - _EPOCH_AWARE) // _ONE_MICRO * per_second // 1_000_000

    return coerce


def _ch_decimal(precision: int, scale: int) -> Coercer:
    """Decimal(P, S): rounded half away from zero to S places (as PostgreSQL's numeric(P,S)); at
    most P-S digits before the point, else out_of_range."""
    quantum = Decimal(1).scaleb(-scale)
    limit = Decimal(10) ** (precision - scale)
    int_limit = 10 ** (precision - scale)
    float_limit = float(int_limit) / 10  # below it, any float's integer part surely fits
    name = f"Decimal({precision}, {scale})"

    def general(v: Any) -> Decimal:
        d = _numeric(v)
        if not d.is_finite() or d.adjusted() >= precision - scale + 1:
            raise _Bad("out_of_range", f"{_show(v)} is out of range for {name}")
        try:
            q = d.quantize(quantum, context=_CH_DECIMAL_CONTEXT)
        except InvalidOperation:
            raise _Bad("out_of_range", f"{_show(v)} is out of range for {name}") from None
        if q.copy_abs() >= limit:
            raise _Bad("out_of_range", f"{_show(v)} is out of range for {name}")
        return q

    def coerce(v: Any) -> Decimal:
        # Fast paths for values that need no rounding (the common case); the rest: general().
        t = type(v)
        if t is int:
            if -int_limit < v < int_limit:
                return Decimal(v)
        elif t is float:
            if -float_limit < v < float_limit:
                text = repr(v)
                dot = text.find(".")
                if dot >= 0 and "e" not in text and len(text) - dot - 1 <= scale:
                    return Decimal(text)
        return general(v)

    return coerce


def _ch_array(inner: ChType) -> Coercer:
    element = _ch_coercer(inner)
    nullable = inner.nullable

    def coerce(v: Any) -> list[Any]:
        if type(v) is not list:
            raise _Bad("wrong_type", f"expected an array, got {_show(v)}")
        out = []
        for x in v:
            if x is None:
                if not nullable:
                    raise _Bad("wrong_type", f"null element in a non-Nullable Array({inner.name})")
                out.append(None)
            else:
                out.append(element(x))
        return out

    return coerce


def _ch_coercer(t: ChType) -> Coercer:
    """The coercer for a parsed ClickHouse type (``Nullable`` is handled by ``map``: None stays None)."""
    kind = t.kind
    if kind == "int":
        return _int_coercer(t.name)
    if kind == "float":
        return _float_coercer(t.name)
    if kind == "decimal":
        return _ch_decimal(t.precision, t.scale)
    if kind == "datetime64":
        return _ch_datetime64(t.precision)
    if kind in ("nullable", "lowcardinality"):
        assert t.inner is not None
        return _ch_coercer(t.inner)
    if kind == "array":
        assert t.inner is not None
        return _ch_array(t.inner)
    simple: dict[str, Coercer] = {
        "string": _ch_string,
        "bool": _boolean,
        "date": _ch_date,
        "uuid": _uuid,
        "json": _ch_json,
    }
    return simple[kind]


#: Epoch milliseconds whose datetime is in range (0001-01-01 .. 9999-12-31): ``_from_epoch_ms`` cannot fail.
_EPOCH_MS_MIN = (datetime.min - _EPOCH_NAIVE) // timedelta(milliseconds=1)
_EPOCH_MS_MAX = (datetime.max - _EPOCH_NAIVE) // timedelta(milliseconds=1)


def _pg_inline(base: str) -> tuple[Any, ...] | None:
    """The fast path's inline check for a PostgreSQL column (see ingest.core.fastmap).

    Each matches its coercer for the values it accepts: ``_numeric`` for a finite
    float, ``_timestamptz`` / ``_timestamp`` for in-range epoch milliseconds.
    """
    if base in _INT_RANGES:
        return ("int", *_INT_RANGES[base])
    if base in ("text", "varchar"):
        return ("text", True)
    if base == "numeric":
        return ("decimal",)
    if base == "timestamptz":
        return ("epoch_ms", _EPOCH_AWARE, _EPOCH_MS_MIN, _EPOCH_MS_MAX)
    if base == "timestamp":
        return ("epoch_ms", _EPOCH_NAIVE, _EPOCH_MS_MIN, _EPOCH_MS_MAX)
    return None


def _ch_inline(t: ChType) -> tuple[Any, ...] | None:
    """The fast path's inline check for a ClickHouse column (``Nullable``/``LowCardinality`` see through)."""
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    if t.kind == "int":
        return ("int", *CH_INT_RANGES[t.name])
    if t.kind == "string":
        return ("text", False)
    return None


# --------------------------------------------------------------------------- getters
# A getter returns the raw value or None when the source is missing (or JSON null).


def _parse_path(path: str) -> tuple[tuple[bool, str | int], ...]:
    """``$.a[0].b`` → ``((True, 'a'), (False, 0), (True, 'b'))``; True marks a dict key."""
    if not path.startswith("$"):
        raise ValueError(f"invalid JSON path {path!r}")
    steps: list[tuple[bool, str | int]] = []
    pos = 1
    while pos < len(path):
        m = _PATH_STEP.match(path, pos)
        if not m:
            raise ValueError(f"invalid JSON path {path!r}")
        steps.append((True, m.group(1)) if m.group(1) is not None else (False, int(m.group(2))))
        pos = m.end()
    return tuple(steps)


def _path_getter(steps: tuple[tuple[bool, str | int], ...], top_is_object: bool) -> Getter:
    if not steps:
        return lambda record, doc: doc
    if len(steps) == 1 and steps[0][0] and top_is_object:
        key = steps[0][1]
        return lambda record, doc: doc.get(key)  # map() has checked doc is a dict

    def get(record: Record, doc: Any) -> Any:
        node = doc
        for is_key, step in steps:
            if is_key:
                if type(node) is not dict:
                    return None
                node = node.get(step)
            else:
                if type(node) is not list or step >= len(node):  # type: ignore[operator]
                    return None
                node = node[step]  # type: ignore[index]
            if node is None:
                return None
        return node

    return get


def _decode_text(raw: bytes | None, what: str) -> str | None:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("invalid_value", f"{what} is not valid UTF-8") from None


def _header_getter(name: str, as_text: bool) -> Getter:
    what = f"header {name!r}"

    def get(record: Record, doc: Any) -> Any:
        for hname, hvalue in record.headers:
            if hname == name:
                return _decode_text(hvalue, what) if as_text else hvalue
        return None

    return get


def _metadata_getter(source: str, as_text: bool) -> Getter:
    if source == "@key":
        if as_text:
            return lambda record, doc: _decode_text(record.key, "Kafka key")
        return lambda record, doc: record.key
    # A republished record stands for its origin (ingest.types.Record.origin).
    if source == "@topic":
        return lambda record, doc: record.topic if record.origin is None else record.origin[0]
    if source == "@partition":
        return lambda record, doc: record.partition if record.origin is None else record.origin[1]
    if source == "@offset":
        return lambda record, doc: record.offset if record.origin is None else record.origin[2]
    if source == "@stream":
        return lambda record, doc: (stream_id(record.topic, record.partition) if record.origin is None
                                    else stream_id(record.origin[0], record.origin[1]))
    if source == "@timestamp":
        return lambda record, doc: record.timestamp_ms
    if source.startswith("@header.") and len(source) > len("@header."):
        return _header_getter(source[len("@header."):], as_text)
    raise ValueError(f"invalid source {source!r}: use $-paths or one of {', '.join(_METADATA)} @header.NAME")


def _render_key(value: Any) -> bytes | None:
    """Ordering key bytes: str → UTF-8, int → decimal digits, bytes as is, other JSON → compact JSON."""
    t = type(value)
    if value is None:
        return None
    if t is bytes:
        return value
    if t is str:
        return value.encode("utf-8")
    if t is int:
        return str(value).encode()
    try:
        return orjson.dumps(value)
    except (TypeError, ValueError) as exc:
        raise _Bad("invalid_value", f"cannot encode as JSON: {exc}") from None


# --------------------------------------------------------------------------- Mapper


class Mapper:
    """Turns a :class:`~ingest.types.Record` into a row tuple plus its ordering key.

    Build one per pipeline (construction does all the parsing); :meth:`map` is
    then cheap and thread-safe (the mapper holds no mutable state).

    ``columns``: target columns in row order; each column reads ``spec.source``
    (default ``$.<name>``) and is coerced to ``spec.type``.
    ``key_path``: where the ordering key comes from; ``None`` means the Kafka
    message key.
    ``dialect``: the type system of ``spec.type`` -- ``postgres`` (values for
    psycopg) or ``clickhouse`` (values for clickhouse-connect: ``UInt8``..``Int64``
    range-checked, ``Float32/64``, ``Decimal(P,S)`` rounded to S places and
    range-checked, ``String``, ``LowCardinality(String)``, ``Bool``, ``Date``,
    ``DateTime64(p)`` (as its raw int: ticks since the epoch), ``UUID``, ``JSON`` (compact JSON
    text for a String column), ``Nullable(T)``, ``Array(T)`` from a JSON array).
    Default: each spec's ``dialect`` class attribute
    (:class:`~ingest.config.ClickHouseColumnSpec` says ``clickhouse``), else
    ``postgres``. A ClickHouse column that is neither Nullable nor an Array and
    has no default is required (a missing value is a ``missing_field`` map
    error rather than ClickHouse's silent zero); a missing Array is ``[]``.

    Raises ``ValueError`` for an unsupported column type, an invalid source or
    key path, or a default that is not valid for its column's type.
    """

    __slots__ = ("column_names", "column_types", "_plan", "_needs_json", "_needs_object", "_key_getter", "_fast")

    def __init__(self, columns: Mapping[str, ColumnSpec], key_path: str | None = None, *,
                 dialect: str | None = None) -> None:
        if dialect not in (None, "postgres", "clickhouse"):
            raise ValueError(f"unknown dialect {dialect!r}")
        if not columns:
            raise ValueError("at least one column is required")
        sources = {name: spec.source or f"$.{name}" for name, spec in columns.items()}
        all_paths = [s for s in sources.values() if s.startswith("$")]
        if key_path is not None and key_path.startswith("$"):
            all_paths.append(key_path)
        parsed = {p: _parse_path(p) for p in all_paths}
        #: Decode the value only if a $-path is read; check for a top-level object only
        #: if some path starts with a key step.
        self._needs_json = bool(parsed)
        self._needs_object = any(steps and steps[0][0] for steps in parsed.values())

        plan = []
        types = []
        fast_columns = []
        for name, spec in columns.items():
            required = spec.required
            implicit_default = None
            if (dialect or getattr(spec, "dialect", "postgres")) == "clickhouse":
                try:
                    ch = ch_type(spec.type)
                except ValueError as exc:
                    raise ValueError(f"column {name!r}: {exc}") from None
                base, full = "", ch.name
                coerce = _ch_coercer(ch)
                inline = _ch_inline(ch)
                if ch.kind == "array":
                    implicit_default = []
                elif not ch.nullable and spec.default is None:
                    required = True
            else:
                try:
                    base, full = pg_base_type(spec.type)
                except ValueError as exc:
                    raise ValueError(f"column {name!r}: {exc}") from None
                coerce = _coercer_for(base)
                inline = _pg_inline(base)
            source = sources[name]
            doc_key: str | None = None
            if source.startswith("$"):
                steps = parsed[source]
                getter = _path_getter(steps, self._needs_object)
                if len(steps) == 1 and steps[0][0]:
                    doc_key = str(steps[0][1])
            else:
                try:
                    getter = _metadata_getter(source, as_text=base != "bytea")
                except ValueError as exc:
                    raise ValueError(f"column {name!r}: {exc}") from None
            default = implicit_default
            if spec.default is not None:
                try:
                    default = coerce(spec.default)
                except _Bad as exc:
                    raise ValueError(f"column {name!r}: default is not a valid {full}: {exc.detail}") from None
            plan.append((name, source, getter, coerce, default, required))
            fast_columns.append(FastColumn(getter, doc_key, coerce, default, required, inline))
            types.append(full)
        self._plan: tuple[tuple[str, str, Getter, Coercer, Any, bool], ...] = tuple(plan)
        #: Column names in row order.
        self.column_names: tuple[str, ...] = tuple(columns)
        #: Normalised types in row order, e.g. ``('bigint', 'numeric(12,2)')`` or
        #: ``('UInt64', 'Decimal(12, 2)')``.
        self.column_types: tuple[str, ...] = tuple(types)

        if key_path is None:
            self._key_getter: Getter | None = None
        elif key_path.startswith("$"):
            self._key_getter = _path_getter(parsed[key_path], self._needs_object)
        else:
            self._key_getter = _metadata_getter(key_path, as_text=False)
        self._fast = compile_fast_map(fast_columns, needs_json=self._needs_json, needs_object=self._needs_object,
                                      key_getter=self._key_getter, render_key=_render_key)

    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """Return ``(row, ordering_key)`` for ``record`` (same contract as :meth:`map_generic`).

        Tries the compiled fast path (:mod:`ingest.core.fastmap`) first; any
        record it declines goes through the generic loop.
        """
        try:
            return self._fast(record)
        except Exception:  # noqa: BLE001 - the generic loop gives the precise result or error
            return self.map_generic(record)

    def map_generic(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """Return ``(row, ordering_key)`` for ``record``.

        ``row`` holds one psycopg-ready value per column, in ``column_names``
        order (``None`` for SQL NULL). ``ordering_key`` is ``record.key`` when
        the mapper has no key path; otherwise the value at the key path as
        bytes (str → UTF-8, int → decimal digits, metadata bytes as is, other
        JSON → compact JSON), or ``None`` when missing or null.

        Raises :class:`~ingest.errors.InvalidRecord` — and nothing else, for
        any input — when the record cannot be mapped:

        - stage ``decode``: ``tombstone`` (null value), ``invalid_utf8``,
          ``invalid_json``;
        - stage ``map``: ``not_an_object``, ``missing_field``, ``wrong_type``,
          ``out_of_range``, ``invalid_value``.
        """
        value = record.value
        if value is None:
            raise InvalidRecord("decode", "tombstone", "record value is null (tombstone)")
        doc: Any = None
        if self._needs_json:
            try:
                doc = orjson.loads(value)
            except Exception as exc:  # noqa: BLE001 - JSONDecodeError, or TypeError for a non-bytes value
                raise _decode_error(value, exc) from None
            if self._needs_object and type(doc) is not dict:
                raise InvalidRecord(
                    "map", "not_an_object", f"record value must be a JSON object, got {_json_kind(doc)}"
                )
        name = source = ""
        try:
            row = []
            append = row.append
            for name, source, get, coerce, default, required in self._plan:
                raw = get(record, doc)
                if raw is None:
                    if required:
                        raise _Bad("missing_field", "required value is missing or null")
                    append(default)
                else:
                    append(coerce(raw))
            name = source = ""
            key_getter = self._key_getter
            key = record.key if key_getter is None else _render_key(key_getter(record, doc))
        except _Bad as exc:
            raise InvalidRecord("map", exc.error_class, _context(name, source) + exc.detail) from None
        except Exception as exc:  # noqa: BLE001 - defensive: never let a record crash the pipeline
            detail = f"internal mapping error {type(exc).__name__}: {exc}"[:300]
            raise InvalidRecord("map", "invalid_value", _context(name, source) + detail) from None
        return tuple(row), key


def _context(name: str, source: str) -> str:
    return f"column {name!r} (source {source}): " if name else "ordering key: "


def _json_kind(doc: Any) -> str:
    if isinstance(doc, list):
        return "an array"
    if isinstance(doc, str):
        return "a string"
    if isinstance(doc, bool):
        return "a boolean"
    if doc is None:
        return "null"
    return "a number"


def _decode_error(value: Any, exc: Exception) -> InvalidRecord:
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            bytes(value).decode("utf-8")
        except UnicodeDecodeError as uexc:
            return InvalidRecord("decode", "invalid_utf8", f"record value is not valid UTF-8: {uexc}"[:300])
    return InvalidRecord("decode", "invalid_json", f"record value is not valid JSON: {exc}"[:300])

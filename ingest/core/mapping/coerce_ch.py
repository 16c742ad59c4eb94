"""ClickHouse coercers: values clickhouse-connect serialises for the column's type, range-checked (its Native
encoder either raises a bare struct.error or, for Decimal, silently wraps). And their inline checks."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import ROUND_HALF_UP, Context, Decimal, InvalidOperation
from typing import Any

import orjson

from ingest.core.dialects import CH_INT_RANGES, ChType
from ingest.core.mapping.coerce_pg import (
    _as_text,
    _boolean,
    _date,
    _float_coercer,
    _int_coercer,
    _json_default,
    _numeric,
    _timestamptz,
    _uuid,
)
from ingest.core.mapping.common import (
    _EPOCH_AWARE,
    _UTC,
    Coercer,
    _Bad,
    _show,
)

# --------------------------------------------------------------------------- ClickHouse coercers
# Python values clickhouse-connect serialises for the column's type: range-checked, because
# its Native encoder either raises a bare struct.error or, for Decimal, silently wraps.

#: Decimal256 has 76 digits: quantize in a context wide enough for all of them.
_CH_DECIMAL_CONTEXT = Context(prec=100, rounding=ROUND_HALF_UP)
_CH_DATE_MIN, _CH_DATE_MAX = date(1970, 1, 1), date(2149, 6, 6)
_CH_DT64_MIN = datetime(1900, 1, 1, tzinfo=_UTC)
_CH_DT64_MAX = datetime(2299, 12, 31, 23, 59, 59, 999999, tzinfo=_UTC)


#: ``String``: any text, NUL included (ClickHouse strings hold any bytes).
_ch_string = _as_text


def _ch_json(v: Any) -> str:
    try:
        return orjson.dumps(v, default=_json_default).decode()
    except (TypeError, ValueError) as exc:
        raise _Bad("invalid_value", f"cannot encode as JSON: {exc}") from None


def _ch_date(v: Any) -> date:
    d = _date(v)
    if not _CH_DATE_MIN <= d <= _CH_DATE_MAX:
        raise _Bad("out_of_range", f"{d.isoformat()} is out of range for Date (1970-01-01..2149-06-06)")
    return d


_ONE_MICRO = timedelta(microseconds=1)
_CH_DT64_MIN_MS = (_CH_DT64_MIN - _EPOCH_AWARE) // timedelta(milliseconds=1)
#: The last epoch millisecond a DateTime64 holds (2299-12-31 23:59:59.999 UTC).
CH_DT64_MAX_MS = _CH_DT64_MAX_MS = (_CH_DT64_MAX - _EPOCH_AWARE) // timedelta(milliseconds=1)


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




def _ch_inline(t: ChType) -> tuple[Any, ...] | None:
    """The fast path's inline check for a ClickHouse column (``Nullable``/``LowCardinality`` see through)."""
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    if t.kind == "int":
        return ("int", *CH_INT_RANGES[t.name])
    if t.kind == "string":
        return ("text", False)
    return None

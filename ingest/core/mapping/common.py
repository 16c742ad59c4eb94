"""What the coercers and getters share: the error they raise, value descriptions, constants. Internal to
:mod:`ingest.core.mapping`."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import orjson

from ingest.types import Record

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


def float_decimal(v: float) -> Decimal:
    """The Decimal of a finite float's shortest round-trip text: ``0.1 -> Decimal('0.1')``, no binary noise.

    That text is ``repr(v)``'s digits and exponent; orjson writes the same ones (a property test in
    tests/unit/test_mapping.py holds them equal as Decimals) at about half the cost of ``repr``.
    The compiled fast path inlines this expression (``ingest.core.mapping.fastmap``).
    """
    return Decimal(orjson.dumps(v).decode())


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



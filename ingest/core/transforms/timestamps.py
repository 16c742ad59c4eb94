"""The ``timestamp`` step's parsers: a field's value → an aware :class:`datetime.datetime`.

Formats: ``epoch_s`` / ``epoch_ms`` / ``epoch_us`` / ``epoch_ns`` (JSON numbers or numeric text;
integers are converted exactly to microseconds, ``epoch_ns`` truncated to them), ``iso8601``
(``datetime.fromisoformat``: ``Z`` and offsets), ``strptime`` (a pattern). Naive results are
read in the step's time zone. The output is ISO 8601 text with its offset, in UTC, which every
timestamp column of the row mapper takes.
"""

from __future__ import annotations

import datetime
import zoneinfo
from collections.abc import Callable
from typing import Any

_UTC = datetime.timezone.utc
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=_UTC)
#: microseconds per unit (a divisor for nanoseconds)
_EPOCH_SCALE = {"epoch_s": 1_000_000, "epoch_ms": 1_000, "epoch_us": 1}


class TimestampError(ValueError):
    """A value the step cannot read as a timestamp (the message says why, quoting a short prefix)."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parser(fmt: str, pattern: str | None, zone: str) -> Callable[[Any], str]:
    """``value -> ISO 8601 text (UTC, with offset)`` for ``fmt``; raises :class:`TimestampError`."""
    tz = _UTC if zone == "UTC" else zoneinfo.ZoneInfo(zone)

    def aware(dt: datetime.datetime) -> str:
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=tz)
        try:
            return dt.astimezone(_UTC).isoformat()
        except (OverflowError, ValueError):
            raise TimestampError(f"{_show(dt.isoformat())} is out of range in UTC") from None

    if fmt.startswith("epoch_"):
        scale = _EPOCH_SCALE.get(fmt)

        def from_epoch(value: Any) -> str:
            number = _number(value)
            if type(number) is int:
                micros = number * scale if scale is not None else number // 1000
            else:
                micros = round(number * scale) if scale is not None else round(number / 1000)
            try:
                return (_EPOCH + datetime.timedelta(microseconds=micros)).isoformat()
            except OverflowError:
                raise TimestampError(f"{_show(value)} ({fmt}) is out of the supported range") from None

        return from_epoch
    if fmt == "iso8601":

        def from_iso(value: Any) -> str:
            if type(value) is not str:
                raise TimestampError(f"expected ISO 8601 text, got {_show(value)}")
            try:
                return aware(datetime.datetime.fromisoformat(value))
            except ValueError:
                raise TimestampError(f"{_show(value)} is not ISO 8601") from None

        return from_iso
    assert fmt == "strptime" and pattern is not None

    def from_pattern(value: Any) -> str:
        if type(value) is not str:
            raise TimestampError(f"expected text matching {pattern!r}, got {_show(value)}")
        try:
            return aware(datetime.datetime.strptime(value, pattern))
        except ValueError:
            raise TimestampError(f"{_show(value)} does not match {pattern!r}") from None

    return from_pattern


def _number(value: Any) -> int | float:
    t = type(value)
    if t is int or t is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise TimestampError(f"{_show(value)} is not a finite number")
        return value
    if t is str:
        try:
            return int(value)
        except ValueError:
            pass
        try:
            number = float(value)
        except ValueError:
            raise TimestampError(f"expected an epoch number, got {_show(value)}") from None
        return _number(number)
    raise TimestampError(f"expected an epoch number, got {_show(value)}")

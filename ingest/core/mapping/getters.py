"""Getters: where a column's raw value comes from -- a path into the decoded document, or the record's
metadata (``@key``, ``@topic``, ``@partition``, ``@offset``, ``@stream``, ``@timestamp``, ``@header.NAME``)."""

from __future__ import annotations

from typing import Any

import orjson

from ingest.core.mapping.common import (
    _METADATA,
    _PATH_STEP,
    Getter,
    _Bad,
)
from ingest.core.routing import stream_id
from ingest.types import Record

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

"""``format: json``: record values are JSON documents (orjson)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from ingest.errors import InvalidRecord
from ingest.formats.base import decode_each
from ingest.types import Record


class JsonDecoder:
    """UTF-8 JSON values. Errors: ``invalid_utf8`` (the bytes are not UTF-8), ``invalid_json``.

    orjson parses integers outside the 64-bit range as ``float``; send such values
    as JSON strings to keep them exact (see the mapper's coercers).
    """

    name = "json"
    document = "a JSON object"

    def __init__(self, pipeline: Any = None, field: str = "value") -> None:
        """JSON needs nothing of the pipeline's settings; ``field``: decode record values or keys."""
        self._key = field == "key"

    def decode(self, record: Record) -> Any:
        value = record.key if self._key else record.value
        try:
            return orjson.loads(value)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - JSONDecodeError, or TypeError for a non-bytes value
            raise decode_error(value, exc, "key" if self._key else "value") from None

    def decode_batch(self, records: Sequence[Record]) -> list[Any | InvalidRecord]:
        return decode_each(self, records)

    def value_loader(self) -> Callable[[bytes], Any]:
        return orjson.loads


def decode_error(value: Any, exc: Exception, field: str = "value") -> InvalidRecord:
    """Why ``value`` (the record's value or key) is not JSON: not UTF-8, or not JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            bytes(value).decode("utf-8")
        except UnicodeDecodeError as uexc:
            return InvalidRecord("decode", "invalid_utf8", f"record {field} is not valid UTF-8: {uexc}"[:300])
    return InvalidRecord("decode", "invalid_json", f"record {field} is not valid JSON: {exc}"[:300])

"""The common part of the decoders whose schemas live in a Schema Registry (``avro``, ``protobuf``,
``json_schema``): the schema store, ``prepare``, ``describe``, and their place in the wire format.

A subclass says how to parse a registered schema (:meth:`RegistryDecoder.parse`, and the
registry's ``format`` query parameter it needs) and how to decode one record (``decode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ingest.errors import InvalidRecord
from ingest.formats import wire
from ingest.formats.base import decode_each
from ingest.formats.schemas import SchemaStore
from ingest.types import Record


class RegistryDecoder:
    """Values (or keys, ``field="key"``) in the Confluent wire format, schemas from ``schema_registry``."""

    name = "registry"
    document = "a record"
    #: the registry's ``format`` query parameter for this format's schemas (Protobuf: ``serialized``)
    registry_format: str | None = None
    #: a check to pass before the first schemas are fetched (:meth:`defer_check`)
    _pending_check: Callable[[], None] | None = None

    def __init__(self, pipeline: Any, schema_registry: Any = None, field: wire.Field = "value") -> None:
        if schema_registry is None:
            raise ValueError(f"format {self.name} needs a schema_registry section")
        self._field: wire.Field = field
        self._store: SchemaStore | None = SchemaStore(schema_registry, self.parse, fmt=self.registry_format)

    @staticmethod
    def parse(schema: Any, store: SchemaStore) -> Any:
        """A registered ``Schema`` → what :meth:`decode` decodes with; ValueError when unusable."""
        raise NotImplementedError

    @staticmethod
    def uses_schema_registry(pipeline: Any, field: str = "value") -> bool:
        return True

    @property
    def store(self) -> SchemaStore | None:
        """The registry's schemas, parsed."""
        return self._store

    def defer_check(self, check: Callable[[], None]) -> None:
        """Run ``check`` in :meth:`prepare`, before any schema is fetched, until it returns once (a
        start-up check the registry could not answer then). While it raises TransientError the
        pipeline holds the chunk and tries again; any other exception it raises goes up (the pipeline
        stops). Called before the pipeline runs; :meth:`prepare` runs on the pipeline thread only."""
        self._pending_check = check

    def prepare(self, records: Sequence[Record]) -> None:
        """Fetch the schemas ``records`` name that are not known yet (TransientError while the registry
        cannot answer: the pipeline holds the chunk). A deferred check (:meth:`defer_check`) first."""
        pending = self._pending_check
        if pending is not None:
            pending()
            self._pending_check = None
        if self._store is not None:
            self._store.prepare(records, self._field)

    def decode(self, record: Record) -> Any:
        raise NotImplementedError

    def describe(self, record: Record | None) -> str | None:
        """Which schema wrote ``record`` (``value schema id 7``), for map errors; None when it names none."""
        return wire.describe(record, self._field) if record is not None else None

    def decode_batch(self, records: Sequence[Record]) -> list[Any | InvalidRecord]:
        return decode_each(self, records)

    def value_loader(self) -> Any:
        """None: the schema id can be in a header, which only :meth:`decode` sees."""
        return None

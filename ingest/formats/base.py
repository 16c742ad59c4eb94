"""The decoder port: a record's value bytes → the document the mapper's ``$`` paths address.

One module per format (``ingest/formats/<name>.py``), chosen by a pipeline's
``format:`` through :mod:`ingest.formats.registry`. A decoder gets the whole
record -- its topic and headers are the context a registry-backed format needs
(the subject, a schema id carried in a header) -- and can decode a batch at once
(the columnar path will). It decides nothing about columns: the mapper maps the
document it returns, and alone decides map errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ingest.errors import InvalidRecord
from ingest.types import Record


class Decoder(Protocol):
    """Decodes record values of one format. Thread-safe; construction does no I/O."""

    #: the format's name in ``format:``
    name: str
    #: what the document is called in messages (``a JSON object``, ``an Avro record``)
    document: str

    def decode(self, record: Record) -> Any:
        """The decoded value of ``record`` (never called for a tombstone).

        Raises :class:`~ingest.errors.InvalidRecord` with stage ``decode`` (and a class naming why:
        ``invalid_json``, ``invalid_utf8``, ...) for bytes that do not decode -- the record is
        poison; :class:`~ingest.errors.TransientError` when a service the format needs is down.
        """
        ...

    def decode_batch(self, records: Sequence[Record]) -> list[Any | InvalidRecord]:
        """:meth:`decode` for each record: its document, or the InvalidRecord it would raise."""
        ...

    # Optional, for formats whose schemas live in a registry:
    #   prepare(records): fetch the schemas ``records`` name, so decoding them makes no request;
    #       TransientError while the registry cannot answer (the pipeline holds the chunk);
    #   describe(record) -> str | None: which schema wrote ``record`` ("value schema id 7"), for errors.

    def value_loader(self) -> Callable[[bytes], Any] | None:
        """A plain ``bytes -> document`` function for the compiled fast path, when the format needs no
        context; any exception it raises sends the record to :meth:`decode`, which decides. None: the
        fast path calls :meth:`decode`."""
        ...


def decode_each(decoder: Decoder, records: Sequence[Record]) -> list[Any | InvalidRecord]:
    """The per-record ``decode_batch`` every decoder can use."""
    out: list[Any | InvalidRecord] = []
    for record in records:
        try:
            out.append(decoder.decode(record))
        except InvalidRecord as exc:
            out.append(exc)
    return out


def prepare_all(*decoders: Decoder | None) -> Callable[[Sequence[Record]], None] | None:
    """One ``prepare(records)`` for the decoders that have one (a registry format's value and key
    decoders fetch the schemas a chunk names); None when none has."""
    prepares = [p for p in (getattr(d, "prepare", None) for d in decoders if d is not None) if p is not None]
    if not prepares:
        return None
    if len(prepares) == 1:
        return prepares[0]  # type: ignore[no-any-return]

    def prepare(records: Sequence[Record]) -> None:
        for each in prepares:
            each(records)

    return prepare

"""Schemas from a Confluent Schema Registry, parsed once per id and kept: the one place registry
answers are classified.

A :class:`SchemaStore` wraps confluent-kafka's ``SchemaRegistryClient`` (lookups, auth, TLS,
several URLs) with a parsed-schema cache per schema id (or GUID). A schema
id never changes meaning, so parsed schemas never expire. What each answer means:

- found: parsed by the format's ``parse`` function; a schema the format cannot use (another
  schema type, a schema that does not parse) makes its records poison, ``schema_mismatch``;
- not found (error code 40403): the records are poison, ``unknown_schema`` -- remembered for
  :data:`UNKNOWN_TTL_S` so one bad id costs one request per interval, then asked again (a schema
  registered later is found). But when the registry holds no subject at all (an empty registry,
  or a URL that points at the wrong one) nothing is dead-lettered: :class:`FatalPipelineError`;
- unreachable, timing out, 401/403, 408/429, 5xx, or an answer that is not the Registry's:
  :class:`~ingest.errors.TransientError` -- the pipeline pauses its partitions and retries, and
  never dead-letters a record for it.

Messages name the URL and the status, never credentials (URLs cannot carry any: see
:mod:`ingest.config.formats`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ingest.config.formats import SchemaRegistrySettings
from ingest.errors import FatalPipelineError, InvalidRecord, TransientError
from ingest.formats import wire
from ingest.formats.wire import SchemaRef, ref_text
from ingest.types import Record

#: Seconds an id the registry did not know stays known-unknown before it is asked for again.
UNKNOWN_TTL_S = 30.0
#: At most this many poison ids are remembered (a topic of garbage could name any number).
MAX_POISON = 10_000


class MissingReference(ValueError):
    """A schema references another (by subject and version) that the registry does not have: the
    schema cannot be used now, and may be once the reference is registered."""

Parse = Callable[[Any, "SchemaStore"], Any]


class SchemaStore:
    """Parsed schemas by reference (an id or a GUID), looked up in one registry. Thread-safe.

    ``parse(schema, store)`` turns the registry's ``Schema`` (text, type, references) into what the
    format decodes with; it raises ValueError for a schema it cannot use, and may call
    :meth:`referenced` to fetch the schemas a schema references. ``fmt`` is the registry's
    ``format`` query parameter (Protobuf asks for ``serialized``).
    """

    def __init__(self, settings: SchemaRegistrySettings, parse: Parse, *, fmt: str | None = None,
                 client: Any = None) -> None:
        if client is None:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            client = SchemaRegistryClient(settings.client_config())
        self.client = client
        self.where = ", ".join(settings.url)
        self._parse = parse
        self._fmt = fmt
        #: every parsed schema, by reference -- read without the lock on the hot path
        self.parsed: dict[SchemaRef, Any] = {}
        self._poison: dict[SchemaRef, tuple[float, InvalidRecord]] = {}
        self._lock = threading.Lock()
        self._ever_found = False

    # -- lookups ----------------------------------------------------------------------
    def get(self, ref: SchemaRef) -> Any:
        """The parsed schema of ``ref``. Raises InvalidRecord (``unknown_schema``, ``schema_mismatch``),
        TransientError (the registry cannot answer now) or FatalPipelineError (it holds nothing)."""
        parsed = self.parsed.get(ref)
        if parsed is not None:
            return parsed
        return self._fetch(ref)

    def prepared(self, ref: SchemaRef) -> Any:
        """The parsed schema of ``ref`` for decoding a record of a prepared chunk: what :meth:`prepare`
        found -- the schema, or the poison it remembered (whatever its age: the chunk was judged with
        it) -- so decoding makes no request. Only a reference nobody prepared is fetched now."""
        parsed = self.parsed.get(ref)
        if parsed is not None:
            return parsed
        poison = self._poison.get(ref)
        if poison is not None:
            raise poison[1]
        return self._fetch(ref)

    def resolve(self, refs: Iterable[SchemaRef]) -> None:
        """Fetch every reference not yet known, so that decoding the records that name them makes no
        request. Raises TransientError / FatalPipelineError as :meth:`get`; poison ids are left for
        the records' own decode to report."""
        for ref in refs:
            if ref not in self.parsed:
                try:
                    self._fetch(ref)
                except InvalidRecord:
                    pass

    def prepare(self, records: Sequence[Record], field: wire.Field = "value") -> None:
        """Resolve, in one pass, the schemas a chunk of records names (in their values, or keys) that
        this store does not hold yet: so decoding them makes no request. TransientError as :meth:`get`."""
        prefixes: set[bytes] = set()
        refs: set[SchemaRef] = set()
        key = field == "key"
        last = b""
        for record in records:
            data = record.key if key else record.value
            if data is None:
                continue
            if not record.headers and data[:1] == b"\x00" and len(data) >= 5:
                prefix = data[1:5]
                if prefix != last:  # runs of one schema are the rule: one set insert per run
                    prefixes.add(prefix)
                    last = prefix
            else:
                try:
                    refs.add(wire.split(record, field)[0])
                except InvalidRecord:
                    continue  # the record's own decode reports it
        refs.update(int.from_bytes(prefix, "big") for prefix in prefixes)
        missing = [ref for ref in refs if ref not in self.parsed]
        if missing:
            self.resolve(sorted(missing, key=str))

    def referenced(self, subject: str, version: int) -> Any:
        """A schema another references (by subject and version), for ``parse``; TransientError when the
        registry cannot answer."""
        try:
            return self.client.get_version(subject, version, fmt=self._fmt).schema
        except Exception as exc:  # noqa: BLE001 - classified below
            if _not_found(exc):
                raise MissingReference(f"the schema it references, {subject} version {version}, is not in the "
                                       f"schema registry at {self.where}") from None
            raise self._transient(exc, f"referenced schema {subject} version {version}") from None

    def latest(self, subject: str) -> Any | None:
        """The latest registered version of ``subject`` (``RegisteredSchema``), None when the subject
        does not exist; TransientError when the registry cannot answer."""
        try:
            return self.client.get_latest_version(subject)
        except Exception as exc:  # noqa: BLE001 - classified below
            if _not_found(exc):
                return None
            raise self._transient(exc, f"the latest version of subject {subject}") from None

    def subjects(self) -> list[str]:
        try:
            return list(self.client.get_subjects())
        except Exception as exc:  # noqa: BLE001 - classified below
            raise self._transient(exc, "the list of subjects") from None

    # -- internals --------------------------------------------------------------------
    def _fetch(self, ref: SchemaRef) -> Any:
        with self._lock:
            parsed = self.parsed.get(ref)
            if parsed is not None:
                return parsed
            poison = self._poison.get(ref)
            if poison is not None and time.monotonic() < poison[0]:
                raise poison[1]
            try:
                if type(ref) is int:
                    schema = self.client.get_schema(ref, fmt=self._fmt)
                else:
                    schema = self.client.get_schema_by_guid(ref, fmt=self._fmt)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not _not_found(exc):
                    raise self._transient(exc, ref_text(ref)) from None
                if not self._ever_found and not self.subjects():
                    raise FatalPipelineError(
                        f"the schema registry at {self.where} holds no subjects at all, so no record can be "
                        f"decoded ({ref_text(ref)} is unknown): is the url right? Stopping rather than dead-letter "
                        "the topic", error_class="schema_registry_empty") from None
                return self._remember_poison(ref, InvalidRecord(
                    "decode", "unknown_schema", f"{ref_text(ref)} is not in the schema registry at {self.where}"))
            try:
                parsed = self._parse(schema, self)
            except ValueError as exc:
                return self._remember_poison(ref, InvalidRecord(
                    "decode", "schema_mismatch", f"{ref_text(ref)} cannot be used: {exc}"[:400]),
                    forever=not isinstance(exc, MissingReference))
            self.parsed[ref] = parsed
            self._ever_found = True
            return parsed

    def _remember_poison(self, ref: SchemaRef, error: InvalidRecord, *, forever: bool = False) -> Any:
        now = time.monotonic()
        if len(self._poison) >= MAX_POISON:  # expired entries first, then the oldest half (never fresh ones:
            self._poison = {r: p for r, p in self._poison.items() if p[0] > now}  # a chunk being decoded
            if len(self._poison) >= MAX_POISON:                                   # relies on them)
                by_expiry = sorted(self._poison.items(), key=lambda item: item[1][0])
                self._poison = dict(by_expiry[len(by_expiry) // 2:])
        self._poison[ref] = (float("inf") if forever else now + UNKNOWN_TTL_S, error)
        raise error

    def _transient(self, exc: BaseException, what: str) -> TransientError:
        """The registry could not answer for ``what``: a TransientError saying how."""
        status = getattr(exc, "http_status_code", None)
        if status is None:
            how = f"{type(exc).__name__}: {exc}"[:200]
        elif status == 404:
            code = getattr(exc, "error_code", None)
            how = ("HTTP 404 without a Schema Registry error code (is the url a Schema Registry?)"
                   if code in (None, -1) else f"HTTP 404 (error code {code})")
        else:
            how = f"HTTP {status}" + (" (authentication)" if status in (401, 403) else "")
        return TransientError(f"schema registry at {self.where} could not give {what}: {how}",
                              error_class="schema_registry_unavailable")


def _not_found(exc: BaseException) -> bool:
    """The registry answered that the schema (40403), subject (40401) or version (40402) does not exist."""
    return getattr(exc, "http_status_code", None) == 404 and getattr(exc, "error_code", None) in (40401, 40402, 40403)

"""Compile a mapper's column plan into one straight-line Python function (the fast path).

:class:`~ingest.core.mapping.Mapper` keeps a generic loop over its plan that
produces precise errors. That loop costs a tuple unpack, a getter call and a
coercer call per column per record. This module generates, once per mapper,
source code equivalent to the loop for the *successful* case only, with:

* one-key paths (``$.a``) read inline as ``doc.get('a')``;
* the commonest values checked inline: an ``int`` already in its column's range,
  a ``str`` going to a text column (no NUL for PostgreSQL), a finite ``float``
  going to a ``numeric`` column, epoch milliseconds (``int``) going to a
  timestamp column;
* every other value handed to the column's own coercer (the same function the
  generic loop calls).

Contract: ``fast(record)`` either returns exactly what the generic
``Mapper.map`` would return for that record, or raises *any* exception
(``_Fallback``, a coercer's error, ``orjson.JSONDecodeError``...), in which case
the caller runs the generic loop, which then returns the result or raises the
precise :class:`~ingest.errors.InvalidRecord`. Poison records therefore cost two
attempts; good records cost one cheap one. Property tests check the equivalence.

The typed tier (:func:`compile_typed_map`): for a JSON pipeline whose ``$`` sources are all
one-key paths, the same generated code reads a msgspec ``Struct`` decoded in C
(:func:`typed_document`) instead of orjson's dict -- no dict is built, no
``doc.get`` is called. The typed decoder accepts only what orjson decodes to the
very same values (a JSON object of those keys, each a scalar); every other value
goes to the orjson tier, then to the generic loop, so neither the rows nor the
poison decisions change (``tests/unit/test_fastmap_typed.py`` holds it to that).

Only constants of this module and the mapper's own callables reach the
generated code (bound as globals of the generated function); column names and
paths appear only as ``repr()`` string literals, never as code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, Union

import msgspec
import orjson

from ingest.core.routing import stream_id

FastMap = Callable[[Any], tuple[tuple[Any, ...], bytes | None]]


#: Epoch milliseconds ``0 <= v < 2**42`` (1970 to 2109): ``datetime.fromtimestamp(v / 1000, tz)`` is exactly
#: ``epoch + timedelta(milliseconds=v)`` there -- ``v / 1000`` is within 0.47 µs of the true instant, so
#: rounding to whole microseconds recovers it (checked in tests/unit/test_mapping.py) -- at about half the cost.
EXACT_FROMTIMESTAMP_MS = 2**42


class _Fallback(Exception):
    """The fast path declines this record; the generic loop decides."""


@dataclass(frozen=True, slots=True)
class FastColumn:
    """What the generator needs to know about one column.

    ``getter``: the generic ``getter(record, doc)``; ``doc_key`` when the source is
    a one-key path read from a dict document (then ``doc.get(doc_key)`` is inlined).
    ``inline``: ``("int", lo, hi)``, ``("text", forbid_nul)``, ``("decimal",)`` (a finite float becomes
    ``common.float_decimal(v)``), ``("epoch_ms", epoch, lo, hi)`` (an int in ``[lo, hi]`` becomes
    ``epoch + timedelta(milliseconds=v)``; for an aware epoch, ``datetime.fromtimestamp`` where that is
    exact: ``EXACT_FROMTIMESTAMP_MS``) or ``None`` (always call ``coerce``). Each inline branch
    must compute exactly what ``coerce`` returns for the values it accepts.
    ``default``: the value for a missing optional column (shared object, as in the generic loop).
    ``metadata``: the source when it is one of :data:`INLINE_METADATA` (then the read is inlined
    instead of calling ``getter``; it must read what that getter reads).
    """

    getter: Callable[[Any, Any], Any]
    doc_key: str | None
    coerce: Callable[[Any], Any]
    default: Any
    required: bool
    inline: tuple[Any, ...] | None
    metadata: str | None = None
    #: the getter reads the document (a ``$`` path); False for metadata and ``@key.$`` sources
    reads_doc: bool = False


#: Metadata sources whose read the generated code inlines: the expression (of ``record`` and ``o``,
#: the record's ``origin``) that ``ingest.core.mapping.getters._metadata_getter`` evaluates for each.
#: A republished record stands for its origin. ``@stream`` ids are memoised per (topic, partition).
INLINE_METADATA = {
    "@topic": "record.topic if o is None else o[0]",
    "@partition": "record.partition if o is None else o[1]",
    "@offset": "record.offset if o is None else o[2]",
    "@stream": "_stream(record.topic, record.partition) if o is None else _stream(o[0], o[1])",
    "@timestamp": "record.timestamp_ms",
}

#: ``stream_id`` is a signed 64-bit integer, never None: a column of at least that range takes it unchecked.
STREAM_ID_MIN, STREAM_ID_MAX = -(2**63), 2**63 - 1

#: At most this many (topic, partition) stream ids are memoised per mapper (then the memo starts over).
STREAM_MEMO_SIZE = 65_536


def memoised_stream_id(stream_id: Callable[[str, int], int]) -> Callable[[str, int], int]:
    """``stream_id`` memoised in a bounded dict (a digest per record costs more than the lookup)."""
    memo: dict[tuple[str, int], int] = {}

    def stream(topic: str, partition: int) -> int:
        try:
            return memo[topic, partition]
        except KeyError:
            if len(memo) >= STREAM_MEMO_SIZE:
                memo.clear()
            sid = memo[topic, partition] = stream_id(topic, partition)
            return sid

    return stream


def compile_fast_map(columns: Sequence[FastColumn], *, needs_json: bool, needs_object: bool,
                     key_getter: Callable[[Any, Any], Any] | None,
                     render_key: Callable[[Any], bytes | None],
                     loads: Callable[[bytes], Any] | None = orjson.loads,
                     decode: Callable[[Any], Any] | None = None, given_doc: bool = False) -> FastMap:
    """Return ``fast(record) -> (row, ordering_key)`` (see the module contract).

    The document comes from ``loads(value)`` (a format's plain loader, e.g. orjson) or, when the
    format has none, from ``decode(record)``. ``given_doc``: ``fast(record, doc)`` maps an
    already decoded document instead (a change event's row image, ``ingest.cdc``).
    """
    env = _base_env(render_key)
    env.update(_loads=loads, _decode=decode)
    if given_doc:
        lines = ["def fast(record, doc):"]
        if needs_object:
            lines += ["    if type(doc) is not _dict:", "        raise _Fallback"]
    else:
        lines = ["def fast(record):", "    value = record.value", "    if value is None:", "        raise _Fallback"]
    if given_doc:
        pass
    elif needs_json:
        lines.append("    doc = _loads(value)" if loads is not None else "    doc = _decode(record)")
        if needs_object:
            lines += ["    if type(doc) is not _dict:", "        raise _Fallback"]
    else:
        lines.append("    doc = None")
    names = _row_lines(lines, columns, env, needs_object)
    lines.append(_key_line(key_getter, env, "doc"))
    return _define(lines, names, env, "<ingest.fastmap>")


def _row_lines(lines: list[str], columns: Sequence[FastColumn], env: dict[str, Any], needs_object: bool,
               fields: dict[str, str] | None = None) -> list[str]:
    """Append the lines that set every column's ``c<i>`` to ``lines``; return the names ``c0 ...``."""
    if any(col.metadata is not None for col in columns):
        lines.append("    o = record.origin")
    for i, col in enumerate(columns):
        lines += _column_lines(i, col, env, needs_object, fields)
    return [f"c{i}" for i in range(len(columns))]


def _key_line(key_getter: Callable[[Any, Any], Any] | None, env: dict[str, Any], doc: str) -> str:
    """The line that sets ``key``: the record's key, or ``key_getter(record, <doc>)`` rendered."""
    if key_getter is None:
        return "    key = record.key"
    env["key_getter"] = key_getter
    return f"    key = _render_key(key_getter(record, {doc}))"


def _base_env(render_key: Callable[[Any], bytes | None]) -> dict[str, Any]:
    """The globals every generated function starts from (its own callables are added to them)."""
    return {"_Fallback": _Fallback, "_render_key": render_key, "_stream": memoised_stream_id(stream_id),
            "_dict": dict, "_int": int, "_str": str, "_float": float, "_Decimal": Decimal, "_dumps": orjson.dumps,
            "_timedelta": timedelta, "_fromts": datetime.fromtimestamp}


def _define(lines: list[str], names: list[str], env: dict[str, Any], filename: str) -> FastMap:
    """Finish a generated ``fast`` (return the row of ``names`` and ``key``), compile it in ``env``, return it."""
    row = "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
    lines.append(f"    return {row}, key")
    code = compile("\n".join(lines) + "\n", filename, "exec")
    exec(code, env)  # noqa: S102 - generated from fixed templates; config values are repr() literals
    return env["fast"]  # type: ignore[no-any-return]


def _column_lines(i: int, col: FastColumn, env: dict[str, Any], needs_object: bool,
                  fields: dict[str, str] | None = None) -> list[str]:
    """The generated lines that set ``c<i>`` from the document; names they use are added to ``env``.

    Read ``v<i>`` (a plain ``doc.get`` for a top-level key -- with ``fields``, the typed
    document's attribute for that key -- else the getter);
    missing: the default or ``_Fallback`` when required; the column's inline
    fast check when it has one; otherwise its coercer.
    """
    v, c = f"v{i}", f"c{i}"
    kind = col.inline[0] if col.inline else None
    if (col.metadata == "@stream" and kind == "int"
            and col.inline[1] <= STREAM_ID_MIN and col.inline[2] >= STREAM_ID_MAX):  # type: ignore[index]
        return [f"    {c} = {INLINE_METADATA[col.metadata]}"]  # a signed 64-bit id by construction: no check
    env[f"coerce{i}"] = col.coerce
    lines = []
    if col.doc_key is not None and fields is not None:
        lines.append(f"    {v} = doc.{fields[col.doc_key]}")
    elif col.doc_key is not None and needs_object:
        lines.append(f"    {v} = doc.get({col.doc_key!r})")
    elif col.metadata is not None:
        lines.append(f"    {v} = {INLINE_METADATA[col.metadata]}")
    else:
        env[f"get{i}"] = col.getter
        lines.append(f"    {v} = get{i}(record, doc)")
    lines.append(f"    if {v} is None:")
    if col.required:
        lines.append("        raise _Fallback")
    else:
        env[f"default{i}"] = col.default
        lines.append(f"        {c} = default{i}")
    if kind == "int":
        _, lo, hi = col.inline  # type: ignore[misc]
        lines.append(f"    elif type({v}) is _int and {lo!r} <= {v} <= {hi!r}:")
        lines.append(f"        {c} = {v}")
    elif kind == "text":
        forbid_nul = col.inline[1]  # type: ignore[index]
        cond = f"type({v}) is _str" + (f" and '\\x00' not in {v}" if forbid_nul else "")
        lines.append(f"    elif {cond}:")
        lines.append(f"        {c} = {v}")
    elif kind == "decimal":  # finite: v - v is 0.0 (inf - inf and nan are nan)
        lines.append(f"    elif type({v}) is _float and {v} - {v} == 0.0:")
        lines.append(f"        {c} = _Decimal(_dumps({v}).decode())")  # common.float_decimal, inline
    elif kind == "epoch_ms":
        _, epoch, lo, hi = col.inline  # type: ignore[misc]
        env[f"epoch{i}"] = epoch
        if epoch.tzinfo is not None:  # aware: fromtimestamp is exact (and ~2x cheaper) in this range
            env[f"tz{i}"] = epoch.tzinfo
            fast_lo, fast_hi = max(lo, 0), min(hi, EXACT_FROMTIMESTAMP_MS - 1)
            lines.append(f"    elif type({v}) is _int and {fast_lo!r} <= {v} <= {fast_hi!r}:")
            lines.append(f"        {c} = _fromts({v} / 1000, tz{i})")
        lines.append(f"    elif type({v}) is _int and {lo!r} <= {v} <= {hi!r}:")
        lines.append(f"        {c} = epoch{i} + _timedelta(0, 0, 0, {v})")
    lines.append("    else:")
    lines.append(f"        {c} = coerce{i}({v})")
    return lines


#: What a typed document's field may hold: a JSON scalar exactly as orjson decodes it (integers only
#: within the signed 64-bit range, where orjson's are exact ints too), or None (missing or null).
_SCALAR = Union[str, bool, Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)], float, None]  # noqa: UP007


def typed_document(keys: Sequence[str]) -> Callable[[bytes], Any]:
    """A C decoder of a JSON object holding at most ``keys`` (each a scalar) into a Struct.

    The Struct's field ``f<j>`` holds ``keys[j]``'s value (None when missing or null). Contract:
    when ``decode(b)`` returns, ``orjson.loads(b)`` returns a dict with no key outside ``keys``
    whose ``.get(keys[j])`` equals ``f<j>`` in value and type (floats bit for bit). Anything else
    raises: another key (msgspec skips unknown fields without checking what orjson checks: UTF-8,
    numbers beyond a double's range), a nested value, an integer beyond 64 bits, a malformed document.
    """
    return msgspec.json.Decoder(_typed_struct(keys)).decode


#: Narrower field types a lines decoder can be asked for (:func:`typed_lines_decoder`): an integer
#: of the signed 64-bit range (never a bool or a float), or a string; either, or None.
TYPED_FIELDS: dict[str, Any] = {
    "int": Union[Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)], None],  # noqa: UP007
    "str": Union[str, None],  # noqa: UP007
    # any JSON value, as its bytes (null as ``b"null"``): a json / jsonb column of the columnar tier,
    # which parses them with orjson itself
    "raw": msgspec.Raw,
}


def typed_lines_decoder(keys: Sequence[str], fields: Sequence[str | None] | None = None, *,
                        forbid_unknown: bool = True) -> Callable[[bytes], list[Any]]:
    """:func:`typed_document`'s decoder for newline-delimited documents: one C call decodes a batch
    (``msgspec.json.Decoder.decode_lines``); each line holds to :func:`typed_document`'s contract,
    and the whole call raises when any line does. It reads whitespace-separated documents, not
    lines: a blank line yields nothing, a line may hold two documents and a document span two
    lines, so a caller must frame its lines (see ``ingest.core.mapping.columnar._framed``).

    ``fields[j]``, when given and not None, narrows ``keys[j]`` to a :data:`TYPED_FIELDS` type: a
    document whose value there is of another type is refused like a malformed one.

    ``forbid_unknown=False``: a document may hold other keys too, skipped -- msgspec checks their
    syntax, escapes and nesting (deeper than orjson allows is refused) but not two things orjson
    checks: that the bytes are UTF-8 and that a number is within a double's range. A caller must
    check those itself (``ingest.core.mapping.columnar._skippable``)."""
    return msgspec.json.Decoder(_typed_struct(keys, fields, forbid_unknown)).decode_lines


def _typed_struct(keys: Sequence[str], fields: Sequence[str | None] | None = None, forbid_unknown: bool = True) -> Any:
    """The Struct of :func:`typed_document`: field ``f<j>`` is ``keys[j]`` (of type
    ``TYPED_FIELDS[fields[j]]`` when that is given, else any JSON scalar), unknown fields refused
    (unless ``forbid_unknown`` is false)."""
    names = [f"f{j}" for j in range(len(keys))]
    types = [TYPED_FIELDS[f] if f is not None else _SCALAR for f in (fields or [None] * len(keys))]
    return msgspec.defstruct("TypedDocument", [(name, t, None) for name, t in zip(names, types, strict=True)],
                             rename=dict(zip(names, keys, strict=True)), forbid_unknown_fields=forbid_unknown,
                             gc=False)


def typed_keys(columns: Sequence[FastColumn], key_doc_key: str | None) -> list[str] | None:
    """The document keys a typed tier reads (columns first, then the ordering key's), or None when
    some source reads the document other than by one key (a longer path, ``$`` itself) or a key is
    one msgspec cannot name (:func:`unnameable_key`)."""
    keys: list[str] = []
    for col in columns:
        if col.doc_key is not None:
            keys.append(col.doc_key)
        elif col.reads_doc:
            return None
    if key_doc_key is not None:
        keys.append(key_doc_key)
    if any(unnameable_key(key) for key in keys):
        return None
    return list(dict.fromkeys(keys)) or None


def unnameable_key(key: str) -> bool:
    """msgspec cannot name a field so (a backslash, a double quote or a control character)."""
    return '"' in key or "\\" in key or any(ord(ch) < 0x20 for ch in key)


def compile_typed_map(columns: Sequence[FastColumn], keys: Sequence[str], *, untyped: FastMap,
                      key_doc_key: str | None, key_getter: Callable[[Any, Any], Any] | None,
                      render_key: Callable[[Any], bytes | None], misses: list[int]) -> FastMap:
    """The typed tier: ``fast(record)`` like :func:`compile_fast_map`'s, reading :func:`typed_document`.

    ``keys``: from :func:`typed_keys`. A value the typed decoder refuses goes to ``untyped`` (the
    orjson tier; whatever that raises, the caller's generic loop decides) and adds one to ``misses[0]``.
    ``key_getter`` (when ``key_doc_key`` is None) must not read the document.
    """
    fields = {key: f"f{j}" for j, key in enumerate(keys)}
    env = _base_env(render_key)
    env.update(_typed=typed_document(keys), _untyped=untyped, _misses=misses)
    lines = ["def fast(record):", "    value = record.value", "    if value is None:", "        raise _Fallback",
             "    try:", "        doc = _typed(value)", "    except Exception:",
             "        _misses[0] += 1", "        return _untyped(record)"]
    names = _row_lines(lines, columns, env, True, fields)
    lines.append(f"    key = _render_key(doc.{fields[key_doc_key]})" if key_doc_key is not None
                 else _key_line(key_getter, env, "None"))
    return _define(lines, names, env, "<ingest.fastmap.typed>")

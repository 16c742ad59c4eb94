"""Avro datums of one writer schema decoded together, field by field over the whole batch (issue #38).

fastavro decodes one datum per call (≈ 3.5 µs for the bench record, most of it per-call overhead).
For the columnar tier, :func:`compile_batch` turns a parsed writer schema into a reader of many
datums at once: each field is read for every datum in a few numpy operations over the datums'
current offsets (varints, lengths, fixed-width numbers), then made into the Python values fastavro
would return -- text by ``bytes.decode`` (strict), enum symbols, and logical types by fastavro's own
logical readers (``fastavro._read.LOGICAL_READERS``, the functions its reader calls).

Exactness: unlike an object-container block, every datum keeps its own boundaries -- each is read
from its own start and must end exactly at its own end. A datum the reader is not sure of is
*doubtful* and left to fastavro per record (which then decides it, poison or not): a read that
crosses its end, bytes left over, a varint longer than 9 bytes, an ``int`` beyond 32 bits, a
boolean byte other than 0 or 1, a negative length, an enum index or union branch out of range,
text that is not UTF-8. Schemas it does not read (nested records, arrays, maps, fixed, unions
other than with ``null``, named-type references, unknown logical types) compile to None: the
caller decodes those per record.

Pure; numpy is imported only when a schema is compiled, pyarrow only when staged decimals are read
(:func:`_decimal_texts`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

#: A compiled reader: ``read(data, starts, ends)`` → (the values of each field, by field name, one per
#: datum; the doubtful datums, a bool array). ``data``: the datums' bytes (and others around them);
#: ``starts``/``ends``: each datum's offsets in it.
BatchReader = Callable[[bytes, Any, Any], tuple[dict[str, list[Any]], Any]]

#: Longest varint read here: 9 bytes (63 bits); longer ones are fastavro's.
_MAX_VARINT = 9
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class _Batch:
    """The state of one batch: the bytes (as a numpy view, padded so that a read past any datum's end
    stays in the buffer), each datum's current offset and end, and which datums are doubtful."""

    __slots__ = ("np", "data", "buf", "pos", "end", "bad")

    def __init__(self, np: Any, data: bytes, starts: Any, ends: Any) -> None:
        self.np = np
        self.data = data
        self.buf = np.frombuffer(data + bytes(16), dtype=np.uint8)
        self.pos = starts.astype(np.int64)
        self.end = ends.astype(np.int64)
        self.bad = np.zeros(len(starts), dtype=bool)

    def settle(self, sel: Any) -> None:
        """Datums of ``sel`` read past their end are doubtful, and parked at their end (so that every
        later read stays inside the padded buffer)."""
        np = self.np
        over = self.pos[sel] > self.end[sel]
        if over.any():
            idx = sel[over]
            self.bad[idx] = True
            self.pos[idx] = self.end[idx]

    def varint(self, sel: Any) -> Any:
        """The zig-zag varints at the offsets of ``sel`` (int64), the offsets moved past them."""
        np = self.np
        pos = self.pos[sel]
        byte = self.buf[pos].astype(np.uint64)
        value = byte & np.uint64(0x7F)
        length = np.ones(len(sel), dtype=np.int64)
        going = np.nonzero(byte >= 0x80)[0]
        k = 1
        while len(going):
            if k >= _MAX_VARINT:
                self.bad[sel[going]] = True
                break
            byte = self.buf[pos[going] + k].astype(np.uint64)
            value[going] |= (byte & np.uint64(0x7F)) << np.uint64(7 * k)
            length[going] += 1
            going = going[byte >= 0x80]
            k += 1
        self.pos[sel] = pos + length
        self.settle(sel)
        return (value >> np.uint64(1)).astype(np.int64) ^ -(value & np.uint64(1)).astype(np.int64)

    def span(self, sel: Any) -> tuple[list[int], list[int]]:
        """Length-prefixed bytes (``bytes``, ``string``) at the offsets of ``sel``: their (start, end)
        offsets in ``data``, the offsets moved past them; a negative length is doubtful."""
        start, stop = self.span_arrays(sel)
        return start.tolist(), stop.tolist()

    def span_arrays(self, sel: Any) -> tuple[Any, Any]:
        """:meth:`span` as int64 arrays (``start <= stop``, both within the padded buffer)."""
        np = self.np
        n = self.varint(sel)
        negative = n < 0
        if negative.any():
            self.bad[sel[negative]] = True
            n = np.where(negative, 0, n)
        start = self.pos[sel]
        self.pos[sel] = start + n
        self.settle(sel)
        stop = np.minimum(start + n, self.end[sel])
        return start, stop

    def signed_be(self, start: Any, stop: Any) -> Any:
        """The big-endian two's-complement integers of the byte spans ``start``..``stop`` of at most 8
        bytes each, as int64 (an empty span: 0)."""
        np = self.np
        length = stop - start
        value = np.zeros(len(start), dtype=np.uint64)
        for k in range(int(length.max(initial=0))):
            has = k < length
            byte = self.buf[np.where(has, start + k, 0)].astype(np.uint64)
            value = np.where(has, (value << np.uint64(8)) | byte, value)
        signed = value.view(np.int64)
        negative = (length > 0) & (length < 8) & (self.buf[start] >= 0x80)
        if negative.any():  # sign-extend the shorter ones (8 bytes are their own int64)
            signed = np.where(negative, signed - (np.int64(1) << (8 * length)), signed)
        return signed


def compile_batch(schema: Any, through: Collection[str] | None = None,
                  staged: Mapping[str, type] | None = None) -> BatchReader | None:
    """A reader of many datums of the parsed (fastavro) record ``schema``, or None when some field's
    type is not one it reads (see the module docstring).

    ``through``: read only the fields up to the last of these names the schema has (Avro writes the
    fields in schema order) and give only those of them. Such a *prefix* reader does not look at the
    rest of a datum, so it cannot tell a datum with bytes wrong after its prefix from a clean one: its
    values are exactly fastavro's for every datum fastavro decodes, and may be anything for one it
    refuses (a read past the datum's end is still doubtful). For lane routing, where a poison record's
    lane does not matter.

    ``staged``: fields whose value the caller stages as it is, by name, with the type to give it as
    (see :func:`_staged_logical`): a ``decimal`` field's values as that ``str`` subclass of their
    exact text, a ``timestamp-millis``/``-micros`` field's as that ``int`` subclass of microseconds since
    the epoch, instead of ``Decimal`` and ``datetime`` objects; any other field as always."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return None
    listed = list(schema.get("fields", ()))
    wanted = None
    if through is not None:
        wanted = frozenset(through)
        names = [f["name"] for f in listed]
        listed = listed[:max((names.index(name) for name in wanted if name in names), default=-1) + 1]
    fields = []
    for f in listed:
        reader = _field_reader(f.get("type"), (staged or {}).get(f["name"]))
        if reader is None:
            return None
        fields.append((f["name"], reader))
    import numpy as np

    def read(data: bytes, starts: Any, ends: Any) -> tuple[dict[str, list[Any]], Any]:
        batch = _Batch(np, data, np.asarray(starts), np.asarray(ends))
        every = np.arange(len(starts))
        out = {name: reader(batch, every) for name, reader in fields}
        if wanted is None:
            batch.bad |= batch.pos != batch.end  # bytes left over (or a read past the end): fastavro decides
        else:
            out = {name: values for name, values in out.items() if name in wanted}
        return out, batch.bad

    return read


_Reader = Callable[[_Batch, Any], list[Any]]


def _field_reader(t: Any, staged: type | None = None) -> _Reader | None:
    """The reader of a field of type ``t`` (parsed), or None when it is not one read here; ``staged``:
    see :func:`compile_batch`."""
    if isinstance(t, list):
        return _union_reader(t, staged)
    if isinstance(t, dict):
        kind = t.get("type")
        logical = t.get("logicalType")
        if logical is not None:
            from fastavro._read import LOGICAL_READERS

            convert = LOGICAL_READERS.get(f"{kind}-{logical}")
            base = _PRIMITIVES.get(kind) if isinstance(kind, str) else None
            if convert is None or base is None:
                return None
            if staged is not None:
                fast = _staged_logical(f"{kind}-{logical}", t, staged)
                if fast is not None:
                    return fast
            return _logical(base, convert, t)
        if kind == "enum":
            return _enum_reader(list(t.get("symbols", ())))
        if isinstance(kind, str) and kind in _PRIMITIVES and len(t) == 1:
            return _PRIMITIVES[kind]
        return None
    return _PRIMITIVES.get(t) if isinstance(t, str) else None


def _long(batch: _Batch, sel: Any) -> list[Any]:
    return batch.varint(sel).tolist()


def _int(batch: _Batch, sel: Any) -> list[Any]:
    values = batch.varint(sel)
    out = (values < INT32_MIN) | (values > INT32_MAX)
    if out.any():
        batch.bad[sel[out]] = True
    return values.tolist()


def _fixed_width(width: int, dtype: str) -> _Reader:
    def read(batch: _Batch, sel: Any) -> list[Any]:
        np = batch.np
        pos = batch.pos[sel]
        batch.pos[sel] = pos + width
        batch.settle(sel)
        take = (pos[:, None] + np.arange(width)[None, :]).reshape(-1)
        return batch.buf[take].view(dtype).tolist()

    return read


def _boolean(batch: _Batch, sel: Any) -> list[Any]:
    pos = batch.pos[sel]
    byte = batch.buf[pos]
    batch.pos[sel] = pos + 1
    batch.settle(sel)
    odd = byte > 1
    if odd.any():
        batch.bad[sel[odd]] = True
    return (byte == 1).tolist()


def _null(batch: _Batch, sel: Any) -> list[Any]:
    return [None] * len(sel)


def _bytes(batch: _Batch, sel: Any) -> list[Any]:
    starts, stops = batch.span(sel)
    data = batch.data
    return [data[a:b] for a, b in zip(starts, stops)]


def _string(batch: _Batch, sel: Any) -> list[Any]:
    starts, stops = batch.span(sel)
    data = batch.data
    try:
        return [data[a:b].decode() for a, b in zip(starts, stops)]
    except UnicodeDecodeError:  # some text is not UTF-8: those datums are doubtful
        out: list[Any] = []
        for j, (a, b) in enumerate(zip(starts, stops)):
            try:
                out.append(data[a:b].decode())
            except UnicodeDecodeError:
                batch.bad[sel[j]] = True
                out.append(None)
        return out


_PRIMITIVES: dict[str, _Reader] = {
    "null": _null, "boolean": _boolean, "int": _int, "long": _long, "float": _fixed_width(4, "<f4"),
    "double": _fixed_width(8, "<f8"), "bytes": _bytes, "string": _string,
}


def _enum_reader(symbols: list[str]) -> _Reader:
    def read(batch: _Batch, sel: Any) -> list[Any]:
        index = batch.varint(sel)
        out = (index < 0) | (index >= len(symbols))
        if out.any():
            batch.bad[sel[out]] = True
            index = batch.np.where(out, 0, index)
        if not symbols:
            return [None] * len(sel)
        return list(map(symbols.__getitem__, index.tolist()))

    return read


def _logical(base: _Reader, convert: Callable[..., Any], schema: dict[str, Any]) -> _Reader:
    """A logical type: its base type's values given to fastavro's own logical reader, one by one (an
    exception makes the datum doubtful: fastavro's per-record read raises it too, and decides)."""

    def read(batch: _Batch, sel: Any) -> list[Any]:
        values = base(batch, sel)
        try:
            return [convert(v, schema, None) for v in values]
        except Exception:  # noqa: BLE001 - a value fastavro's reader refuses (a date beyond 9999...)
            out: list[Any] = []
            for j, v in enumerate(values):
                try:
                    out.append(convert(v, schema, None))
                except Exception:  # noqa: BLE001
                    batch.bad[sel[j]] = True
                    out.append(None)
            return out

    return read


#: The microseconds since the epoch of the aware datetimes there are (``datetime(1, 1, 1)`` to
#: ``datetime.max``, UTC): beyond them fastavro's ``timestamp-*`` readers raise.
DATETIME_MICROS_MIN, DATETIME_MICROS_MAX = -62_135_596_800_000_000, 253_402_300_799_999_999
#: Decimal scales whose text :func:`_decimal_text` writes as ``str(Decimal)`` does (plain notation: an
#: exponent of at least -6 always keeps Python's ``str`` out of scientific notation).
_MAX_PLAIN_SCALE = 6
#: Decimal precisions whose values :func:`_decimal_text` writes (a bound far beyond Avro's common ones,
#: keeping ``10 ** precision`` small)
_MAX_FAST_PRECISION = 1000


def _staged_logical(name: str, schema: dict[str, Any], as_type: type) -> _Reader | None:
    """A logical type's reader giving the staged values of fastavro's (see :func:`compile_batch`), or
    None where it has none (the caller then converts as fastavro does):

    - ``long-timestamp-millis`` / ``-micros`` into an ``int`` subclass: the microseconds since the
      epoch of the aware UTC datetime fastavro returns (``epoch + timedelta(microseconds=...)``), for
      each value whose datetime exists; the others are doubtful (fastavro raises for them);
    - ``bytes-decimal`` of a scale up to :data:`_MAX_PLAIN_SCALE` into a ``str`` subclass: the text of
      the Decimal fastavro returns (``create_decimal(unscaled).scaleb(-scale)`` under the schema's
      precision), for each value of at most ``precision`` digits, which that context does not round;
      the others are doubtful (fastavro per record, then the row mapper's coercer, decide them)."""
    if name in ("long-timestamp-millis", "long-timestamp-micros") and issubclass(as_type, int):
        factor = 1000 if name == "long-timestamp-millis" else 1

        def read_micros(batch: _Batch, sel: Any) -> list[Any]:
            values = batch.varint(sel)
            np = batch.np
            lo, hi = -(DATETIME_MICROS_MIN // -factor), DATETIME_MICROS_MAX // factor  # the values whose micros are in range
            out = (values < lo) | (values > hi)
            if out.any():
                batch.bad[sel[out]] = True
                values = np.where(out, 0, values)
            return list(map(as_type, (values * factor).tolist()))

        return read_micros
    scale, precision = schema.get("scale", 0), schema.get("precision")
    if name == "bytes-decimal" and issubclass(as_type, str) and type(scale) is int and 0 <= scale <= _MAX_PLAIN_SCALE \
            and type(precision) is int and 0 < precision <= _MAX_FAST_PRECISION:
        limit = 10**precision

        def read_decimals(batch: _Batch, sel: Any) -> list[Any]:
            np = batch.np
            start, stop = batch.span_arrays(sel)
            short = (stop - start) <= 8  # int64 values, their text made by Arrow's decimal128 (below)
            unscaled = batch.signed_be(np.where(short, start, 0), np.where(short, stop, 0))
            if precision <= 18:
                short &= (unscaled > -limit) & (unscaled < limit)
            out: list[Any] = list(map(as_type, _decimal_texts(np, unscaled, scale)))
            if not short.all():
                data = batch.data
                for j in np.nonzero(~short)[0].tolist():
                    b = data[start[j]:stop[j]]
                    whole = int.from_bytes(b, "big", signed=True)
                    if -limit < whole < limit:
                        out[j] = as_type(_decimal_text(whole, scale))
                    else:  # fastavro's context rounds it (or overflows): doubtful, fastavro and the coercer decide
                        batch.bad[sel[j]] = True
                        out[j] = None
            return out

        return read_decimals
    return None


def _decimal_texts(np: Any, unscaled: Any, scale: int) -> list[str]:
    """:func:`_decimal_text` of each of the int64 ``unscaled``, by Arrow's ``decimal128`` cast to text
    (the same text for ``0 <= scale <= 6``: plain digits with a point, as tests/unit/test_columnar_avro.py
    holds it)."""
    import pyarrow as pa

    words = np.empty((len(unscaled), 2), dtype=np.int64)
    words[:, 0] = unscaled
    words[:, 1] = unscaled >> 63  # the high word of the 128-bit two's complement
    array = pa.Array.from_buffers(pa.decimal128(38, scale), len(unscaled), [None, pa.py_buffer(words.tobytes())])
    return array.cast(pa.string()).to_pylist()


def _decimal_text(unscaled: int, scale: int) -> str:
    """``str(Decimal(unscaled).scaleb(-scale))`` for ``0 <= scale <= 6``: the digits, with a point
    ``scale`` digits from the right (and zeros before it as needed)."""
    if scale == 0:
        return str(unscaled)
    digits = str(abs(unscaled)).rjust(scale + 1, "0")
    return f"{'-' if unscaled < 0 else ''}{digits[:-scale]}.{digits[-scale:]}"


def _union_reader(branches: list[Any], staged: type | None = None) -> _Reader | None:
    """``["null", T]`` or ``[T, "null"]``: None, or T's value."""
    if len(branches) != 2 or "null" not in branches:
        return None
    null_at = branches.index("null")
    inner = _field_reader(branches[1 - null_at], staged)
    if inner is None:
        return None

    def read(batch: _Batch, sel: Any) -> list[Any]:
        np = batch.np
        branch = batch.varint(sel)
        out_of_range = (branch != 0) & (branch != 1)
        if out_of_range.any():
            batch.bad[sel[out_of_range]] = True
        valued = np.nonzero((branch == 1 - null_at) & ~out_of_range)[0]
        out: list[Any] = [None] * len(sel)
        if len(valued):
            for j, v in zip(valued.tolist(), inner(batch, sel[valued])):
                out[j] = v
        return out

    return read


def read_fields(reader: BatchReader, values: Sequence[bytes], offset: int) -> tuple[dict[str, list[Any]], list[bool]]:
    """``reader`` over ``values``, each a datum from ``offset`` on (5: after the wire format's magic
    byte and schema id): the fields' values and each datum's doubt."""
    import numpy as np

    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    ends = np.cumsum(lengths)
    starts = ends - lengths + offset
    fields, bad = reader(b"".join(values), starts, ends)
    return fields, bad.tolist()

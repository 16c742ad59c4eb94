"""The type map: a schema's field type → a column type of PostgreSQL or ClickHouse.

Two steps. The readers in :mod:`ingest.mirror.shape` turn each format's type into a :class:`Logical`
type; :func:`column_type` renders a Logical type in a sink's dialect. Every rendered type is one the
repo's own type parsers accept (:func:`ingest.core.dialects.pg_base_type`,
:func:`ingest.core.dialects.ch_type`), so the mapper has a coercer for it.

The rule behind every row: **the column holds the value exactly as ingest's decoders deliver it
today** (``ingest.formats.*``, ``ingest.cdc.debezium``), so no value is written wrongly and none is
refused for its type. Where a better column would need a conversion the decoders do not make yet,
the table says so (*needs a converter*).

Logical types, and their columns
--------------------------------

==================  ===========================  =========================  ============================================
Logical             PostgreSQL                   ClickHouse                 from
==================  ===========================  =========================  ============================================
``boolean``         ``boolean``                  ``Bool``                   Avro boolean, Protobuf bool, JSON boolean,
                                                                            Connect boolean
``int8``            ``smallint``                 ``Int8``                   Connect int8
``int16``           ``smallint``                 ``Int16``                  Connect int16
``int32``           ``integer``                  ``Int32``                  Avro int, Protobuf (s/sfixed)int32, Connect
                                                                            int32, JSON integer with connect.type int32
``int64``           ``bigint``                   ``Int64``                  Avro long, Protobuf (s/sfixed)int64, JSON
                                                                            integer, Connect int64, NanoTime (ns since
                                                                            midnight: *needs a converter* for ``time``)
``uint32``          ``bigint``                   ``UInt32``                 Protobuf uint32 / fixed32
``uint64``          ``numeric(20,0)``            ``UInt64``                 Protobuf uint64 / fixed64
``float32``         ``real``                     ``Float32``                Avro float, Protobuf float, Connect float32
``float64``         ``double precision``         ``Float64``                Avro double, Protobuf double, JSON number,
                                                                            Connect float64, Debezium ``Interval``
                                                                            (µs, numeric mode: *needs a converter* for
                                                                            ``interval``)
``decimal(p,s)``    ``numeric(p,s)``             ``Decimal(p, s)``          Avro decimal, Connect ``Decimal``
                    (``numeric`` past p=1000)    (``String`` past p=76)     (precision from
                                                                            ``connect.decimal.precision``, else
                                                                            ``numeric`` / ``Decimal(38, s)``)
``decimal``         ``numeric``                  ``String`` (exact text)    Debezium ``VariableScaleDecimal``
``string``          ``text``                     ``String``                 strings; Connect ``Json`` (*needs a
                                                                            converter* for ``jsonb``), ``ZonedTime``,
                                                                            ``Interval`` (string mode), ``Xml``, ...
``enum``            ``text``                     ``String``                 Avro / Protobuf enum (the symbol), Debezium
                                                                            ``Enum`` / ``EnumSet``
``bytes``           ``bytea``                    ``String``                 Avro bytes / fixed / duration, Protobuf
                                                                            bytes, Connect bytes, Debezium ``Bits``
                                                                            (ClickHouse: the String coercer takes
                                                                            UTF-8 bytes only -- *needs a converter*
                                                                            for binary; JSON converter bytes are
                                                                            base64 text and fit)
``uuid``            ``uuid``                     ``UUID``                   Avro uuid, JSON format uuid, Debezium
                                                                            ``Uuid``
``date``            ``date``                     ``Date``                   Avro date, JSON format date, Connect /
                                                                            Debezium ``Date``
``time``            ``time``                     ``String`` (ISO text)      Avro time-millis / -micros, JSON format
                                                                            time, Connect ``Time``, Debezium ``Time``
                                                                            / ``MicroTime``
``timestamptz(p)``  ``timestamptz``              ``DateTime64(p)``          Avro timestamp-millis (3) / -micros (6) /
                                                                            -nanos (9), Protobuf ``Timestamp`` (6),
                                                                            JSON format date-time (6), Debezium
                                                                            ``ZonedTimestamp`` (6)
``timestamp(p)``    ``timestamp``                ``DateTime64(p)``          Avro local-timestamp-*, Connect
                                                                            ``Timestamp`` (3), Debezium ``Timestamp``
                                                                            (3) / ``MicroTimestamp`` (6) /
                                                                            ``NanoTimestamp`` (6: decoded to µs)
``interval``        ``interval``                 ``JSON`` (its seconds)     Protobuf ``Duration``
``json``            ``jsonb``                    ``JSON`` (as ``String``)   Avro record / map / multi-branch union,
                                                                            Protobuf message / map / ``Struct`` /
                                                                            ``Value`` / ``ListValue``, JSON object,
                                                                            Connect struct / map, Debezium geometry
``array(T)``        ``jsonb``                    ``Array(T')``              Avro array, Protobuf repeated, JSON array,
                                                                            Connect array (T' is T's ClickHouse type,
                                                                            ``Nullable`` when items may be null;
                                                                            ``JSON`` for items an Array cannot hold)
==================  ===========================  =========================  ============================================

Nullability: a field that may be null (an Avro union with ``null``, a Protobuf field with presence, a
JSON Schema property that is not ``required`` or allows ``null``, an ``optional`` Connect field) is a
nullable column -- ``Nullable(T)`` in ClickHouse -- except that **key columns are never nullable**, and
a ClickHouse ``Array`` cannot be ``Nullable``: an optional array is ``Array(T) DEFAULT []``.

Debezium's ``io.debezium.time.*`` names are read from the JSON converter's ``schema`` part, whose
values ``ingest.cdc.debezium`` converts. In Avro they survive only as a ``connect.name`` property of a
plain ``int`` / ``long``, whose values arrive as plain numbers: those fields map by their Avro type
(configure ``time.precision.mode=connect`` for Avro logical types, as for the single-table mirror).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ingest.core.dialects import ch_type, pg_base_type
from ingest.mirror.names import CLICKHOUSE, POSTGRES

__all__ = ["Logical", "accepts", "ch_nullable", "column_type", "normalize_type", "split_nullable", "widening"]

#: Logical kinds without parameters.
SIMPLE_KINDS = frozenset({
    "boolean", "int8", "int16", "int32", "int64", "uint32", "uint64", "float32", "float64", "string", "enum",
    "bytes", "uuid", "date", "time", "interval", "json",
})

_PG: dict[str, str] = {
    "boolean": "boolean", "int8": "smallint", "int16": "smallint", "int32": "integer", "int64": "bigint",
    "uint32": "bigint", "uint64": "numeric(20,0)", "float32": "real", "float64": "double precision",
    "string": "text", "enum": "text", "bytes": "bytea", "uuid": "uuid", "date": "date", "time": "time",
    "interval": "interval", "json": "jsonb",
}
_CH: dict[str, str] = {
    "boolean": "Bool", "int8": "Int8", "int16": "Int16", "int32": "Int32", "int64": "Int64",
    "uint32": "UInt32", "uint64": "UInt64", "float32": "Float32", "float64": "Float64",
    "string": "String", "enum": "String", "bytes": "String", "uuid": "UUID", "date": "Date", "time": "String",
    "interval": "JSON", "json": "JSON",
}
PG_MAX_NUMERIC_PRECISION = 1000
CH_MAX_DECIMAL_PRECISION = 76
#: ClickHouse precision of a decimal whose schema gives a scale but no precision.
CH_DEFAULT_DECIMAL_PRECISION = 38


@dataclass(frozen=True, slots=True)
class Logical:
    """A field's type, independent of the sink.

    ``kind``: one of :data:`SIMPLE_KINDS`, ``decimal`` (``precision``/``scale``; both None for a
    variable scale, ``precision`` None when only the scale is known), ``timestamptz`` / ``timestamp``
    (``precision``: digits of the second, 0-9), or ``array`` (``item``, ``item_nullable``).
    """

    kind: str
    precision: int | None = None
    scale: int | None = None
    item: Logical | None = None
    item_nullable: bool = False

    def __post_init__(self) -> None:
        if self.kind in SIMPLE_KINDS or self.kind in ("decimal", "timestamptz", "timestamp"):
            return
        if self.kind == "array" and self.item is not None:
            return
        raise ValueError(f"not a logical type: {self!r}")


def column_type(logical: Logical, dialect: str) -> str:
    """The column type of ``logical`` in ``dialect`` (see the table), *without* nullability: the caller
    wraps ``Nullable(...)`` for ClickHouse (:meth:`ingest.mirror.shape.Shape.ddl_type`). Spelled as a
    column ``type`` of the sink's config is: ClickHouse ``JSON`` (which the mapper serialises, and
    which is created and read back as ``String``: :func:`normalize_type` maps one to the other)."""
    if dialect == POSTGRES:
        return _pg(logical)
    if dialect == CLICKHOUSE:
        return _ch(logical)
    raise ValueError(f"unknown dialect {dialect!r}")


def _pg(t: Logical) -> str:
    kind = t.kind
    if kind in _PG:
        return _PG[kind]
    if kind == "decimal":
        if t.precision is None or t.precision > PG_MAX_NUMERIC_PRECISION or t.precision < 1:
            return "numeric"
        scale = t.scale or 0
        if scale > t.precision:
            return "numeric"
        return f"numeric({t.precision},{scale})"
    if kind in ("timestamptz", "timestamp"):
        return kind  # PostgreSQL keeps microseconds; finer digits are floored by the decoders already
    return "jsonb"  # array


def _ch(t: Logical) -> str:
    kind = t.kind
    if kind in _CH:
        return _CH[kind]
    if kind == "decimal":
        if t.scale is None:
            return "String"  # variable scale: the exact text
        precision = t.precision if t.precision is not None else max(CH_DEFAULT_DECIMAL_PRECISION, t.scale)
        if precision > CH_MAX_DECIMAL_PRECISION or t.scale > precision:
            return "String"
        return f"Decimal({precision}, {t.scale})"
    if kind in ("timestamptz", "timestamp"):
        return f"DateTime64({min(max(t.precision if t.precision is not None else 6, 0), 9)})"
    assert t.item is not None
    inner = _ch(t.item)
    if t.item_nullable and not inner.startswith("Array("):
        inner = f"Nullable({inner})"
    return f"Array({inner})"


# --------------------------------------------------------------------------- catalog types

_PG_TS_PRECISION = re.compile(r"^(timestamp|time)\s*\((\d+)\)\s*(with|without) time zone$")


def normalize_type(type_text: str, dialect: str) -> str:
    """A column type as the catalog spells it → the canonical spelling used to compare types.

    PostgreSQL (``format_type`` output): the form :func:`pg_base_type` gives (``integer``,
    ``varchar(20)``, ``numeric(12,2)``, ``timestamptz``; a timestamp's precision is dropped); a type the
    mapper does not know (``integer[]``, ``citext``, ``time(3) with time zone``) is kept as it is,
    lower-cased, and only ever equal to itself. ClickHouse (``system.columns.type``, without
    ``Nullable``; see :func:`split_nullable`): the ``ddl`` form of :func:`ch_type` (``JSON`` and
    ``String`` are both ``String``; ``Decimal(12, 2)``), or the text as it is when the parser does not
    know it (``DateTime``, ``Map(String, String)``, ``FixedString(16)``).
    """
    if dialect == POSTGRES:
        text = " ".join(type_text.strip().lower().split())
        m = _PG_TS_PRECISION.match(text)
        if m:
            if m.group(1) == "time":
                return text if m.group(3) == "with" else "time"
            return "timestamptz" if m.group(3) == "with" else "timestamp"
        try:
            base, full = pg_base_type(text)
        except ValueError:
            return text
        return base if base in ("timestamptz", "timestamp") else full
    if dialect == CLICKHOUSE:
        try:
            return ch_type(type_text.strip()).ddl
        except ValueError:
            return type_text.strip()
    raise ValueError(f"unknown dialect {dialect!r}")


def split_nullable(type_text: str) -> tuple[str, bool]:
    """A ClickHouse type → (the type without ``Nullable``, nullable). ``LowCardinality(Nullable(String))``
    → (``LowCardinality(String)``, True)."""
    text = type_text.strip()
    if text.startswith("Nullable(") and text.endswith(")"):
        return text[len("Nullable("):-1].strip(), True
    if text.startswith("LowCardinality(Nullable(") and text.endswith("))"):
        return "LowCardinality(" + text[len("LowCardinality(Nullable("):-2].strip() + ")", True
    return text, False


def ch_nullable(type_text: str) -> str:
    """``Nullable(T)`` for a ClickHouse type (``LowCardinality(Nullable(T))`` for a LowCardinality one);
    an Array is returned unchanged (it cannot be Nullable)."""
    if type_text.startswith("Array("):
        return type_text
    if type_text.startswith("LowCardinality("):
        return "LowCardinality(Nullable(" + type_text[len("LowCardinality("):-1] + "))"
    return f"Nullable({type_text})"


# --------------------------------------------------------------------------- comparing types
# ``accepts(e, w)``: a column of type e holds every value a column of type w holds (no DDL needed).
# ``widening(e, w)``: the type e must become to hold w's values, when that change is on the documented
# list of widenings (ingest.mirror.evolve), else None.

_PG_INT_RANK = {"smallint": 1, "integer": 2, "bigint": 3}
_PG_FLOAT_RANK = {"real": 1, "double precision": 2}
_MOD = re.compile(r"^([a-z ]+?)(?:\((\d+)(?:,(\d+))?\))?$")


def _pg_parts(t: str) -> tuple[str, int | None, int | None]:
    m = _MOD.match(t)
    if not m:
        return t, None, None
    return m.group(1), (int(m.group(2)) if m.group(2) else None), (int(m.group(3)) if m.group(3) else None)


def _pg_accepts(e: str, w: str) -> bool:
    if e == w:
        return True
    (be, pe, se), (bw, pw, sw) = _pg_parts(e), _pg_parts(w)
    if be in _PG_INT_RANK and bw in _PG_INT_RANK:
        return _PG_INT_RANK[be] >= _PG_INT_RANK[bw]
    if be in _PG_FLOAT_RANK and bw in _PG_FLOAT_RANK:
        return _PG_FLOAT_RANK[be] >= _PG_FLOAT_RANK[bw]
    if be == "numeric" and bw == "numeric":
        if pe is None:
            return True
        return pw is not None and (se or 0) == (sw or 0) and pw <= pe
    if be == "text" and bw in ("text", "varchar"):
        return True
    if be == "varchar" and bw == "varchar":
        return pe is None or (pw is not None and pw <= pe)
    return False


def _pg_widenable(e: str, w: str) -> bool:
    be, bw = _pg_parts(e)[0], _pg_parts(w)[0]
    return ((be in _PG_INT_RANK and bw in _PG_INT_RANK) or (be in _PG_FLOAT_RANK and bw in _PG_FLOAT_RANK)
            or (be == bw == "numeric") or (be == "varchar" and bw in ("varchar", "text")))


_CH_INT = re.compile(r"^(U?)Int(8|16|32|64)$")
_CH_DEC = re.compile(r"^Decimal\((\d+), (\d+)\)$")
_CH_DT64 = re.compile(r"^DateTime64\((\d)\)$")


def _ch_inner(t: str, wrapper: str) -> str | None:
    return t[len(wrapper) + 1:-1] if t.startswith(wrapper + "(") and t.endswith(")") else None


def _ch_accepts(e: str, w: str) -> bool:
    if e == w:
        return True
    e = _ch_inner(e, "LowCardinality") or e
    w = _ch_inner(w, "LowCardinality") or w
    if e == w:
        return True
    ne, nw = _ch_inner(e, "Nullable"), _ch_inner(w, "Nullable")
    if ne is not None:
        return _ch_accepts(ne, nw if nw is not None else w)
    if nw is not None:
        return False
    ae, aw = _ch_inner(e, "Array"), _ch_inner(w, "Array")
    if ae is not None or aw is not None:
        return ae is not None and aw is not None and _ch_accepts(ae, aw)
    ie, iw = _CH_INT.match(e), _CH_INT.match(w)
    if ie and iw:
        e_unsigned, e_bits, w_unsigned, w_bits = ie.group(1), int(ie.group(2)), iw.group(1), int(iw.group(2))
        if e_unsigned == w_unsigned:
            return e_bits >= w_bits
        return not e_unsigned and e_bits > w_bits  # IntM holds UIntN for M > N
    if e == "Float64" and w == "Float32":
        return True
    de, dw = _CH_DEC.match(e), _CH_DEC.match(w)
    if de and dw:
        return de.group(2) == dw.group(2) and int(de.group(1)) >= int(dw.group(1))
    te, tw = _CH_DT64.match(e), _CH_DT64.match(w)
    if te and tw:
        return int(te.group(1)) >= int(tw.group(1))
    return False


def _ch_widenable(e: str, w: str) -> bool:
    ae, aw = _ch_inner(e, "Array"), _ch_inner(w, "Array")
    if ae is not None and aw is not None:
        return _ch_widenable(ae, aw)
    ne, nw = _ch_inner(e, "Nullable"), _ch_inner(w, "Nullable")
    if ne is not None or nw is not None:
        return _ch_widenable(ne or e, nw or w)
    return bool((_CH_INT.match(e) and _CH_INT.match(w)) or (e, w) == ("Float32", "Float64")
                or (_CH_DEC.match(e) and _CH_DEC.match(w)))


def accepts(existing: str, wanted: str, dialect: str) -> bool:
    """A column of type ``existing`` holds every value of type ``wanted`` (ClickHouse types without the
    column's own ``Nullable``). Both are compared as :func:`normalize_type` spells them, so a ``JSON``
    column is the ``String`` the catalog shows."""
    e, w = normalize_type(existing, dialect), normalize_type(wanted, dialect)
    return _pg_accepts(e, w) if dialect == POSTGRES else _ch_accepts(e, w)


def widening(existing: str, wanted: str, dialect: str) -> str | None:
    """The type ``existing`` must become to hold ``wanted``'s values, when that is a widening on the
    documented list (:mod:`ingest.mirror.evolve`): ``wanted`` itself. None when ``existing`` already
    accepts ``wanted`` or the change is not a widening."""
    if accepts(existing, wanted, dialect) or not accepts(wanted, existing, dialect):
        return None
    e, w = normalize_type(existing, dialect), normalize_type(wanted, dialect)
    ok = _pg_widenable(e, w) if dialect == POSTGRES else _ch_widenable(e, w)
    return wanted if ok else None

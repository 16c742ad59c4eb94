"""Batches as Arrow tables for ClickHouse inserts in ``FORMAT Arrow``.

clickhouse-connect's Native insert encodes every value in Python (a Decimal
goes through ``str`` and back, for one), and that work holds the GIL the
pipeline thread needs. Building an Arrow table from the same columns runs in
pyarrow's C++ (measured on the benchmark's columns: 0.38 µs per record to
build, and the whole insert 1.68 vs 2.11 µs of CPU per record), so the sink
inserts Arrow when it can:

* every column type has an exact Arrow counterpart (:func:`arrow_type`);
  a ``UUID`` column, or a ``DateTime64(p)`` whose precision is not 0, 3, 6 or 9,
  keeps the whole sink on Native;
* pyarrow is importable (it is an optional dependency: ``ingest[clickhouse]``);
* the server is a supported one (22.8+, which reads Arrow).

A batch whose values pyarrow refuses is sent as Native instead (same rows, same
token), so Arrow never changes what is accepted or how an error is classified.

Values arrive exactly as :class:`~ingest.core.mapping.Mapper` produces them for
the ClickHouse dialect: ints, floats, ``Decimal`` rounded to the column's scale,
``str``, ``bool``, ``date``, ``DateTime64`` as integer ticks, lists for arrays,
``None`` for NULL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ingest.core.dialects import ChType

_INTS = {"UInt8", "UInt16", "UInt32", "UInt64", "Int8", "Int16", "Int32", "Int64"}
_TIME_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}


def _pyarrow() -> Any | None:
    try:
        import pyarrow
    except ImportError:
        return None
    return pyarrow


def arrow_type(t: ChType, pa: Any) -> Any | None:
    """The Arrow type ClickHouse reads into ``t`` exactly, or ``None`` if there is none here."""
    kind = t.kind
    if kind == "int" and t.name in _INTS:
        return getattr(pa, t.name.lower())()
    if kind == "float":
        return pa.float32() if t.name == "Float32" else pa.float64()
    if kind == "decimal":
        return (pa.decimal128 if t.precision <= 38 else pa.decimal256)(t.precision, t.scale)
    if kind in ("string", "json"):
        return pa.string()
    if kind == "bool":
        return pa.bool_()
    if kind == "date":
        return pa.date32()
    if kind == "datetime64":
        unit = _TIME_UNITS.get(t.precision)
        return None if unit is None else pa.timestamp(unit)
    if kind in ("nullable", "lowcardinality") and t.inner is not None:
        return arrow_type(t.inner, pa)
    if kind == "array" and t.inner is not None:
        inner = arrow_type(t.inner, pa)
        return None if inner is None else pa.list_(inner)
    return None  # uuid, anything new


class ArrowEncoder:
    """Builds the Arrow table of one batch; construct with :meth:`for_columns`."""

    def __init__(self, pa: Any, schema: Any) -> None:
        self._pa = pa
        self.schema = schema

    @classmethod
    def for_columns(cls, names: Sequence[str], types: Sequence[ChType]) -> ArrowEncoder | None:
        """An encoder for these columns, or ``None`` when pyarrow is missing or a type has no Arrow twin."""
        pa = _pyarrow()
        if pa is None:
            return None
        fields = []
        for name, t in zip(names, types):
            at = arrow_type(t, pa)
            if at is None:
                return None
            fields.append(pa.field(name, at, nullable=True))
        return cls(pa, pa.schema(fields))

    def table(self, columns: Sequence[Sequence[Any]]) -> Any:
        """The Arrow table of ``columns`` (one sequence per column, in schema order).

        Raises pyarrow's errors (``ArrowInvalid``, ``ArrowTypeError``, ``OverflowError``...)
        for a value it refuses; the caller then inserts Native.
        """
        pa = self._pa
        arrays = [pa.array(col, type=f.type) for col, f in zip(columns, self.schema)]
        return pa.Table.from_arrays(arrays, schema=self.schema)


#: The ClickHouse type kind whose coercer's values each ``coerced_*`` staged kind holds (precision and
#: scale as the staged column says).
_COERCED_FOR = {"coerced_decimal": "decimal", "coerced_ticks": "datetime64"}


class ColumnarConverter:
    """Turns a columnar batch as :class:`~ingest.core.mapping.columnar.ColumnarPlan` stages it into
    the table's Arrow types (``schema``: the sink's :class:`ArrowEncoder` schema), in Arrow's C++:

    * ``int`` (int64, range-checked by the plan) -> the column's integer type, a checked cast;
    * ``text`` -> string as is;
    * ``decimal`` (float64 whose shortest digits have at most the column's scale, see
      :class:`~ingest.core.mapping.columnar.StagedColumn`) -> those digits -> ``decimal128/256(P, S)``:
      exactly the row mapper's ``Decimal`` (no rounding can happen);
    * ``epoch_ms`` (int64 milliseconds, 0 .. 2299-12-31) -> ``DateTime64(p)`` ticks (a checked
      multiplication for p > 3, a division for p < 3: floored, the values being positive), as the
      row mapper's ``coerce_ch._ch_datetime64`` computes them;
    * ``coerced_decimal`` (a typed format's values as the row mapper's coercer rounded them, already
      ``decimal(P, S)``) -> the column's decimal type, a checked cast that changes nothing;
    * ``coerced_ticks`` (the row mapper's ``DateTime64(p)`` ticks, int64) -> ``timestamp`` of the
      column's unit, the same integers.
    """

    def __init__(self, columns: Sequence[Any], types: Sequence[ChType], schema: Any) -> None:
        import pyarrow.compute as pc

        self._pc = pc
        self.schema = schema
        self._steps = []
        for staged, t, field in zip(columns, types, schema, strict=True):
            while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
                t = t.inner
            factor = divisor = 1
            coerced_for = _COERCED_FOR.get(staged.kind)
            if coerced_for is not None and (t.kind != coerced_for or staged.precision != t.precision
                                            or (coerced_for == "decimal" and staged.scale != t.scale)):
                raise ValueError(f"column {staged.name!r}: {staged.kind} values staged for another type than {t.name}")
            if staged.kind == "epoch_ms":
                if t.kind != "datetime64":
                    raise ValueError(f"column {staged.name!r}: epoch milliseconds for a {t.name} column")
                if t.precision >= 3:
                    factor = 10 ** (t.precision - 3)
                else:
                    divisor = 10 ** (3 - t.precision)
            self._steps.append((staged.kind, field.type, factor, divisor))

    def convert(self, table: Any) -> Any:
        """``table`` in the sink's schema. Raises pyarrow's errors for a value a checked step refuses."""
        pa, pc = _pyarrow(), self._pc
        arrays = []
        for column, (kind, target, factor, divisor) in zip(table.columns, self._steps, strict=True):
            if kind == "decimal":
                column = pc.cast(pc.cast(column, pa.string()), target)
            elif kind == "epoch_ms":
                if factor != 1:
                    column = pc.multiply_checked(column, factor)
                elif divisor != 1:
                    column = pc.divide(column, divisor)
                column = pc.cast(column, target)
            else:
                column = pc.cast(column, target)  # a checked cast; text: string to string
            arrays.append(column)
        return pa.Table.from_arrays(arrays, schema=self.schema)

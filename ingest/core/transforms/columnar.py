"""Transforms on the columnar tier: a pipeline's steps applied to a whole batch as Arrow arrays (issue #37).

When every step of a pipeline is ``filter``, ``set``, ``drop`` or ``rename`` (each possibly with
``when``) and every expression is in the subset of :mod:`.subset`, :func:`compile_columnar` turns
them, once at start-up, into a :class:`ColumnarTransform`. The columnar plan
(:class:`ingest.core.mapping.columnar.ColumnarPlan`) binds it to the document keys its columns read
(:meth:`ColumnarTransform.bind`), decodes the batch with the bound transform's decoder (every field
any step or column names; a missing field is told from a null one) and calls
:meth:`BoundTransform.apply` on the decoded fields: it evaluates each step over the whole batch
with ``pyarrow.compute`` and returns the fields the columns read after the last step, the records
each filter dropped, and adds to ``rejected`` every record whose result it cannot vouch for.

**Exactness.** The row path (:mod:`.steps`, the CEL binding) is the authority. An evaluation here
tracks, per record, one of three states for every value: a value of the vector's one CEL type, CEL
``null``, or *unsure* -- an error the row path would raise (a missing field, an integer overflow, a
division by zero, no matching overload, a predicate that gives no bool) or a case this module does
not compute itself (an int beside a double beyond 2**53, a NaN in a comparison, text that is not
plainly a number, ...). A vector holds one type: a batch whose read fields mix types is evaluated
in groups of one type combination each (:meth:`BoundTransform.apply`). ``&&``,
``||`` and ``?:`` absorb errors as CEL does (``false && error`` is ``false``). A record that is
unsure where it matters -- the predicate of a filter or a ``when``, a ``set`` expression, a rename
onto an existing field -- is rejected: the row mapper maps it (or dead-letters it, class
``transform_error``) exactly as on the row path. A filtered record is one every earlier step and
its filter's predicate were sure about. Semantics checked against ``cel-expr-python`` (tests in
``tests/unit/test_transforms_columnar.py``): heterogeneous ``==`` (``1 == 1.0``, ``1 == 'a'`` is
false, ``null == null``), int/double ordering, 64-bit integers with overflow errors, ``/``
truncating and ``%`` taking the dividend's sign, ``int(double)`` truncating (error beyond the
int64 range), ``string(double)`` as CEL writes it (``1e+06``, ``0.0001``, ``-0``), ``int()``,
``double()`` and ``bool()`` of text.

Pure logic, no I/O; needs pyarrow (imported by this module: import it only where a plan is made).
"""

from __future__ import annotations

import collections
import decimal
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Annotated, Any, Union

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from ingest.core.mapping.fastmap import unnameable_key
from ingest.core.transforms import subset
from ingest.core.transforms.cel import variables_read
from ingest.core.transforms.subset import Node, Unsupported

__all__ = ["BoundTransform", "ColumnarTransform", "Unsupported", "compile_columnar"]

UNSET = msgspec.UNSET
_UnsetType = type(UNSET)
_NoneType = type(None)
#: a field as the decoder gives it: a JSON scalar exactly as orjson decodes it (integers within the
#: signed 64-bit range), None for null and, for the fields whose presence a step tests, UNSET when missing
_SCALAR = Union[str, bool, Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)], float, None]  # noqa: UP007
_SCALAR_OR_UNSET = Union[_SCALAR, msgspec.UnsetType]  # noqa: UP007

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: integers beside doubles are compared here only within +-2**53 (exact as doubles)
_EXACT_DOUBLE_INT = 2**53
#: int(double) here only below this magnitude (CEL's range ends at 2**63, excluding -2**63)
_INT_OF_DOUBLE_MAX = 9.2e18
#: the Python type of each CEL type this module represents, and its Arrow type
_KINDS: dict[type, tuple[str, Any]] = {int: ("int", pa.int64()), float: ("double", pa.float64()),
                                      str: ("string", pa.string()), bool: ("bool", pa.bool_())}
_ARROW = {kind: t for kind, t in _KINDS.values()}
_BOOL_TEXT = {"true": True, "TRUE": True, "True": True, "t": True, "1": True,
              "false": False, "FALSE": False, "False": False, "f": False, "0": False}
_INT_TEXT = r"^-?[0-9]{1,18}$"
_DOUBLE_TEXT = r"^-?[0-9]{1,20}(\.[0-9]{1,20})?$"

Mask = Any  # a pyarrow BooleanArray without nulls, or None: false everywhere


# -- vectors -------------------------------------------------------------------------------------
class Vec:
    """One expression's results over the batch: ``values`` (an Arrow array or scalar of ``kind``'s
    type; None when no record has a value) where a record has a value, ``null`` where it is CEL
    null, ``unsure`` where this module cannot vouch for it (see the module docstring). ``kind``:
    ``int``, ``double``, ``string``, ``bool``, or None with no values."""

    __slots__ = ("kind", "values", "null", "unsure")

    def __init__(self, kind: str | None, values: Any, null: Mask = None, unsure: Mask = None) -> None:
        self.kind, self.values, self.null, self.unsure = kind, values, null, unsure


class _Ctx:
    """One batch's evaluation: its size, the records' metadata, shared constant masks."""

    def __init__(self, n: int, fields: Any) -> None:
        self.n = n
        self._fields = fields
        self._true: Mask = None
        self._meta: dict[str, Field] = {}

    def all_true(self) -> Any:
        if self._true is None:
            self._true = pa.repeat(pa.scalar(True), self.n)
        return self._true

    def mask(self, x: Any) -> Mask:
        """A comparison's result as a mask: nulls false, a scalar broadcast (false: None)."""
        if isinstance(x, pa.Scalar):
            return self.all_true() if x.is_valid and x.as_py() else None
        if x.null_count:
            x = pc.fill_null(x, False)
        return x if x.true_count else None

    def error(self) -> Vec:
        return Vec(None, None, None, self.all_true())

    def meta(self, name: str) -> Field:
        field = self._meta.get(name)
        if field is None:
            values = self._fields("timestamp_ms" if name == "timestamp" else name)
            field = self._meta[name] = Field(values)
        return field


def _or(a: Mask, b: Mask) -> Mask:
    if a is None:
        return b
    if b is None:
        return a
    return pc.or_(a, b)


def _and(a: Mask, b: Mask) -> Mask:
    if a is None or b is None:
        return None
    return pc.and_(a, b)


def _andnot(a: Mask, b: Mask) -> Mask:
    """``a & ~b``."""
    if a is None or b is None:
        return a
    return pc.and_not(a, b)


def _not(ctx: _Ctx, a: Mask) -> Any:
    return ctx.all_true() if a is None else pc.invert(a)


def _valued(ctx: _Ctx, v: Vec) -> Any:
    """The mask of records where ``v`` holds a value (an array, never None)."""
    if v.kind is None:
        return pa.repeat(pa.scalar(False), ctx.n)
    return _not(ctx, _or(v.null, v.unsure))


def _truth(ctx: _Ctx, v: Vec) -> tuple[Mask, Mask]:
    """Where ``v`` is surely true and surely false (a bool value: not null, not unsure)."""
    if v.kind != "bool":
        return None, None
    bad = _or(v.null, v.unsure)
    values = v.values
    if isinstance(values, pa.Scalar):
        t = ctx.all_true() if values.as_py() else None
        f = None if values.as_py() else ctx.all_true()
    else:
        t = ctx.mask(values)
        f = ctx.mask(pc.invert(values))
    return _andnot(t, bad), _andnot(f, bad)


def _bool_vec(ctx: _Ctx, true: Mask, false: Mask) -> Vec:
    """A bool vector: true at ``true``, false at ``false``, unsure elsewhere."""
    values = true if true is not None else pa.scalar(False)
    return Vec("bool", values, None, _not(ctx, _or(true, false)))


# -- evaluation ----------------------------------------------------------------------------------
def evaluate(node: Node, doc: dict[str, Field], ctx: _Ctx) -> Vec:
    """``node`` over the batch whose value fields are ``doc`` (a field missing from ``doc`` is
    missing in every record)."""
    tag = node[0]
    if tag == "const":
        return _const(node[1], ctx)
    if tag == "field":
        field = doc.get(node[1])
        return ctx.error() if field is None else field.vec(ctx)
    if tag == "has":
        field = doc.get(node[1])
        if field is None:
            return Vec("bool", pa.scalar(False))
        absent = field.absent(ctx)
        return Vec("bool", pa.scalar(True) if absent is None else pc.invert(absent))
    if tag == "meta":
        return ctx.meta(node[1]).vec(ctx)
    if tag == "not":
        v = evaluate(node[1], doc, ctx)
        t, f = _truth(ctx, v)
        return _bool_vec(ctx, f, t)
    if tag == "neg":
        return _negate(evaluate(node[1], doc, ctx), ctx)
    if tag in ("and", "or"):
        at, af = _truth(ctx, evaluate(node[1], doc, ctx))
        bt, bf = _truth(ctx, evaluate(node[2], doc, ctx))
        if tag == "and":
            return _bool_vec(ctx, _and(at, bt), _or(af, bf))
        return _bool_vec(ctx, _or(at, bt), _and(af, bf))
    if tag == "cond":
        return _choose(ctx, evaluate(node[1], doc, ctx), evaluate(node[2], doc, ctx), evaluate(node[3], doc, ctx))
    if tag == "bin":
        op = node[1]
        a, b = evaluate(node[2], doc, ctx), evaluate(node[3], doc, ctx)
        if op in ("==", "!="):
            return _equal(ctx, a, b, op == "!=")
        if op in ("<", "<=", ">", ">="):
            return _order(ctx, op, a, b)
        return _arith(ctx, op, a, b)
    if tag == "call":
        return _cast(ctx, node[1], evaluate(node[2], doc, ctx))
    raise AssertionError(node)  # pragma: no cover - the parser makes no other node


def _const(value: Any, ctx: _Ctx) -> Vec:
    if value is None:
        return Vec(None, None, ctx.all_true(), None)
    kind, arrow = _KINDS[type(value)]
    return Vec(kind, pa.scalar(value, arrow))


def _choose(ctx: _Ctx, c: Vec, a: Vec, b: Vec) -> Vec:
    """``c ? a : b``: a record takes the branch its condition chooses (the other one's errors do not
    matter); a condition that is not surely a bool is unsure, and so is a branch value of another
    type than the result's (the vector has one type)."""
    t, f = _truth(ctx, c)
    unsure = _not(ctx, _or(t, f))
    kind = a.kind if a.kind is not None else b.kind
    if a.kind is not None and b.kind is not None and a.kind != b.kind:
        unsure = _or(unsure, _and(f, _valued(ctx, b)))
        b = Vec(None, None, b.null, b.unsure)
    if a.kind is None:
        values = b.values
    elif b.kind is None:
        values = a.values
    else:
        values = pc.if_else(t if t is not None else pa.scalar(False), a.values, b.values)
    null = _or(_and(t, a.null), _and(f, b.null))
    unsure = _or(unsure, _or(_and(t, a.unsure), _and(f, b.unsure)))
    if kind is not None and b.kind is None and a.kind is not None:
        unsure = _or(unsure, _andnot(f, b.null))  # b has no values: where chosen, null or unsure
    if kind is not None and a.kind is None and b.kind is not None:
        unsure = _or(unsure, _andnot(t, a.null))
    return Vec(kind, values, null, unsure)


def _numeric_pair(ctx: _Ctx, a: Vec, b: Vec) -> tuple[Any, Any, Mask]:
    """Both sides as doubles when one is int and the other double, and where that is not exact."""
    if a.kind == "int":
        ints, doubles, swap = a.values, b.values, False
    else:
        ints, doubles, swap = b.values, a.values, True
    big = ctx.mask(pc.or_(pc.greater(ints, _EXACT_DOUBLE_INT), pc.less(ints, -_EXACT_DOUBLE_INT)))
    as_double = pc.cast(ints, pa.float64(), safe=False)
    unsure = _or(big, ctx.mask(pc.is_nan(doubles)))
    return (doubles, as_double, unsure) if swap else (as_double, doubles, unsure)


def _equal(ctx: _Ctx, a: Vec, b: Vec, negate: bool) -> Vec:
    """CEL's heterogeneous equality: null equals only null, values of unrelated types are unequal,
    an int and a double compare as numbers."""
    unsure = _or(a.unsure, b.unsure)
    eq: Mask = None
    if a.kind is not None and b.kind is not None:
        if a.kind == b.kind:
            eq = ctx.mask(pc.equal(a.values, b.values))
            if a.kind == "double":
                unsure = _or(unsure, _or(ctx.mask(pc.is_nan(a.values)), ctx.mask(pc.is_nan(b.values))))
        elif {a.kind, b.kind} == {"int", "double"}:
            x, y, inexact = _numeric_pair(ctx, a, b)
            eq = ctx.mask(pc.equal(x, y))
            unsure = _or(unsure, inexact)
    nulls = _or(a.null, b.null)
    true = _or(_andnot(eq, nulls), _and(a.null, b.null))
    true = _andnot(true, unsure)
    false = _andnot(_not(ctx, true), unsure)
    if negate:
        true, false = false, true
    return _bool_vec(ctx, ctx.mask(true) if true is not None else None, false)


_ORDER = {"<": pc.less, "<=": pc.less_equal, ">": pc.greater, ">=": pc.greater_equal}


def _order(ctx: _Ctx, op: str, a: Vec, b: Vec) -> Vec:
    """``< <= > >=``: values of one type, or an int and a double; anything else is an error."""
    if a.kind is None or b.kind is None:
        return ctx.error()
    unsure = _or(_or(a.unsure, b.unsure), _or(a.null, b.null))
    if a.kind == b.kind:
        x, y = a.values, b.values
        if a.kind == "double":
            unsure = _or(unsure, _or(ctx.mask(pc.is_nan(x)), ctx.mask(pc.is_nan(y))))
    elif {a.kind, b.kind} == {"int", "double"}:
        x, y, inexact = _numeric_pair(ctx, a, b)
        unsure = _or(unsure, inexact)
    else:
        return ctx.error()
    result = ctx.mask(_ORDER[op](x, y))
    true = _andnot(result, unsure)
    false = _andnot(_not(ctx, result), unsure)
    return _bool_vec(ctx, true, false)


def _negate(a: Vec, ctx: _Ctx) -> Vec:
    if a.kind == "int":
        unsure = _or(_or(a.unsure, a.null), ctx.mask(pc.equal(a.values, INT64_MIN)))
        return Vec("int", pc.negate(a.values), None, unsure)
    if a.kind == "double":
        return Vec("double", pc.negate(a.values), None, _or(a.unsure, a.null))
    return ctx.error()


def _arith(ctx: _Ctx, op: str, a: Vec, b: Vec) -> Vec:
    """``+ - * / %`` on two values of one type: int (64-bit, overflow and division by zero are
    errors, ``/`` truncates, ``%`` has the dividend's sign), double (IEEE, no ``%``), string ``+``."""
    if a.kind is None or b.kind is None or a.kind != b.kind:
        return ctx.error()
    unsure = _or(_or(a.unsure, b.unsure), _or(a.null, b.null))
    x, y = a.values, b.values
    kind = a.kind
    if kind == "int":
        if op == "+":
            r = pc.add(x, y)
            overflow = pc.less(pc.bit_wise_and(pc.bit_wise_xor(x, r), pc.bit_wise_xor(y, r)), 0)
        elif op == "-":
            r = pc.subtract(x, y)
            overflow = pc.less(pc.bit_wise_and(pc.bit_wise_xor(x, y), pc.bit_wise_xor(x, r)), 0)
        elif op == "*":
            r = pc.multiply(x, y)
            product = pc.multiply(pc.cast(x, pa.float64(), safe=False), pc.cast(y, pa.float64(), safe=False))
            overflow = pc.greater_equal(pc.abs(product), 2.0**62)  # beyond it: unsure, not only overflow
        else:
            bad = ctx.mask(pc.or_(pc.equal(y, 0), pc.and_(pc.equal(x, INT64_MIN), pc.equal(y, -1))))
            divisor = y if bad is None else pc.if_else(bad, pa.scalar(1, pa.int64()), y)
            q = pc.divide(x, divisor)
            r = q if op == "/" else pc.subtract(x, pc.multiply(q, divisor))
            return Vec("int", r, None, _or(unsure, bad))
        return Vec("int", r, None, _or(unsure, ctx.mask(overflow)))
    if kind == "double" and op != "%":
        fn = {"+": pc.add, "-": pc.subtract, "*": pc.multiply, "/": pc.divide}[op]
        return Vec("double", fn(x, y), None, unsure)
    if kind == "string" and op == "+":
        return Vec("string", pc.binary_join_element_wise(x, y, ""), None, unsure)
    return ctx.error()


def _cast(ctx: _Ctx, fn: str, a: Vec) -> Vec:
    """``int()``, ``double()``, ``string()``, ``bool()``, ``dyn()`` of one vector."""
    if fn == "dyn":
        return a
    if a.kind is None:
        return ctx.error()
    unsure = _or(a.unsure, a.null)  # no conversion takes null
    x, kind = a.values, a.kind
    if fn == kind or (fn == "double" and kind == "double"):
        return Vec(kind, x, None, unsure)
    if fn == "int":
        if kind == "double":
            ok = pc.and_(pc.is_finite(x), pc.less(pc.abs(x), _INT_OF_DOUBLE_MAX))
            bad = ctx.mask(pc.invert(ok))
            safe = x if bad is None else pc.if_else(bad, pa.scalar(0.0), x)
            return Vec("int", pc.cast(pc.trunc(safe), pa.int64(), safe=False), None, _or(unsure, bad))
        if kind == "string":
            return _parse_text(ctx, x, _INT_TEXT, pa.int64(), "int", unsure)
        return ctx.error()
    if fn == "double":
        if kind == "int":
            return Vec("double", pc.cast(x, pa.float64(), safe=False), None, unsure)
        if kind == "string":
            return _parse_text(ctx, x, _DOUBLE_TEXT, pa.float64(), "double", unsure)
        return ctx.error()
    if fn == "string":
        if kind == "int":
            return Vec("string", pc.cast(x, pa.string()), None, unsure)
        if kind == "bool":
            return Vec("string", pc.if_else(x, pa.scalar("true"), pa.scalar("false")), None, unsure)
        return _double_to_text(ctx, x, unsure)
    if fn == "bool":
        if kind == "string":
            known = ctx.mask(pc.is_in(x, value_set=pa.array(list(_BOOL_TEXT))))
            truthy = pc.is_in(x, value_set=pa.array([k for k, v in _BOOL_TEXT.items() if v]))
            return Vec("bool", truthy, None, _or(unsure, _not(ctx, known)))
        return ctx.error()
    raise AssertionError(fn)  # pragma: no cover


def _parse_text(ctx: _Ctx, x: Any, pattern: str, arrow: Any, kind: str, unsure: Mask) -> Vec:
    """``int()``/``double()`` of text: only plain decimal text here (sure and parsed by Arrow exactly as
    CEL does); anything else (spaces, signs, exponents, ``inf``) is unsure."""
    plain = ctx.mask(pc.match_substring_regex(x, pattern))
    bad = _not(ctx, plain)
    safe = pc.if_else(bad, pa.scalar("0"), x)
    return Vec(kind, pc.cast(safe, arrow), None, _or(unsure, ctx.mask(bad)))


def _double_to_text(ctx: _Ctx, x: Any, unsure: Mask) -> Vec:
    """``string(double)`` as CEL writes it: the shortest digits that read back, fixed notation for a
    decimal exponent in [-4, 6), else ``d.ddde+XX``. Arrow writes the same for zero, infinities and
    magnitudes in [1e-4, 1e6); the rest are written in Python (:func:`double_text`); NaN is unsure."""
    if isinstance(x, pa.Scalar):
        text = double_text(x.as_py())
        return Vec("string", pa.scalar(text or ""), None, ctx.all_true() if text is None else unsure)
    magnitude = pc.abs(x)
    arrow_writes = pc.or_(pc.or_(pc.equal(x, 0.0), pc.invert(pc.is_finite(x))),
                          pc.and_(pc.greater_equal(magnitude, 1e-4), pc.less(magnitude, 1e6)))
    nan = ctx.mask(pc.is_nan(x))
    others = _andnot(_not(ctx, ctx.mask(arrow_writes)), nan)
    text = pc.cast(x, pa.string())
    if others is not None:
        values = text.to_pylist()
        doubles = x.to_pylist()
        for i in pc.indices_nonzero(others).to_pylist():
            values[i] = double_text(doubles[i]) if doubles[i] is not None else None
        text = pa.array(values, pa.string())
    return Vec("string", text, None, _or(unsure, nan))


def double_text(x: float | None) -> str | None:
    """CEL's ``string(double)`` of one value (None for NaN: not decided here)."""
    if x is None or x != x:
        return None
    if x in (math.inf, -math.inf):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    sign, digit_tuple, exp = decimal.Decimal(repr(x)).as_tuple()
    digits = "".join(map(str, digit_tuple))
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)  # type: ignore[operator]
    digits = stripped
    lead = len(digits) - 1 + exp  # type: ignore[operator]
    minus = "-" if sign else ""
    if -4 <= lead < 6:
        if exp >= 0:  # type: ignore[operator]
            return minus + digits + "0" * exp  # type: ignore[operator]
        point = len(digits) + exp  # type: ignore[operator]
        if point > 0:
            return f"{minus}{digits[:point]}.{digits[point:]}"
        return f"{minus}0.{'0' * -point}{digits}"
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{minus}{mantissa}e{'+' if lead >= 0 else '-'}{abs(lead):02d}"


# -- fields of the document ------------------------------------------------------------------------
class Field:
    """One top-level field of the value across the batch: its Python values as decoded (``UNSET``
    where missing), or a computed vector and where the field is absent. Each form is made from the
    other when first asked for."""

    __slots__ = ("py", "clean", "_vec", "_absent", "_known")

    def __init__(self, py: Sequence[Any] | None = None, vec: Vec | None = None, absent: Mask = None,
                 clean: bool = True) -> None:
        """``clean``: ``py`` holds no UNSET (the field is present in every record, or missing ones are None)."""
        self.py, self.clean = py, clean
        self._vec, self._absent = vec, absent
        self._known = vec is not None

    def _convert(self, ctx: _Ctx) -> None:
        if not self._known:
            self._vec, self._absent = _from_python(self.py, ctx)  # type: ignore[arg-type]
            self._known = True

    def vec(self, ctx: _Ctx) -> Vec:
        """The field read as ``value.NAME`` (unsure where it is missing)."""
        self._convert(ctx)
        return self._vec  # type: ignore[return-value]

    def absent_known_none(self) -> bool:
        """Whether the field is known (converted already) to be present in every record."""
        return self._known and self._absent is None

    def absent(self, ctx: _Ctx) -> Mask:
        self._convert(ctx)
        return self._absent

    def python(self, ctx: _Ctx) -> Sequence[Any]:
        """The field's values as the row path's document holds them (UNSET: missing). Exact for every
        record the evaluation was sure of."""
        if self.py is None:
            self.py = _to_python(self._vec, self._absent, ctx)  # type: ignore[arg-type]
            self.clean = self._absent is None
        return self.py


#: no record has the field
def _missing(ctx: _Ctx) -> Field:
    return Field(None, Vec(None, None, None, ctx.all_true()), ctx.all_true(), clean=False)


def _from_python(values: Sequence[Any], ctx: _Ctx) -> tuple[Vec, Mask]:
    """Decoded values as a vector of their most common type (other types unsure), and the absent mask."""
    n = ctx.n
    one = set(map(type, values))
    if len(one) == 1 and (only := next(iter(one))) in _KINDS:  # the common case: one type, present everywhere
        kind, arrow = _KINDS[only]
        return Vec(kind, pa.array(values, arrow)), None
    types = list(map(type, values))
    counts = collections.Counter(types)
    absent = pa.array(list(map(operator.is_, types, itertools.repeat(_UnsetType))), pa.bool_()) \
        if counts.get(_UnsetType) else None
    null = pa.array(list(map(operator.is_, types, itertools.repeat(_NoneType))), pa.bool_()) \
        if counts.get(_NoneType) else None
    best = max((t for t in _KINDS if counts.get(t)), key=counts.__getitem__, default=None)
    if best is None:
        return Vec(None, None, null, _not(ctx, null)), absent
    kind, arrow = _KINDS[best]
    if counts[best] == n:
        return Vec(kind, pa.array(values, arrow)), absent
    ok = list(map(operator.is_, types, itertools.repeat(best)))
    array = pa.array([v if o else None for v, o in zip(values, ok, strict=True)], arrow)
    unsure = _andnot(pc.invert(pa.array(ok, pa.bool_())), null)
    return Vec(kind, array, null, ctx.mask(unsure) if unsure is not None else None), absent


def _to_python(v: Vec, absent: Mask, ctx: _Ctx) -> list[Any]:
    n = ctx.n
    if v.kind is None:
        out: list[Any] = [None] * n
    else:
        values = v.values
        if isinstance(values, pa.Scalar):
            values = pa.repeat(values, n)
        blank = _or(v.null, v.unsure)
        if blank is not None:
            values = pc.if_else(blank, pa.scalar(None, values.type), values)
        out = values.to_pylist()
    if absent is not None:
        for i in pc.indices_nonzero(absent).to_pylist():
            out[i] = UNSET
    return out


def _merge(ctx: _Ctx, applies: Mask, after: Field | None, before: Field | None) -> Field | None:
    """The field where a step applies (``after``) or not (``before``); None: absent everywhere."""
    if after is before:
        return after
    if applies is None:
        return before
    after = after if after is not None else _missing(ctx)
    before = before if before is not None else _missing(ctx)
    if after.py is None and before.py is None:  # both computed: merged as vectors when of one type
        a, b = after.vec(ctx), before.vec(ctx)
        if a.kind == b.kind or a.kind is None or b.kind is None:
            kind = a.kind if a.kind is not None else b.kind
            if a.kind is None or b.kind is None:
                values = a.values if a.kind is not None else b.values
            else:
                values = pc.if_else(applies, a.values, b.values)
            keep = pc.invert(applies)

            def pick(x: Mask, y: Mask) -> Mask:
                return _or(_and(applies, x), _and(keep, y))

            return Field(None, Vec(kind, values, pick(a.null, b.null), pick(a.unsure, b.unsure)),
                         pick(after.absent(ctx), before.absent(ctx)))
    chosen = applies.to_pylist()
    values = [x if c else y for x, y, c in zip(after.python(ctx), before.python(ctx), chosen, strict=True)]
    return Field(values, clean=after.clean and before.clean)


# -- steps -----------------------------------------------------------------------------------------
class _Step:
    __slots__ = ("index", "label", "kind", "when", "predicate", "computed", "constants", "names")

    def __init__(self, index: int, label: str, kind: str, when: Node | None) -> None:
        self.index, self.label, self.kind, self.when = index, label, kind, when
        self.predicate: Node | None = None
        self.computed: list[tuple[str, Node]] = []
        self.constants: dict[str, Any] = {}
        self.names: Any = None


class ColumnarTransform:
    """A pipeline's steps compiled for the columnar tier (:func:`compile_columnar`); immutable."""

    def __init__(self, steps: list[_Step]) -> None:
        self.steps = steps
        named: set[str] = set()
        tested: set[str] = set()
        for step in steps:
            for node in ([step.when] if step.when is not None else []) + \
                    ([step.predicate] if step.predicate is not None else []) + [n for _, n in step.computed]:
                tested |= subset.fields_read(node)
            named |= set(step.constants) | {f for f, _ in step.computed}
            if step.kind == "drop":
                named |= set(step.names)
            elif step.kind == "rename":
                tested |= set(step.names) | set(step.names.values())
        #: fields whose presence a step observes (decoded with UNSET for missing): read, has(), renamed
        self.tested = frozenset(tested)
        #: every field a step names
        self.named = frozenset(named | tested)

    def bind(self, keys: Sequence[str]) -> BoundTransform:
        """The transform for a plan whose columns read the document ``keys`` (after the steps)."""
        return BoundTransform(self, list(dict.fromkeys([*keys, *sorted(self.named)])), list(keys))


class BoundTransform:
    """A :class:`ColumnarTransform` bound to the keys a plan's columns read. Thread-safe (no state)."""

    def __init__(self, transform: ColumnarTransform, input_keys: list[str], output_keys: list[str]) -> None:
        self._steps = transform.steps
        self._tested = transform.tested
        #: the fields decoded from each value (every one a step or column names)
        self.input_keys = input_keys
        self._output_keys = output_keys
        names = [f"f{j}" for j in range(len(input_keys))]
        fields = [(name, _SCALAR_OR_UNSET, UNSET) if key in transform.tested else (name, _SCALAR, None)
                  for name, key in zip(names, input_keys, strict=True)]
        struct = msgspec.defstruct("TransformDocument", fields, rename=dict(zip(names, input_keys, strict=True)),
                                   forbid_unknown_fields=True, gc=False)
        #: decodes newline-joined values (the contract of ingest.core.mapping.fastmap.typed_lines_decoder)
        self.decode_lines = msgspec.json.Decoder(struct).decode_lines
        #: the document of a value the decoder refused (every field missing)
        self.empty = self.decode_lines(b"{}")[0]

    def apply(self, by_field: list[Sequence[Any]], fields: Any, rejected: set[int],
              n: int) -> tuple[list[Sequence[Any]], dict[str, list[int]]]:
        """The steps over a batch of ``n`` records: ``by_field`` holds each input key's decoded values
        (in :attr:`input_keys` order), ``fields`` the records' metadata (``fields("topic")``...);
        ``rejected``: the records the decoder refused (not evaluated), to which this adds every record
        the row mapper must decide. Returns each output key's values (None where missing or null) and
        the positions each filter dropped, by its label. Never raises for any record content.

        A vector has one type, so a field read with values of several JSON types (integers among
        doubles, some nulls, some missing) would leave the records of the minority types unsure: the
        batch is evaluated in groups instead, one per combination of the read fields' types (at most
        :data:`MAX_TYPE_GROUPS`; beyond, whole), and the results put back in batch order."""
        groups = self._type_groups(by_field)
        if groups is None:
            return self._apply(by_field, fields, rejected, n)
        out: list[list[Any]] = [[None] * n for _ in self._output_keys]
        filtered: dict[str, list[int]] = {}
        for positions in groups:
            take = _taker(positions)
            sub_rejected = {k for k, i in enumerate(positions) if i in rejected} if rejected else set()
            sub_out, sub_filtered = self._apply([take(values) for values in by_field], _SubFields(fields, take),
                                                sub_rejected, len(positions))
            rejected.update(positions[k] for k in sub_rejected)
            for column, values in zip(out, sub_out, strict=True):
                for i, value in zip(positions, values, strict=True):
                    column[i] = value
            for label, dropped in sub_filtered.items():
                filtered.setdefault(label, []).extend(positions[k] for k in dropped)
        return out, {label: sorted(dropped) for label, dropped in filtered.items()}

    def _type_groups(self, by_field: list[Sequence[Any]]) -> list[list[int]] | None:
        """The batch's positions grouped by the types of the fields the steps read, or None: one group
        (every read field of one type), or more than :data:`MAX_TYPE_GROUPS`."""
        mixed = [values for key, values in zip(self.input_keys, by_field, strict=True)
                 if key in self._tested and len(set(map(type, values))) > 1]
        if not mixed:
            return None
        groups: dict[tuple[type, ...], list[int]] = {}
        for i, signature in enumerate(zip(*(map(type, values) for values in mixed))):
            group = groups.get(signature)
            if group is None:
                if len(groups) == MAX_TYPE_GROUPS:
                    return None
                group = groups[signature] = []
            group.append(i)
        return list(groups.values())

    def _apply(self, by_field: list[Sequence[Any]], fields: Any, rejected: set[int],
               n: int) -> tuple[list[Sequence[Any]], dict[str, list[int]]]:
        """:meth:`apply` on a batch (or group) evaluated whole."""
        ctx = _Ctx(n, fields)
        tested = self._tested
        doc = {key: Field(values, clean=key not in tested) for key, values in zip(self.input_keys, by_field, strict=True)}
        if rejected:
            flags = [False] * n
            for i in rejected:
                flags[i] = True
            active = pc.invert(pa.array(flags, pa.bool_()))
        else:
            active = ctx.all_true()
        unsure_all: Mask = None
        filtered: dict[str, Mask] = {}
        for step in self._steps:
            applies: Mask = ctx.all_true()
            unsure: Mask = None
            if step.when is not None:
                t, f = _truth(ctx, evaluate(step.when, doc, ctx))
                applies = t
                unsure = _not(ctx, _or(t, f))
            if step.kind == "filter":
                kept, dropped = _truth(ctx, evaluate(step.predicate, doc, ctx))  # type: ignore[arg-type]
                unsure = _or(unsure, _andnot(applies, _or(kept, dropped)))
                dropped_here = _andnot(_and(applies, dropped), unsure)
                dropped_here = _and(dropped_here, active)
                if dropped_here is not None:
                    filtered[step.label] = _or(filtered.get(step.label), dropped_here)
                    active = pc.and_not(active, dropped_here)
            elif step.kind == "set":
                after = dict(doc)
                for name, node in step.computed:
                    v = evaluate(node, doc, ctx)
                    unsure = _or(unsure, _and(applies, v.unsure))
                    after[name] = Field(None, v)
                for name, value in step.constants.items():
                    after[name] = Field([value] * n)
                doc = self._merged(ctx, applies, after, doc)
            elif step.kind == "drop":
                after = {k: v for k, v in doc.items() if k not in step.names}
                doc = self._merged(ctx, applies, after, doc)
            else:  # rename
                doc, conflict = _renamed(ctx, doc, step.names, applies)
                unsure = _or(unsure, conflict)
            if unsure is not None:
                unsure = _and(ctx.mask(unsure), active)
                if unsure is not None:
                    unsure_all = _or(unsure_all, unsure)
                    active = pc.and_not(active, unsure)
        if unsure_all is not None:
            rejected.update(pc.indices_nonzero(unsure_all).to_pylist())
        out: list[Sequence[Any]] = []
        for key in self._output_keys:
            field = doc.get(key)
            if field is None:
                out.append([None] * n)
                continue
            values = field.python(ctx)
            if not field.clean and field.absent_known_none():
                field.clean = True  # a tested field present in every record
            out.append(values if field.clean else [None if v is UNSET else v for v in values])
        return out, {label: pc.indices_nonzero(mask).to_pylist() for label, mask in filtered.items()}

    @staticmethod
    def _merged(ctx: _Ctx, applies: Mask, after: dict[str, Field], before: dict[str, Field]) -> dict[str, Field]:
        if applies is not None and applies is ctx.all_true():
            return after
        out = {}
        for name in dict.fromkeys([*before, *after]):
            merged = _merge(ctx, applies, after.get(name), before.get(name))
            if merged is not None:
                out[name] = merged
        return out


#: a batch whose read fields' types combine in more ways than this is evaluated whole (each group
#: costs a few dozen Arrow calls)
MAX_TYPE_GROUPS = 16


def _taker(positions: list[int]) -> Any:
    """``values -> the values at positions`` (a sequence, also for one position)."""
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*positions)


class _SubFields:
    """A group's metadata: the batch's fields (:class:`~ingest.core.mapping.columnar.BatchFields`) at
    the group's positions."""

    __slots__ = ("_fields", "_take", "_lists")

    def __init__(self, fields: Any, take: Any) -> None:
        self._fields, self._take = fields, take
        self._lists: dict[str, list[Any]] = {}

    def __call__(self, name: str) -> list[Any]:
        got = self._lists.get(name)
        if got is None:
            got = self._lists[name] = list(self._take(self._fields(name)))
        return got


def _renamed(ctx: _Ctx, doc: dict[str, Field], names: dict[str, str], applies: Mask
             ) -> tuple[dict[str, Field], Mask]:
    """The document after ``rename`` where it applies, and where it fails (a new name the value has
    already, which no rename moves away: the row path's "exists already")."""
    conflict: Mask = None
    for old, new in names.items():
        if new in names or old not in doc or new not in doc:
            continue
        both = _and(_not(ctx, doc[old].absent(ctx)), _not(ctx, doc[new].absent(ctx)))
        conflict = _or(conflict, ctx.mask(both) if both is not None else None)
    after = {k: v for k, v in doc.items() if k not in names}
    for old, new in names.items():
        source = doc.get(old)
        stays = doc.get(new) if new not in names else None
        if source is None:
            if stays is not None:
                after[new] = stays
            continue
        absent = source.absent(ctx)
        moved = _merge(ctx, _not(ctx, absent), source, stays) if absent is not None else source
        if moved is not None:
            after[new] = moved
    return BoundTransform._merged(ctx, applies, after, doc), _and(applies, conflict)


# -- compiling ---------------------------------------------------------------------------------------
def compile_columnar(steps: Sequence[Any], transformer: Any) -> ColumnarTransform:
    """The columnar form of ``steps`` (:class:`ingest.config.transforms.TransformStep`), whose row form
    is ``transformer`` (:class:`~.compile.Transformer`: a ``set`` step's constants are taken from it,
    evaluated by CEL). Raises :class:`Unsupported` naming the first step (``transforms[1] (1-set):
    set.label: ...``) and what in it the columnar tier does not evaluate. Pure."""
    out: list[_Step] = []
    for index, (step, compiled) in enumerate(zip(steps, transformer.steps, strict=True)):
        label = step.label(index)
        where = f"transforms[{index}] ({label})"

        def parsed(sub: str, text: str) -> Node:
            try:
                return subset.parse(text)
            except Unsupported as exc:
                raise Unsupported(f"{where}: {sub}: {exc} is not evaluated by the columnar tier") from None  # noqa: B023

        kind = step.kind
        if kind not in ("filter", "set", "drop", "rename"):
            raise Unsupported(f"{where}: the {kind} step runs on the row path only")
        c = _Step(index, label, kind, parsed("when", step.when) if step.when is not None else None)
        if kind == "filter":
            c.predicate = parsed("filter", step.filter)
        elif kind == "set":
            for field, text in step.set.items():
                if variables_read([text]) or field not in compiled.constants:
                    c.computed.append((field, parsed(f"set.{field}", text)))
                else:
                    c.constants[field] = compiled.constants[field]
            names = [f for f, _ in c.computed] + list(c.constants)
        elif kind == "drop":
            c.names = frozenset(step.drop)
            names = list(step.drop)
        else:
            c.names = dict(step.rename)
            names = [*step.rename, *step.rename.values()]
        for name in (names if kind != "filter" else []):
            if unnameable_key(name):
                raise Unsupported(f"{where}: the field {name!r} has a quote, backslash or control character")
        out.append(c)
    return ColumnarTransform(out)

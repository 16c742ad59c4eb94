"""The CEL binding behind three calls: :func:`compile_expression`, :func:`evaluate`, :func:`to_json`.

Binding: ``cel-expr-python`` (Google's C++ CEL runtime). Measured against the Rust-based
``common-expression-language`` on this project's expressions (README, "Transforms"): 5.2-5.8 µs
per evaluation against 13.1-13.7 µs with a fresh context each call, and 1.8 µs with the context
(an ``Activation``) built once per record and shared by a record's expressions. Never ``eval``:
CEL has no side effects, no loops without bounds, no I/O and no clock (no ``now()``), so the same
record always gives the same result (replay-stable).

Variables an expression reads: ``value`` (the record value as the previous steps left it), ``key``
(bytes or null), ``topic`` (string), ``partition``, ``offset``, ``timestamp`` (epoch
milliseconds: ints), ``headers`` (a map of name to bytes; the last of a repeated header wins). A
record republished by ``replay-dlq --to topic`` stands for its origin (topic, partition, offset).
All of these are replay-stable. One is not: ``ingest_time`` (a timestamp: when this process
transformed the record, one value per record, from the clock the caller passes), which only an
expression compiled with ``ingest_time=True`` may read (a step declaring ``replay_stable: false``);
anywhere else it is refused when compiled (:class:`CompileError` with its position).

What CEL sees of a decoded value (:func:`cel_value`; the mapper still gets the decoded value itself):
JSON values as they are; the Python values of the typed formats (Avro logical types from fastavro,
Protobuf well-known types) converted once per value a step reads -- ``Decimal`` → double (the nearest
one: exact to 15 significant digits, never exact arithmetic), an aware ``datetime`` → timestamp (a
naive one, Avro's ``local-timestamp-*``, is read as UTC), ``timedelta`` → duration, ``date`` →
``'YYYY-MM-DD'`` text, ``time`` → ``'HH:MM:SS.ffffff'`` text, ``UUID`` → its canonical text, ``bytes``
→ bytes (whole: the binding cuts Python ``bytes`` at the first NUL byte, so they are handed over as a
``bytearray``), a tuple → a list. Any other Python type fails the record (:class:`EvalError` naming
the field). Integers the binding cannot hold (past 64 bits) fail the expressions with its message.

Extensions (all deterministic): CEL's ``strings`` (``lowerAscii``, ``split``, ``replace``, ``format``,
...), ``math`` (``math.round``, ``math.greatest``, ...), ``encoders`` (``base64.encode``/``decode``),
``bindings`` (``cel.bind``) and ``optional`` (``value.?a.orValue(d)``) libraries.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import re
import uuid
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_encoders, ext_math, ext_optional, ext_strings
from google.protobuf import duration_pb2, timestamp_pb2

from ingest.types import Record

_STABLE_VARIABLES = {
    "value": cel.Type.DYN,
    "key": cel.Type.DYN,
    "topic": cel.Type.STRING,
    "partition": cel.Type.INT,
    "offset": cel.Type.INT,
    "timestamp": cel.Type.DYN,  # epoch milliseconds, or null when the record has none
    "headers": cel.Type.Map(cel.Type.STRING, cel.Type.DYN),
}
_EXTENSIONS = (ext_strings.ExtStrings, ext_math.ExtMath, ext_encoders.ExtEncoders, ext_bindings.ExtBindings,
               ext_optional.ExtOptional)
#: every program is compiled and evaluated in this environment ...
_ENV = cel.NewEnv(variables={**_STABLE_VARIABLES, "ingest_time": cel.Type.TIMESTAMP},
                  extensions=[make() for make in _EXTENSIONS])
#: ... and first type-checked in this one, without ``ingest_time``, unless the step allows it
_STABLE_ENV = cel.NewEnv(variables=_STABLE_VARIABLES, extensions=[make() for make in _EXTENSIONS])
#: the variable that is not replay-stable
INGEST_TIME = "ingest_time"
_READS_INGEST_TIME = re.compile(r"undeclared reference to 'ingest_time'")
_ERROR = cel.Type.ERROR
_BOOL = cel.Type.BOOL
_DYN = cel.Type.DYN
#: ``ERROR: <input>:1:16: Syntax error: ...`` -- the position the binding reports
_POSITION = re.compile(r"ERROR: <input>:(\d+):(\d+): ")
_STATUS = re.compile(r"^[A-Z_]+: ")

Program = Any  # cel_expr_python.cel.Expression


class CompileError(Exception):
    """An expression that does not compile: ``line``/``column`` (1-based, when known), the message
    and the binding's caret drawing of the expression."""

    def __init__(self, line: int | None, column: int | None, message: str) -> None:
        super().__init__(line, column, message)
        self.line, self.column, self.message = line, column, message

    def __str__(self) -> str:
        where = f" at line {self.line}, column {self.column}" if self.line is not None else ""
        return f"does not compile{where}: {self.message}"


class EvalError(Exception):
    """An expression failed on one record (missing field, no such overload, overflow, ...)."""


@functools.lru_cache(maxsize=4096)
def compile_expression(text: str, *, predicate: bool = False, ingest_time: bool = False) -> Program:
    """The compiled program of ``text`` (cached: an expression is compiled once per process).

    ``predicate``: the expression must give a bool (a ``filter`` or ``when``); one whose type is
    known not to be bool is refused here, one of dynamic type is checked per record.
    ``ingest_time``: the expression may read ``ingest_time`` (not replay-stable); without it, one
    that reads it is refused, at the position of the read.
    Raises :class:`CompileError`. Pure: no I/O.
    """
    if not ingest_time:
        try:
            _STABLE_ENV.compile(text)
        except RuntimeError as exc:
            error = _compile_error(str(exc))
            if _READS_INGEST_TIME.search(error.message):
                raise CompileError(error.line, error.column,
                                   "reads ingest_time, which is not replay-stable (a replayed record would get "
                                   "another value): declare replay_stable: false on the step to use it") from None
            raise error from None
    try:
        program = _ENV.compile(text)
    except RuntimeError as exc:
        raise _compile_error(str(exc)) from None
    if predicate:
        kind = program.return_type()
        if not (kind == _BOOL or kind == _DYN):
            raise CompileError(None, None, f"a predicate must give a bool; this gives {kind.name().lower()}")
    return program


def _compile_error(text: str) -> CompileError:
    text = _STATUS.sub("", text.strip()).replace(" [INVALID_ARGUMENT]", "")
    m = _POSITION.search(text)
    if m is None:
        return CompileError(None, None, text)
    message = (text[:m.start()] + text[m.end():]).strip()
    return CompileError(int(m.group(1)), int(m.group(2)), message)


#: the variables an expression may read (every one declared in ``_ENV``)
VARIABLES = ("value", "key", "topic", "partition", "offset", "timestamp", "headers", INGEST_TIME)
_METADATA = frozenset(VARIABLES) - {"value"}


def variables_read(texts: list[str]) -> frozenset[str]:
    """The variables ``texts`` may read: every declared name that occurs in them as a word (a name
    inside a string literal counts too: over-inclusive, never short). An activation needs only these."""
    return frozenset(name for name in VARIABLES if any(re.search(rf"\b{name}\b", t) for t in texts))


def activation(record: Record, value: Any, names: frozenset[str] = _METADATA,
               ingest_time: datetime.datetime | None = None, *, plain: bool = False) -> Any:
    """The variables of one record's expressions: ``value`` and the metadata among ``names`` (see
    :func:`variables_read`; building only those saves half the cost). Reusable across expressions.
    ``ingest_time``: an aware datetime, given when ``names`` holds ``ingest_time``. ``plain``: ``value``
    holds JSON values only (``format: json``), so :func:`cel_value` is skipped."""
    data: dict[str, Any] = {"value": value}
    if ingest_time is not None:
        data[INGEST_TIME] = ingest_time
    if names:
        origin = record.origin
        if origin is None:
            data["topic"], data["partition"], data["offset"] = record.topic, record.partition, record.offset
        else:
            data["topic"], data["partition"], data["offset"] = origin[:3]
        key = record.key
        data["key"] = bytearray(key) if type(key) is bytes else key  # whole: see the module docstring
        data["timestamp"] = record.timestamp_ms
        if "headers" in names:
            data["headers"] = ({name: None if hvalue is None else bytearray(hvalue) for name, hvalue in record.headers}
                               if record.headers else {})
    if not plain:
        data["value"] = cel_value(value, "value")
    try:
        return _ENV.Activation(data)
    except Exception as exc:  # noqa: BLE001 - a value the binding cannot take fails this record only
        raise EvalError(f"the record cannot be given to CEL: {exc}") from None


_PLAIN = frozenset((str, int, float, bool, type(None)))
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def cel_value(value: Any, where: str = "value") -> Any:
    """``value`` as the binding can take it (see the module docstring): the same object when it needs
    no conversion (JSON values), else a converted copy -- ``value`` itself is never changed. Raises
    :class:`EvalError` naming the field (``value.a.b``) of a value of a type CEL cannot hold."""
    t = type(value)
    if t in _PLAIN:
        return value
    if t is dict:
        out = None
        for k, v in value.items():
            if type(v) in _PLAIN:
                continue
            c = cel_value(v, f"{where}.{k}")
            if c is not v:
                if out is None:
                    out = dict(value)
                out[k] = c
        return value if out is None else out
    if t is list or t is tuple:
        items = None
        for i, v in enumerate(value):
            if type(v) in _PLAIN:
                continue
            c = cel_value(v, f"{where}[{i}]")
            if c is not v:
                if items is None:
                    items = list(value)
                items[i] = c
        return list(value) if items is None and t is tuple else (value if items is None else items)
    return _convert_scalar(value, t, where)


def _convert_scalar(value: Any, t: type, where: str) -> Any:
    if t is bytes:
        return bytearray(value)
    if t is bytearray:
        return value
    if t is decimal.Decimal:
        return float(value)
    if t is datetime.datetime:
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        delta = value - _EPOCH
        return timestamp_pb2.Timestamp(seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000)
    if t is datetime.timedelta:
        micros = (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds
        seconds, rest = divmod(abs(micros), 1_000_000)
        sign = -1 if micros < 0 else 1
        return duration_pb2.Duration(seconds=sign * seconds, nanos=sign * rest * 1000)
    if t is datetime.date:
        return value.isoformat()
    if t is datetime.time:
        return value.replace(tzinfo=None).isoformat(timespec="microseconds")
    if t is uuid.UUID:
        return str(value)
    if isinstance(value, dict):  # a dict subclass
        return cel_value(dict(value), where)
    raise EvalError(f"{where}: a Python {t.__name__} cannot be given to CEL")


def empty_activation() -> Any:
    """Variables for an expression that reads none (a constant, evaluated once when compiled)."""
    return _ENV.Activation({})


def evaluate(program: Program, variables: Any) -> Any:
    """The program's result on ``variables`` (from :func:`activation`), as CEL values converted by
    :func:`to_json`. Raises :class:`EvalError` with the binding's message."""
    try:
        result = program.eval(variables)
        value = result.plain_value()
    except Exception as exc:  # noqa: BLE001 - the binding's own failure is this record's failure
        raise EvalError(str(exc)) from None
    t = type(value)
    if t is bool or t is int or t is float or value is None:  # the common results: no error is one of these
        return value
    if t is str:  # an error's plain value is its message: ask the type only here
        if result.type() == _ERROR:
            raise EvalError(_STATUS.sub("", value))
        return value
    return to_json(value)


def to_json(value: Any) -> Any:
    """A CEL result as the mapper's JSON-like values: bytes as UTF-8 text (raising EvalError when
    they are not), timestamps as ISO 8601 text with an offset, durations as seconds (float)."""
    t = type(value)
    if t is str or t is int or t is float or t is bool or value is None:
        return value
    if t is dict:
        return {to_json(k): to_json(v) for k, v in value.items()}
    if t is list:
        return [to_json(v) for v in value]
    if t is bytearray or t is bytes:
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise EvalError("the result is bytes that are not UTF-8 text") from None
    if t is datetime.datetime:
        return value.isoformat()
    if t is datetime.timedelta:
        return value.total_seconds()
    return str(value)

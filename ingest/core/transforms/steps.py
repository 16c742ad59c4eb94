"""One class per step kind. Each step's ``apply(doc, ctx) -> doc`` takes the record value as the
previous steps left it (a dict) and returns the new one; it never changes ``doc`` in place (a
modified value is a new dict), so a decoder's cached documents stay intact.

A step fails on a record by raising :class:`StepError` (or the CEL :class:`~.cel.EvalError`,
:class:`~.timestamps.TimestampError`); :class:`~.compile.Transformer` turns that into the
record's ``transform_error`` dead letter naming the step. ``filter`` raises
:class:`~ingest.errors.Filtered` for a record it drops.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from ingest.core.transforms.cel import INGEST_TIME, EvalError, Program, activation, evaluate
from ingest.errors import Filtered
from ingest.types import Record


class StepError(Exception):
    """A step cannot apply to this record (the message says why)."""


class Context:
    """One record's evaluation context: the CEL variables, built once per value the steps see."""

    __slots__ = ("record", "_names", "_doc", "_variables", "_clock", "_now", "_plain", "exploded")

    def __init__(self, record: Record, names: frozenset[str],
                 clock: Callable[[], datetime.datetime] | None = None, plain: bool = False,
                 explode_steps: int = 0) -> None:
        """``names``: the variables the pipeline's expressions read (:func:`~.cel.variables_read`).
        ``clock``: gives ``ingest_time`` (read once per record, when ``names`` holds it). ``plain``:
        the values are JSON values only (see :func:`~.cel.activation`). ``explode_steps``: how many
        ``explode`` steps the pipeline has (slots of :attr:`exploded`)."""
        self.record = record
        self._plain = plain
        self._names = names
        self._doc: Any = None
        self._variables: Any = None
        self._clock = clock if INGEST_TIME in names else None
        self._now: datetime.datetime | None = None
        #: per explode step (in order): ``(parent link values, child documents)`` where it applied, else None
        self.exploded: list[tuple[dict[str, Any], list[dict[str, Any]]] | None] = [None] * explode_steps

    def variables(self, doc: dict[str, Any]) -> Any:
        """The CEL variables with ``value`` = ``doc`` (rebuilt only when a step made a new value)."""
        if self._variables is None or self._doc is not doc:
            if self._clock is not None and self._now is None:  # one ingest time for all the record's steps
                self._now = self._clock()
            self._variables = activation(self.record, doc, self._names, self._now, plain=self._plain)
            self._doc = doc
        return self._variables


def holds(program: Program, variables: Any, what: str) -> bool:
    """A predicate's result; anything but a bool is an error (CEL has no truthiness)."""
    result = evaluate(program, variables)
    if type(result) is not bool:
        raise EvalError(f"{what} must give a bool, got {type(result).__name__} {str(result)[:40]!r}")
    return result


class Step:
    """What every step has: its index in ``transforms``, its label, its kind, its ``when`` program."""

    __slots__ = ("index", "label", "kind", "when")

    def __init__(self, index: int, label: str, kind: str, when: Program | None) -> None:
        self.index, self.label, self.kind, self.when = index, label, kind, when

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        raise NotImplementedError


class FilterStep(Step):
    """Keeps the records for which the predicate holds; raises Filtered(label) for the others."""

    __slots__ = ("program",)

    def __init__(self, index: int, label: str, when: Program | None, program: Program) -> None:
        super().__init__(index, label, "filter", when)
        self.program = program

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        try:
            kept = holds(self.program, ctx.variables(doc), "the filter")
        except EvalError as exc:
            raise StepError(f"filter: {exc}") from None
        if not kept:
            raise Filtered(self.label)
        return doc


class SetStep(Step):
    """Sets fields to computed values; every expression reads the value as it was before this step.
    ``constants``: fields whose expressions read no variable, evaluated once when compiled.
    ``fused``: one program giving every computed field as a map (one evaluation per record instead of
    one per field); when it fails, the fields are evaluated one by one to name the one that fails."""

    __slots__ = ("fields", "constants", "fused")

    def __init__(self, index: int, label: str, when: Program | None, fields: list[tuple[str, Program]],
                 constants: dict[str, Any] | None = None, fused: Program | None = None) -> None:
        super().__init__(index, label, "set", when)
        self.fields = fields
        self.constants = constants or {}
        self.fused = fused

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        out = dict(doc)
        if self.fields:
            variables = ctx.variables(doc)
            computed = None
            if self.fused is not None:
                try:
                    computed = evaluate(self.fused, variables)
                except EvalError:
                    computed = None  # evaluated one by one below: the failing field is named
            if type(computed) is dict:
                out.update(computed)
            else:
                for field, program in self.fields:
                    try:
                        out[field] = evaluate(program, variables)
                    except EvalError as exc:
                        raise StepError(f"set.{field}: {exc}") from None
        if self.constants:
            out.update(self.constants)
        return out


class DropStep(Step):
    """Removes top-level fields (a missing one is no error)."""

    __slots__ = ("fields",)

    def __init__(self, index: int, label: str, when: Program | None, fields: list[str]) -> None:
        super().__init__(index, label, "drop", when)
        self.fields = frozenset(fields)

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        fields = self.fields
        return {k: v for k, v in doc.items() if k not in fields}


class RenameStep(Step):
    """Renames top-level fields (a missing one is no error; a new name the value already has is)."""

    __slots__ = ("names",)

    def __init__(self, index: int, label: str, when: Program | None, names: dict[str, str]) -> None:
        super().__init__(index, label, "rename", when)
        self.names = names

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        names = self.names
        out: dict[str, Any] = {}
        for k, v in doc.items():
            new = names.get(k, k)
            if new in out:
                raise StepError(f"rename: field {new!r} exists already")
            out[new] = v
        return out


class FlattenStep(Step):
    """Nested objects become ``parent<sep>child`` fields, down to ``max_depth`` levels; arrays and
    scalars stay as they are (a json/jsonb column takes an array); an empty object stays an empty
    object. Two fields flattened to one name fail the record."""

    __slots__ = ("separator", "max_depth", "only")

    def __init__(self, index: int, label: str, when: Program | None, separator: str, max_depth: int | None,
                 only: list[str] | None) -> None:
        super().__init__(index, label, "flatten", when)
        self.separator, self.max_depth = separator, max_depth
        self.only = None if only is None else frozenset(only)

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        out: dict[str, Any] = {}
        only = self.only
        for k, v in doc.items():
            if type(v) is dict and v and (only is None or k in only):
                self._into(out, k, v, 1)
            else:
                _put(out, k, v)
        return out

    def _into(self, out: dict[str, Any], prefix: str, node: dict[str, Any], depth: int) -> None:
        sep, max_depth = self.separator, self.max_depth
        for k, v in node.items():
            name = f"{prefix}{sep}{k}"
            if type(v) is dict and v and (max_depth is None or depth < max_depth):
                self._into(out, name, v, depth + 1)
            else:
                _put(out, name, v)


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise StepError(f"flatten: two fields flatten to {name!r}")
    out[name] = value


class TimestampStep(Step):
    """Parses ``field`` into ISO 8601 text (UTC) in ``into``; a missing field fails the record, a null
    stays null (the column's own rules then decide)."""

    __slots__ = ("field", "into", "parse")

    def __init__(self, index: int, label: str, when: Program | None, field: str, into: str,
                 parse: Callable[[Any], str]) -> None:
        super().__init__(index, label, "timestamp", when)
        self.field, self.into, self.parse = field, into, parse

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        field = self.field
        if field not in doc:
            raise StepError(f"timestamp: field {field!r} is missing")
        value = doc[field]
        out = dict(doc)
        try:
            out[self.into] = None if value is None else self.parse(value)
        except ValueError as exc:
            raise StepError(f"timestamp {field!r}: {exc}") from None
        return out


class ExplodeStep(Step):
    """Takes the array at ``path`` apart into child documents, one per element, and keeps them in the
    record's :class:`Context` (slot ``slot``); the value passes on unchanged.

    A child document is the element's fields (an element that is not an object: ``{"value": element}``)
    plus the ``parent`` columns (CEL over the value as this step sees it; they win over an element's
    field of the same name) and the ``index_as`` column (the element's position from ``index_start``).
    A missing or null array, or one that is not an array, fails the record: with ``replace`` an
    absent array would delete the parent's children, so only an empty array (``[]``) means "none".
    """

    __slots__ = ("slot", "path", "links", "index_as", "index_start")

    def __init__(self, index: int, label: str, when: Program | None, slot: int, path: str,
                 links: list[tuple[str, Program]], index_as: str | None, index_start: int) -> None:
        super().__init__(index, label, "explode", when)
        self.slot, self.path, self.links = slot, tuple(path.split(".")), links
        self.index_as, self.index_start = index_as, index_start

    def apply(self, doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
        node: Any = doc
        for part in self.path:
            node = node.get(part) if type(node) is dict else None
        shown = ".".join(self.path)
        if node is None:
            raise StepError(f"explode: field {shown!r} is missing or null (an empty array is [])")
        if type(node) is not list:
            raise StepError(f"explode: field {shown!r} is not an array, got {type(node).__name__}")
        variables = ctx.variables(doc)
        links: dict[str, Any] = {}
        for column, program in self.links:
            try:
                links[column] = evaluate(program, variables)
            except EvalError as exc:
                raise StepError(f"explode.parent.{column}: {exc}") from None
        children = []
        index_as, position = self.index_as, self.index_start
        for element in node:
            child = dict(element) if type(element) is dict else {"value": element}
            child.update(links)
            if index_as is not None:
                child[index_as] = position
            position += 1
            children.append(child)
        ctx.exploded[self.slot] = (links, children)
        return doc

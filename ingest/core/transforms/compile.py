"""Configured steps → a :class:`Transformer`; the start-up check of every expression.

:func:`compile_transforms` compiles each expression once (:func:`~.cel.compile_expression` caches
by text) and raises :class:`~ingest.errors.ConfigError` naming the step's config path and the
position, e.g. ``pipelines[0].transforms[2].set.amount_cents: does not compile at line 1, column
16: Syntax error: ...``. :func:`check_transforms` runs it for every pipeline of a configuration
(``load_settings`` calls it, so ``ingest check`` and every command refuse such a file).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any

from ingest.core.transforms import steps as S
from ingest.core.transforms.cel import (
    CompileError,
    EvalError,
    compile_expression,
    empty_activation,
    evaluate,
    variables_read,
)
from ingest.core.transforms.timestamps import TimestampError, parser
from ingest.errors import ConfigError, Filtered, InvalidRecord
from ingest.types import Record

__all__ = ["Transformer", "check_transforms", "compile_transforms"]


class Transformer:
    """A pipeline's compiled steps: :meth:`apply` runs them, in order, on one record's value.

    Immutable after construction and shared by every thread that maps (the CEL programs are
    thread-safe; the per-record state lives in a :class:`~.steps.Context`).
    """

    __slots__ = ("steps", "_names", "_clock", "_plain", "explode_steps")

    def __init__(self, steps: Sequence[S.Step], expressions: Sequence[str] = (),
                 clock: Callable[[], datetime.datetime] | None = None, plain_values: bool = False) -> None:
        """``expressions``: the CEL texts of the steps (which metadata variables to build).
        ``clock``: gives an aware datetime, ``ingest_time`` of each record, for steps declaring
        ``replay_stable: false``; None when no step does (the clock is never read then).
        ``plain_values``: the decoded values hold JSON values only (``format: json``): CEL takes them
        as they are, skipping the typed values' conversion (:func:`~.cel.cel_value`)."""
        self.steps = tuple(steps)
        self._names = variables_read(list(expressions)) - {"value"}
        self._clock = clock
        self._plain = plain_values
        #: how many ``explode`` steps there are (:meth:`apply_exploding` returns one slot per step)
        self.explode_steps = sum(1 for step in self.steps if step.kind == "explode")

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(step.label for step in self.steps)

    def apply(self, record: Record, doc: Any, *, shape_only: bool = False) -> dict[str, Any]:
        """The record's value after every step; see :meth:`apply_exploding` (whose children it drops)."""
        return self.apply_exploding(record, doc, shape_only=shape_only)[0]

    def apply_exploding(self, record: Record, doc: Any, *, shape_only: bool = False) -> tuple[
            dict[str, Any], list[tuple[dict[str, Any], list[dict[str, Any]]] | None]]:
        """The record's value after every step (``doc`` itself is never changed). ``shape_only``: only
        the steps that move fields (``rename``, ``flatten``, ``drop``), for a delete's ``before`` image,
        which often holds the key alone: its key columns are found where the upserts' are.

        Raises :class:`~ingest.errors.Filtered` (carrying the filter's label) for a record a filter
        drops, and :class:`~ingest.errors.InvalidRecord` (stage ``transform``, class
        ``transform_error``, the message naming the step's index and label) for a record a step
        fails on -- a value that is not an object too. Nothing else, for any input.
        """
        if type(doc) is not dict:
            raise InvalidRecord("transform", "transform_error",
                                f"transforms need the record value to be an object, got {type(doc).__name__}")
        ctx = S.Context(record, self._names, self._clock, self._plain, self.explode_steps)
        step: S.Step | None = None
        try:
            for step in self.steps:
                if shape_only and step.kind in _VALUE_STEPS:
                    continue
                when = step.when
                if when is not None:
                    try:
                        applies = S.holds(when, ctx.variables(doc), "when")
                    except EvalError as exc:
                        raise S.StepError(f"when: {exc}") from None
                    if not applies:
                        continue
                doc = step.apply(doc, ctx)
        except Filtered:
            raise
        except (S.StepError, EvalError, TimestampError) as exc:
            raise InvalidRecord("transform", "transform_error", _where(step) + str(exc)[:500]) from None
        except Exception as exc:  # noqa: BLE001 - defensive: a record never crashes the pipeline
            raise InvalidRecord("transform", "transform_error",
                                _where(step) + f"internal error {type(exc).__name__}: {exc}"[:300]) from None
        return doc, ctx.exploded


#: the steps a delete's ``before`` image skips (see :meth:`Transformer.apply`)
_VALUE_STEPS = frozenset(("filter", "set", "timestamp", "explode"))


def _wall_clock() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _where(step: S.Step | None) -> str:
    return "" if step is None else f"transforms[{step.index}] ({step.label}): "


def _fused(texts: dict[str, str], fields: list[tuple[str, Any]], ingest_time: bool = False) -> Any:
    """One program computing every field of ``fields`` as a CEL map (None for fewer than two)."""
    if len(fields) < 2:
        return None
    # each expression on its own line: a // comment in one ends with it
    entries = ", ".join(f"{json.dumps(field)}: ({texts[field]}\n)" for field, _ in fields)
    try:
        return compile_expression("{" + entries + "}", ingest_time=ingest_time)
    except CompileError:  # pragma: no cover - each part compiled alone; then evaluated one by one
        return None


def compile_transforms(steps: Sequence[Any], where: str, *, clock: Callable[[], datetime.datetime] | None = None,
                       plain_values: bool = False) -> Transformer | None:
    """The :class:`Transformer` of ``steps`` (:class:`ingest.config.transforms.TransformStep`), None
    when there are none. ``where``: the config path of the list (``pipelines[0].transforms``).
    ``clock``: gives ``ingest_time`` (default: the wall clock, UTC), read once per record only when a
    step declares ``replay_stable: false``; tests pass a fixed one. ``plain_values``: see
    :class:`Transformer` (only where every decoded value is a JSON value).

    Raises :class:`~ingest.errors.ConfigError` naming ``<where>[i].<kind>[.<field>]`` and the
    position for an expression that does not compile -- one reading ``ingest_time`` in a step that
    does not declare ``replay_stable: false`` too. Pure: no I/O.
    """
    if not steps:
        return None
    compiled: list[S.Step] = []
    for index, step in enumerate(steps):
        path = f"{where}[{index}]"
        live = getattr(step, "replay_stable", True) is False  # may read ingest_time

        def program(sub: str, text: str, *, predicate: bool = False) -> Any:
            try:
                return compile_expression(text, predicate=predicate, ingest_time=live)  # noqa: B023 - used at once
            except CompileError as exc:
                raise ConfigError(f"{path}.{sub}: {exc}") from None  # noqa: B023 - used at once

        label = step.label(index)
        when = program("when", step.when, predicate=True) if step.when is not None else None
        kind = step.kind
        if kind == "filter":
            compiled.append(S.FilterStep(index, label, when, program("filter", step.filter, predicate=True)))
        elif kind == "set":
            fields, constants = [], {}
            for field, text in step.set.items():
                compiled_program = program(f"set.{field}", text)
                if variables_read([text]):
                    fields.append((field, compiled_program))
                    continue
                try:  # reads no variable: the same for every record, so evaluated once, here
                    constants[field] = evaluate(compiled_program, empty_activation())
                except EvalError as exc:
                    raise ConfigError(f"{path}.set.{field}: fails for every record: {exc}") from None
            compiled.append(S.SetStep(index, label, when, fields, constants, _fused(step.set, fields, live)))
        elif kind == "drop":
            compiled.append(S.DropStep(index, label, when, list(step.drop)))
        elif kind == "rename":
            compiled.append(S.RenameStep(index, label, when, dict(step.rename)))
        elif kind == "flatten":
            f = step.flatten
            compiled.append(S.FlattenStep(index, label, when, f.separator, f.max_depth, f.fields))
        elif kind == "timestamp":
            t = step.timestamp
            compiled.append(S.TimestampStep(index, label, when, t.field, t.into or t.field,
                                            parser(t.format, t.pattern, t.timezone)))
        elif kind == "explode":
            e = step.explode
            links = [(column, program(f"explode.parent.{column}", text)) for column, text in e.parent.items()]
            slot = sum(1 for done in compiled if done.kind == "explode")
            compiled.append(S.ExplodeStep(index, label, when, slot, e.path, links, e.index_as, e.index_start))
        else:  # pragma: no cover - the settings allow no other kind
            raise ConfigError(f"{path}: unknown step kind {kind!r}")
    live = any(getattr(step, "replay_stable", True) is False for step in steps)
    return Transformer(compiled, [text for step in steps for _, text in step.expressions()],
                       (clock or _wall_clock) if live else None, plain_values)


def check_transforms(pipelines: Sequence[Any]) -> None:
    """Compile every pipeline's transforms (``pipelines[i].transforms``); raises ConfigError."""
    for i, p in enumerate(pipelines):
        compile_transforms(p.transforms, f"pipelines[{i}].transforms")

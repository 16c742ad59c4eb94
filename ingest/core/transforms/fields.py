"""Which fields of the *decoded* record value a pipeline's transforms and columns read.

For ``ingest check`` against a declared schema (:mod:`ingest.formats.check`): an expression that
reads a field the schema lacks fails every record that reaches it, and a column reads the
*transformed* value, so its path is traced back through the steps before it is looked up.

Tracing (:class:`Shape`), step by step: ``set`` and ``timestamp``'s ``into`` produce fields (not in
the schema: not checked), ``rename`` moves a field (a later read of the new name is a read of the
old one), ``drop`` removes one (a later read of it is a problem), ``flatten`` changes every name
(nothing after it is checked). References are read from the CEL text: ``value.a.b`` (identifiers
joined by dots; a reference inside ``has(...)`` is a test, not a read, and index syntax such as
``value['a']`` is not followed). Over-cautious by design: a missed reference means no warning, never
a false refusal.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: ``value.a.b`` not preceded by a name character or a dot (``x.value.a`` is not the variable)
_REF = re.compile(r"(?<![\w.])value((?:\s*\.\s*[A-Za-z_]\w*)+)")
_HAS = re.compile(r"\bhas\s*\(\s*value(?:\s*\.\s*[A-Za-z_]\w*)+\s*\)")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def references(text: str) -> list[tuple[tuple[str, ...], int, int]]:
    """``(path, line, column)`` of each ``value.a.b`` read in ``text`` (1-based position; string
    literals and ``has()`` tests left out)."""
    blanked = _HAS.sub(lambda m: " " * len(m.group()), _STRING.sub(lambda m: " " * len(m.group()), text))
    out = []
    for m in _REF.finditer(blanked):
        path = tuple(part.strip() for part in m.group(1).split(".")[1:])
        if blanked[m.end():].lstrip().startswith("("):  # value.ts.getDate(): the last name is a method
            path = path[:-1]
            if not path:
                continue
        line = text.count("\n", 0, m.start()) + 1
        column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
        out.append((path, line, column))
    return out


_PRODUCED = None  # a field the transforms made: not in the schema


class Shape:
    """The record value's top-level fields as the steps so far left them (see the module docstring)."""

    def __init__(self) -> None:
        #: current name -> the original field it holds, or None for a field the steps produced
        self.moved: dict[str, str | None] = {}
        self.dropped: set[str] = set()
        #: after a flatten nothing is traced any more
        self.opaque = False

    def origin(self, path: tuple[str, ...]) -> tuple[str, ...] | str | None:
        """The path in the decoded value that ``path`` (in the current value) reads; None when not
        traceable (produced, or after a flatten); the text ``"dropped"`` for a dropped field."""
        if self.opaque or not path:
            return None
        top = path[0]
        if top in self.moved:
            original = self.moved[top]
            return None if original is _PRODUCED else (original, *path[1:])
        if top in self.dropped:
            return "dropped"
        return path

    def apply(self, step: Any) -> None:
        """Move past ``step`` (a TransformStep)."""
        kind = step.kind
        if kind == "set":
            for name in step.set:
                self._produce(name)
        elif kind == "timestamp":
            self._produce(step.timestamp.into or step.timestamp.field)
        elif kind == "drop":
            for name in step.drop:
                self.moved.pop(name, None)
                self.dropped.add(name)
        elif kind == "rename":
            before = {old: self.moved.get(old, old if old not in self.dropped else _PRODUCED)
                      for old in step.rename}
            for old in step.rename:
                self.moved.pop(old, None)
                self.dropped.add(old)
            for old, new in step.rename.items():
                self.dropped.discard(new)
                self.moved[new] = before[old]
        elif kind == "flatten":
            self.opaque = True

    def _produce(self, name: str) -> None:
        self.dropped.discard(name)
        self.moved[name] = _PRODUCED


def transform_problems(steps: list[Any], where: str, holds: Callable[[tuple[str, ...]], bool],
                       what: str) -> list[str]:
    """``<where>[i].<expr path>: reads value.a.b (line L, column C), which <what> lacks`` for every
    expression reading a field the schema (``holds(path)``: can a record hold it) lacks or that an
    earlier step dropped."""
    problems = []
    shape = Shape()
    for index, step in enumerate(steps):
        for sub, text in step.expressions():
            for path, line, column in references(text):
                origin = shape.origin(path)
                shown = "value." + ".".join(path)
                if origin == "dropped":
                    problems.append(f"{where}[{index}].{sub}: reads {shown} (line {line}, column {column}), "
                                    "which an earlier step dropped")
                elif isinstance(origin, tuple) and not holds(origin):
                    problems.append(f"{where}[{index}].{sub}: reads {shown} (line {line}, column {column}), "
                                    f"a field {what} lacks")
        shape.apply(step)
    return problems


def column_origin(steps: list[Any], top: str) -> tuple[str, ...] | str | None:
    """Where a column reading ``$.<top>...`` of the transformed value reads in the decoded value:
    ``(name,)``, ``"dropped"``, or None when the steps produced it (or after a flatten)."""
    shape = Shape()
    for step in steps:
        shape.apply(step)
    return shape.origin((top,))

"""``sink.table`` as a template: which table a record goes to.

Syntax
------
Text with placeholders in braces; ``{{`` and ``}}`` stand for a literal brace.

=====================  ===============================================================================
placeholder            value
=====================  ===============================================================================
``{topic}``            the record's topic (a republished record's origin topic is the caller's choice)
``{NAME}``             the named group ``NAME`` of the ``topics`` pattern that matched the topic
                       (``^shop\\.(?P<schema>[^.]+)\\.(?P<table>.+)`` gives ``{schema}``, ``{table}``)
``{source.FIELD}``     field ``FIELD`` of a change event's ``source`` block (Debezium: ``{source.schema}``,
                       ``{source.table}``, ``{source.db}``, ...); one field, looked up by its whole name
``{header.NAME}``      the record header ``NAME`` (its first occurrence), its bytes decoded as UTF-8
=====================  ===============================================================================

A template is parsed once, when the config loads (:class:`TableTemplate`); a placeholder that is
none of the above -- an unknown group name, an empty name, ``{source.}``, a ``:spec`` or ``!r``
suffix, an unmatched brace -- raises :class:`~ingest.mirror.errors.TemplateError` naming the
position. ``{topic}`` is a reserved name: a pattern group called ``topic`` cannot be used (it would be
ambiguous), nor can one called ``source`` or ``header``.

Rendering
---------
:meth:`TableTemplate.render` runs per record and returns the *rendered* name, not yet an identifier:
:mod:`ingest.mirror.names` sanitises it. A part that cannot be had raises
:class:`~ingest.mirror.errors.Unroutable` with a reason:

- ``missing_group``: the group did not take part in the match, or the topic was matched by a pattern
  without that group (or is a literal ``topics`` name);
- ``no_source_block``: ``{source.*}`` for a record without a source block (not a change event);
- ``missing_source_field``: the field is absent or null;
- ``not_a_scalar``: the field is an object or an array;
- ``missing_header``: no header of that name, or one with a null value;
- ``header_not_utf8``: the header's bytes are not UTF-8.

Scalars render as text: strings as they are, booleans as ``true``/``false``, numbers as Python's
``str``. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.core.topics import TopicSelector, is_pattern
from ingest.mirror.errors import TemplateError, Unroutable
from ingest.types import Headers

__all__ = ["Part", "TableTemplate", "pattern_groups"]

_RESERVED_GROUPS = frozenset({"topic", "source", "header"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a parsed template: ``kind`` is ``text`` (``value`` is the literal text), ``topic``,
    ``group``, ``source`` or ``header`` (``value`` is the group, field or header name)."""

    kind: str
    value: str


class TableTemplate:
    """A parsed ``sink.table`` template (see the module docstring). Immutable and thread-safe.

    ``group_names``: the named groups the ``topics`` patterns define; a ``{NAME}`` placeholder must be
    one of them. Raises :class:`TemplateError` when ``text`` does not parse.
    """

    def __init__(self, text: str, group_names: Iterable[str] = ()) -> None:
        self.text = text
        self.group_names = frozenset(group_names)
        self.parts: tuple[Part, ...] = tuple(_parse(text, self.group_names))

    @classmethod
    def for_topics(cls, text: str, topics: Sequence[str]) -> TableTemplate:
        """The template for a pipeline reading ``topics`` (names and ``^`` patterns, as in the config):
        its groups are the named groups of the patterns. ``re.error`` for a pattern that does not compile."""
        names: set[str] = set()
        for entry in topics:
            if is_pattern(entry):
                names.update(re.compile(entry).groupindex)
        return cls(text, names)

    @property
    def is_constant(self) -> bool:
        """True when the template has no placeholder (every record goes to one table)."""
        return all(p.kind == "text" for p in self.parts)

    @property
    def uses_source(self) -> bool:
        """True when rendering needs a change event's source block."""
        return any(p.kind == "source" for p in self.parts)

    def render(self, topic: str, *, groups: Mapping[str, str | None] | None = None,
               source: Mapping[str, Any] | None = None, headers: Headers = ()) -> str:
        """The rendered table name for one record.

        ``groups``: the named groups of the pattern that matched ``topic`` (:func:`pattern_groups`);
        ``source``: the change event's source block, or None; ``headers``: the record's headers.
        Raises :class:`Unroutable` (see the module docstring for the reasons); never anything else.
        """
        out: list[str] = []
        for part in self.parts:
            kind = part.kind
            if kind == "text":
                out.append(part.value)
            elif kind == "topic":
                out.append(topic)
            elif kind == "group":
                value = (groups or {}).get(part.value)
                if value is None:
                    raise Unroutable("missing_group", f"topic {topic!r}: the topic pattern gave no group "
                                                      f"{part.value!r} for table template {self.text!r}")
                out.append(value)
            elif kind == "source":
                out.append(_source_value(source, part.value, topic, self.text))
            else:
                out.append(_header_value(headers, part.value, topic, self.text))
        return "".join(out)

    def __repr__(self) -> str:
        return f"TableTemplate({self.text!r})"


def pattern_groups(selector: TopicSelector, topic: str) -> dict[str, str | None]:
    """The named groups of the first of ``selector``'s patterns that matches ``topic`` (the order of the
    ``topics`` entries), or ``{}`` for a topic no pattern matches (a literal name)."""
    for pattern in selector.patterns:
        m = pattern.match(topic)
        if m is not None:
            return m.groupdict()
    return {}


def _parse(text: str, group_names: frozenset[str]) -> list[Part]:
    parts: list[Part] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "}":
            if i + 1 < n and text[i + 1] == "}":
                literal.append("}")
                i += 2
                continue
            raise TemplateError(text, i, "a lone '}' (write '}}' for a literal brace)")
        if ch != "{":
            literal.append(ch)
            i += 1
            continue
        if i + 1 < n and text[i + 1] == "{":
            literal.append("{")
            i += 2
            continue
        end = text.find("}", i + 1)
        nested = text.find("{", i + 1)
        if end < 0:
            raise TemplateError(text, i, "a '{' without its '}'")
        if 0 <= nested < end:
            raise TemplateError(text, nested, "a '{' inside a placeholder")
        if literal:
            parts.append(Part("text", "".join(literal)))
            literal = []
        parts.append(_placeholder(text, i, text[i + 1:end], group_names))
        i = end + 1
    if literal:
        parts.append(Part("text", "".join(literal)))
    if not parts:
        raise TemplateError(text, 0, "the template is empty")
    return parts


def _placeholder(text: str, at: int, name: str, group_names: frozenset[str]) -> Part:
    where = at + 1
    if name == "topic":
        return Part("topic", "")
    for prefix, kind, what in (("source.", "source", "a source field"), ("header.", "header", "a header name")):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if not rest:
                raise TemplateError(text, where, f"{{{name}}} needs {what} after {prefix!r}")
            return Part(kind, rest)
    if not name:
        raise TemplateError(text, at, "an empty placeholder '{}'")
    if not _IDENT.match(name):
        bad = next((k for k, c in enumerate(name) if c in ":!.[ "), 0)
        raise TemplateError(text, where + bad, f"{{{name}}} is not a placeholder: use {{topic}}, a pattern "
                                               "group {NAME}, {source.FIELD} or {header.NAME} (no format "
                                               "specs or conversions)")
    if name in _RESERVED_GROUPS:
        raise TemplateError(text, where, f"{{{name}}} needs a name: {{{name}.NAME}}")
    if name not in group_names:
        known = ", ".join(sorted(group_names)) or "none: no topics pattern has named groups"
        raise TemplateError(text, where, f"{{{name}}} is not a named group of the topics patterns (they have: "
                                         f"{known})")
    return Part("group", name)


def _source_value(source: Mapping[str, Any] | None, field: str, topic: str, template: str) -> str:
    if source is None:
        raise Unroutable("no_source_block", f"topic {topic!r}: table template {template!r} reads "
                                            f"{{source.{field}}} but the record has no source block "
                                            "(not a change event)")
    value = source.get(field)
    if value is None:
        raise Unroutable("missing_source_field", f"topic {topic!r}: the source block has no {field!r} "
                                                 f"for table template {template!r}")
    return _scalar_text(value, f"source field {field!r}", topic)


def _header_value(headers: Headers, name: str, topic: str, template: str) -> str:
    for hname, hvalue in headers:
        if hname == name:
            if hvalue is None:
                break
            try:
                return bytes(hvalue).decode("utf-8")
            except UnicodeDecodeError:
                raise Unroutable("header_not_utf8", f"topic {topic!r}: header {name!r} is not UTF-8 "
                                                    f"(table template {template!r})") from None
    raise Unroutable("missing_header", f"topic {topic!r}: no header {name!r} (or a null one) for table "
                                       f"template {template!r}")


def _scalar_text(value: Any, what: str, topic: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise Unroutable("not_a_scalar", f"topic {topic!r}: {what} is {type(value).__name__}, not a scalar")

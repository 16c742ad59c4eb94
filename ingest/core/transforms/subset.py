"""The part of CEL the columnar tier evaluates on whole batches: a parser into a small tree.

:func:`parse` reads an expression the CEL binding has already compiled (:mod:`.cel`) and returns its
tree when every part of it is in the subset, or raises :class:`Unsupported` naming the first part
that is not. The subset (issue #37 item 8):

- ``value.NAME``: a top-level field of the record value (``value.a.b``, ``value['a']`` and a bare
  ``value`` are not in it); ``has(value.NAME)``;
- the metadata ``topic``, ``partition``, ``offset`` and ``timestamp`` (not ``key``, ``headers``);
- literals: ``true``, ``false``, ``null``, decimal integers up to 2**63 - 1, decimal doubles
  (``1.5``, ``2e3``; not ``.5``), strings in single or double quotes whose only escapes are
  ``\\\\ \\' \\" \\n \\r \\t`` (no raw, bytes or triple-quoted strings, no unsigned integers);
- ``! - * / % + == != < <= > >= && || ?:`` and parentheses, with CEL's precedence and its
  parser's rule that a run of ``!`` or ``-`` of even length is no operator at all (``!!x`` is
  ``x``);
- ``int()``, ``double()``, ``string()``, ``bool()`` and ``dyn()`` of one argument.

The tree is tuples: ``("const", v)`` (v a Python int, float, str, bool or None), ``("field",
name)``, ``("has", name)``, ``("meta", name)``, ``("not", x)``, ``("neg", x)``, ``("and", a, b)``,
``("or", a, b)``, ``("cond", c, a, b)``, ``("bin", op, a, b)``, ``("call", fn, x)``. Pure: no
I/O, no pyarrow. The evaluation is :mod:`.columnar`'s.
"""

from __future__ import annotations

import re
from typing import Any

Node = tuple[Any, ...]

#: the metadata variables the subset reads (each a column of the batch's records)
METADATA = ("topic", "partition", "offset", "timestamp")
CASTS = ("int", "double", "string", "bool", "dyn")
INT64_MAX = 2**63 - 1
_RESERVED = frozenset("true false null in as break const continue else for function if import let loop package "
                      "namespace return var void while".split())
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t"}

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\n\f]+|//[^\n]*)
  | (?P<double>[0-9]+\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)
  | (?P<int>[0-9]+(?![0-9A-Za-z_.]))
  | (?P<string>'(?:[^'\\\n\r]|\\.)*'|"(?:[^"\\\n\r]|\\.)*")
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*(?!['"]))
  | (?P<op>&&|\|\||==|!=|<=|>=|[<>+\-*/%!?:().,])
""", re.VERBOSE)


class Unsupported(ValueError):
    """An expression (or a part of it) outside the subset; the message says which part."""


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # the parser names it when it gets there (what comes before may be named first)
            out.append(("bad", f"{text[pos:pos + 12]!r} (at column {pos + 1})"))
            break
        pos = m.end()
        kind = m.lastgroup
        token = m.group()
        if kind == "space":
            continue
        if kind == "int":
            value = int(token)
            if token != "0" and token.startswith("0") or value > INT64_MAX:
                raise Unsupported(f"the integer literal {token}")
            out.append(("const", value))
        elif kind == "double":
            value = float(token)
            if value in (float("inf"), float("-inf")):
                raise Unsupported(f"the double literal {token}")
            out.append(("const", value))
        elif kind == "string":
            out.append(("const", _unquote(token)))
        elif kind == "ident":
            if token in ("true", "false", "null"):
                out.append(("const", {"true": True, "false": False, "null": None}[token]))
            else:
                out.append(("ident", token))
        else:
            out.append(("op", token))
    out.append(("end", None))
    return out


def _unquote(token: str) -> str:
    body, out, i = token[1:-1], [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            nxt = body[i + 1]
            if nxt not in _ESCAPES:
                raise Unsupported(f"the escape \\{nxt} in a string literal")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, Any]:
        return self.tokens[self.pos]

    def take(self) -> tuple[str, Any]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def accept(self, op: str) -> bool:
        if self.tokens[self.pos] == ("op", op):
            self.pos += 1
            return True
        return False

    def expect(self, op: str) -> None:
        if not self.accept(op):
            raise Unsupported(f"{self._show()} where {op!r} was expected")

    def _show(self) -> str:
        kind, value = self.peek()
        return "the end" if kind == "end" else value if kind == "bad" else repr(value)

    # Expr = ConditionalOr ["?" ConditionalOr ":" Expr]
    def expr(self) -> Node:
        c = self.binary(0)
        if self.accept("?"):
            a = self.binary(0)
            self.expect(":")
            return ("cond", c, a, self.expr())
        return c

    _LEVELS: tuple[tuple[str, ...], ...] = (("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">="), ("+", "-"),
                                           ("*", "/", "%"))

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        ops = self._LEVELS[level]
        left = self.binary(level + 1)
        while True:
            kind, op = self.peek()
            if kind == "ident" and op == "in" and level == 2:
                raise Unsupported("the 'in' operator")
            if kind != "op" or op not in ops:
                return left
            self.take()
            right = self.binary(level + 1)
            if op == "||":
                left = ("or", left, right)
            elif op == "&&":
                left = ("and", left, right)
            else:
                left = ("bin", op, left, right)

    # Unary = Member | "!" {"!"} Member | "-" {"-"} Member  (an even run is dropped, as CEL's parser does)
    def unary(self) -> Node:
        for op, name in (("!", "not"), ("-", "neg")):
            count = 0
            while self.accept(op):
                count += 1
            if count:
                operand = self.member()
                return (name, operand) if count % 2 else operand
        return self.member()

    def member(self) -> Node:
        node = self.primary()
        kind, op = self.peek()
        if kind == "op" and op in (".", "("):
            raise Unsupported("a field of a field or a method call" if op == "." else "a call of a call")
        if kind == "op" and op == "[":  # pragma: no cover - '[' is not a token of the subset
            raise Unsupported("an index")
        return node

    def primary(self) -> Node:
        kind, value = self.take()
        if kind == "const":
            return ("const", value)
        if kind == "op" and value == "(":
            node = self.expr()
            self.expect(")")
            return node
        if kind == "ident":
            if value == "value":
                if not self.accept("."):
                    raise Unsupported("'value' other than as value.FIELD")
                return ("field", self._selector())
            if value in METADATA and self.peek() != ("op", "("):
                return ("meta", value)
            if value == "has":
                self.expect("(")
                if self.take() != ("ident", "value"):
                    raise Unsupported("has() of something but value.FIELD")
                self.expect(".")
                name = self._selector()
                self.expect(")")
                return ("has", name)
            if value in CASTS:
                self.expect("(")
                arg = self.expr()
                if not self.accept(")"):
                    raise Unsupported(f"{value}() with more than one argument")
                return ("call", value, arg)
            if self.peek() == ("op", "("):
                raise Unsupported(f"the function {value}()")
            raise Unsupported(f"the variable {value!r}")
        if kind == "end":
            raise Unsupported("an incomplete expression")
        if kind == "bad":
            raise Unsupported(value)
        raise Unsupported(f"{value!r}")

    def _selector(self) -> str:
        kind, name = self.take()
        if kind != "ident" or name in _RESERVED:
            raise Unsupported("value.FIELD with a field that is not a plain name")
        return name


def parse(text: str) -> Node:
    """The tree of ``text`` (a CEL expression that compiles) when it is in the subset; raises
    :class:`Unsupported` naming the first part that is not. Pure."""
    parser = _Parser(text)
    node = parser.expr()
    if parser.peek()[0] != "end":
        raise Unsupported(f"{parser._show()} after a complete expression")
    return node


def fields_read(node: Node) -> set[str]:
    """The top-level fields of the value a tree reads or tests with has()."""
    tag = node[0]
    if tag in ("field", "has"):
        return {node[1]}
    out: set[str] = set()
    for child in node[1:]:
        if type(child) is tuple:
            out |= fields_read(child)
    return out

"""The column type systems of the sinks' dialects, parsed: PostgreSQL names and ClickHouse names.

Pure logic shared by the settings (validation), the mapper (coercers by type)
and the sinks (DDL, COPY and Arrow types). A new sink either declares its
columns in one of these dialects or brings its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: PostgreSQL column types the mapper can coerce to, by base name. A type may
#: carry a modifier, e.g. ``numeric(12,2)`` or ``varchar(64)``; the database
#: enforces the modifier and rejects violating rows (they become poison rows).
PG_TYPES: frozenset[str] = frozenset(
    {
        "smallint", "integer", "bigint", "numeric", "real", "double precision",
        "text", "varchar", "boolean", "timestamptz", "timestamp", "date", "time", "interval",
        "jsonb", "json", "uuid", "bytea",
    }
)
PG_TYPE_ALIASES: dict[str, str] = {
    "int": "integer", "int4": "integer", "int8": "bigint", "int2": "smallint",
    "float8": "double precision", "float4": "real", "decimal": "numeric",
    "bool": "boolean", "character varying": "varchar",
    "timestamp with time zone": "timestamptz", "timestamp without time zone": "timestamp",
    "time without time zone": "time",
}
_TYPE_RE = re.compile(r"^\s*([a-z][a-z0-9 ]*?)\s*(\(\s*\d+\s*(,\s*\d+\s*)?\))?\s*$")

_SECRET_CLIENT_KEYS = ("password", "secret", "sasl.oauthbearer.config", "ssl.key.pem")


def pg_base_type(type_name: str) -> tuple[str, str]:
    """Return ``(base, full)`` for a PostgreSQL column type, e.g. ``('numeric', 'numeric(12,2)')``.

    Raises ValueError for a type the mapper does not support.
    """
    match = _TYPE_RE.match(type_name.lower())
    if not match:
        raise ValueError(f"unsupported column type {type_name!r}")
    base = PG_TYPE_ALIASES.get(match.group(1), match.group(1))
    if base not in PG_TYPES:
        raise ValueError(
            f"unsupported column type {type_name!r}; supported: {', '.join(sorted(PG_TYPES))}"
        )
    modifier = (match.group(2) or "").replace(" ", "")
    if modifier and base not in ("numeric", "varchar", "timestamptz", "timestamp"):
        raise ValueError(f"column type {base!r} takes no modifier {modifier!r}")
    return base, base + modifier


#: ClickHouse integer types and their ranges.
CH_INT_RANGES: dict[str, tuple[int, int]] = {
    "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1), "UInt32": (0, 2**32 - 1), "UInt64": (0, 2**64 - 1),
    "Int8": (-(2**7), 2**7 - 1), "Int16": (-(2**15), 2**15 - 1),
    "Int32": (-(2**31), 2**31 - 1), "Int64": (-(2**63), 2**63 - 1),
}
#: ClickHouse types without parameters, by name -> kind. ``JSON`` is JSON stored as ``String``.
_CH_SIMPLE: dict[str, str] = {
    **{name: "int" for name in CH_INT_RANGES},
    "Float32": "float", "Float64": "float", "String": "string", "Bool": "bool", "Date": "date",
    "UUID": "uuid", "JSON": "json",
}
CH_SUPPORTED = (
    "UInt8/16/32/64, Int8/16/32/64, Float32, Float64, Decimal(P,S), String, LowCardinality(String), Bool, "
    "Date, DateTime64(3), UUID, JSON (stored as String), Nullable(T), Array(T)"
)
_CH_TOKEN = re.compile(r"\s*([A-Za-z][A-Za-z0-9]*|\d+|'[^']*'|[(),])")


@dataclass(frozen=True, slots=True)
class ChType:
    """A parsed ClickHouse column type.

    ``name`` is the canonical spelling in the config (``Nullable(JSON)``), ``ddl``
    the ClickHouse type it creates and inserts as (``Nullable(String)``).
    ``kind``: int, float, decimal, string, bool, date, datetime64, uuid, json,
    nullable, array or lowcardinality; ``inner`` is set for the last three.
    """

    kind: str
    name: str
    ddl: str
    inner: ChType | None = None
    precision: int = 0
    scale: int = 0

    @property
    def nullable(self) -> bool:
        return self.kind == "nullable" or (self.kind == "lowcardinality" and self.inner is not None
                                           and self.inner.nullable)


def ch_type(type_name: str) -> ChType:
    """Parse a ClickHouse column type the mapper supports; ValueError (naming the type) otherwise.

    Names are case-sensitive, as in ClickHouse. Supported: see :data:`CH_SUPPORTED`.
    """
    tokens = _CH_TOKEN.findall(type_name)
    parser = _ChTypeParser(type_name, tokens)
    if "".join(tokens) != "".join(type_name.split()) or not tokens:
        raise parser.bad()
    result = parser.parse()
    if parser.pos != len(tokens):
        raise parser.bad()
    return result


def ch_version_refusal(type_name: str) -> str | None:
    """Why a ReplacingMergeTree cannot be versioned by a column of ClickHouse type ``type_name`` (a
    reason to follow the type's name), or None when it can: an integer (``UInt8``-``64`` or
    ``Int8``-``64``), ``Date`` or ``DateTime64`` -- never ``Nullable``. What the servers take: ClickHouse
    18.16 and the chDB engine (26.9) both take signed integers; ``DateTime64`` needs a server from 20.x on."""
    try:
        t = ch_type(type_name)
    except ValueError as exc:
        return str(exc)
    if t.nullable:
        return "ReplacingMergeTree refuses a Nullable version"
    if t.kind not in ("int", "date", "datetime64"):
        return "ReplacingMergeTree takes an integer (UInt8-64, Int8-64), Date or DateTime64 version"
    return None


class _ChTypeParser:
    """A recursive-descent parser over the tokens of one ClickHouse type name."""

    def __init__(self, type_name: str, tokens: list[str]) -> None:
        self.type_name = type_name
        self.tokens = tokens
        self.pos = 0

    def bad(self, why: str = "") -> ValueError:
        return ValueError(f"unsupported column type {self.type_name!r}{': ' + why if why else ''}; "
                          f"supported: {CH_SUPPORTED}")

    def take(self, expected: str | None = None) -> str:
        if self.pos >= len(self.tokens):
            raise self.bad()
        tok = self.tokens[self.pos]
        if expected is not None and tok != expected:
            raise self.bad()
        self.pos += 1
        return tok

    def next_is(self, tok: str) -> bool:
        return self.pos < len(self.tokens) and self.tokens[self.pos] == tok

    def number(self, lo: int, hi: int, what: str) -> int:
        tok = self.take()
        if not tok.isdigit() or not lo <= int(tok) <= hi:
            raise self.bad(f"{what} must be {lo}..{hi}")
        return int(tok)

    def parse(self) -> ChType:
        name = self.take()
        if name in _CH_SIMPLE:
            kind = _CH_SIMPLE[name]
            return ChType(kind, name, "String" if kind == "json" else name)
        if name == "Decimal":
            return self.decimal()
        if name == "DateTime64":
            return self.datetime64()
        if name in ("Nullable", "Array", "LowCardinality"):
            self.take("(")
            inner = self.parse()
            self.take(")")
            return self.wrapper(name, inner)
        raise self.bad()

    def decimal(self) -> ChType:
        self.take("(")
        p = self.number(1, 76, "Decimal precision")
        s = 0
        if self.next_is(","):
            self.take(",")
            s = self.number(0, p, "Decimal scale")
        self.take(")")
        return ChType("decimal", f"Decimal({p}, {s})", f"Decimal({p}, {s})", precision=p, scale=s)

    def datetime64(self) -> ChType:
        self.take("(")
        p = self.number(0, 9, "DateTime64 precision")
        tz = ""
        if self.next_is(","):
            self.take(",")
            tz = self.take()
            if not (tz.startswith("'") and len(tz) > 2):
                raise self.bad("DateTime64 time zone must be a quoted name")
            tz = f", {tz}"
        self.take(")")
        return ChType("datetime64", f"DateTime64({p}{tz})", f"DateTime64({p}{tz})", precision=p)

    def wrapper(self, name: str, inner: ChType) -> ChType:
        if name == "Nullable":
            if inner.kind in ("nullable", "array", "lowcardinality"):
                raise self.bad(f"Nullable cannot contain {inner.name}")
            return ChType("nullable", f"Nullable({inner.name})", f"Nullable({inner.ddl})", inner)
        if name == "Array":
            if inner.kind == "lowcardinality":
                raise self.bad("Array(LowCardinality(...)) is not supported")
            return ChType("array", f"Array({inner.name})", f"Array({inner.ddl})", inner)
        base = inner.inner if inner.kind == "nullable" else inner
        if base is None or base.kind != "string":
            raise self.bad("LowCardinality supports String and Nullable(String) only")
        return ChType("lowcardinality", f"LowCardinality({inner.name})", f"LowCardinality({inner.ddl})", inner)


def ch_quote_ident(name: str) -> str:
    """A ClickHouse identifier in backquotes (backslash and backquote escaped)."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"

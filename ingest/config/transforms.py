"""The settings of a pipeline's ``transforms:`` list: what each step is, checked for shape only.

Each entry of ``transforms`` is one step, a mapping with exactly one of the step keys
(``filter``, ``set``, ``drop``, ``rename``, ``flatten``, ``timestamp``, ``explode``) plus the optional ``when``
(a CEL predicate: the step applies only to the records where it holds), ``name`` (the step's
label in metrics and DLQ messages; default ``<index>-<kind>``) and ``replay_stable`` (``false``: its
expressions may read ``ingest_time``, which a replay does not reproduce).

Expressions are checked here for being non-empty text only. They are compiled by
:mod:`ingest.core.transforms.compile` -- once, when the configuration is loaded
(:func:`ingest.config.load.load_settings`, so ``ingest check`` and start-up refuse a step that does
not compile, naming ``pipelines[0].transforms[2].set.amount_cents`` and the position), and the
compiled programs are cached for the process.
"""

from __future__ import annotations

import re
import zoneinfo
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ingest.config.base import ColumnSpec, Frozen, check_identifier

#: The step kinds, in the order the README lists them.
STEP_KINDS = ("filter", "set", "drop", "rename", "flatten", "timestamp", "explode")
#: A field a step writes or names: a top-level key of the record value (no dots: nested fields are
#: reached by ``flatten`` first, or read by CEL expressions).
_FIELD_RE = re.compile(r"^[^.\s][^.]*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$")


def _field(name: str) -> str:
    if not _FIELD_RE.match(name) or len(name) > 256:
        raise ValueError(f"invalid field name {name!r}: a top-level key of the record value (no dots)")
    return name


class FlattenSettings(Frozen):
    """``flatten``: nested objects become ``parent<separator>child`` top-level fields."""

    #: What joins a parent's name to its child's.
    separator: str = Field(default="_", min_length=1, max_length=8)
    #: How many levels are flattened (1: only the top-level objects' own fields); unset: all.
    max_depth: int | None = Field(default=None, ge=1, le=64)
    #: Only these top-level fields are flattened; unset: every object-valued field.
    fields: list[str] | None = None

    @field_validator("fields")
    @classmethod
    def _fields(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [_field(v) for v in value]


class TimestampSettings(Frozen):
    """``timestamp``: parse ``field`` (by ``format``) into an ISO 8601 text with an offset, in ``into``."""

    field: str
    #: ``epoch_s``, ``epoch_ms``, ``epoch_us``, ``epoch_ns`` (numbers or numeric strings), ``iso8601``,
    #: or ``strptime`` (with ``pattern``).
    format: Literal["epoch_s", "epoch_ms", "epoch_us", "epoch_ns", "iso8601", "strptime"]
    #: The ``datetime.strptime`` pattern of ``format: strptime``.
    pattern: str | None = None
    #: The IANA time zone of naive values (ISO 8601 or strptime text without an offset).
    timezone: str = "UTC"
    #: The field that gets the result; default: ``field`` itself.
    into: str | None = None

    @field_validator("field", "into")
    @classmethod
    def _fields(cls, value: str | None) -> str | None:
        return None if value is None else _field(value)

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (an IANA name such as UTC or Europe/Rome)") from None
        return value

    @model_validator(mode="after")
    def _pattern(self) -> TimestampSettings:
        if (self.format == "strptime") != (self.pattern is not None):
            raise ValueError("pattern is required with format strptime, and only there")
        return self


class ExplodeSettings(Frozen):
    """``explode``: each element of the array at ``path`` becomes a row of the child table ``table``,
    written in the same transaction as the record's own row (see ``ingest.sinks.postgres.children``).

    A child row's columns read the element (``$.FIELD``; an element that is not an object is seen as
    ``{"value": element}``) and the record's metadata; the ``parent`` columns get CEL expressions over
    the record value as this step sees it (the link to the parent), ``index_as`` the element's position.
    """

    #: The array: a top-level field, or a dotted path into nested objects (``order.items``).
    path: str = Field(min_length=1, max_length=256)
    #: The child table (in the sink's schema); quoted as an identifier.
    table: str
    #: The child table's columns, with their types, as ``sink.columns`` (a ``parent`` or ``index_as``
    #: column takes its value from there: give it no ``source``).
    columns: dict[str, ColumnSpec] = Field(min_length=1)
    #: The child table's key: one row per key (a record whose elements repeat a key is poison).
    conflict_key: list[str] = Field(min_length=1)
    #: ``column: CEL expression`` over the parent: the columns that tie a child row to its parent.
    parent: dict[str, str] = Field(min_length=1)
    #: A column that gets the element's position in the array (``index_start`` for the first).
    index_as: str | None = None
    index_start: int = Field(default=0, ge=0, le=1)
    #: The parent's children are replaced: children of a written parent that are no longer in its array
    #: are deleted in the same transaction, so the child table always equals the latest parent.
    replace: bool = True

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        return check_identifier(value)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if any(not _FIELD_RE.match(part) for part in value.split(".")) or value.endswith("."):
            raise ValueError(f"invalid path {value!r}: field names joined by dots (order.items)")
        return value

    @field_validator("parent")
    @classmethod
    def _parent(cls, value: dict[str, str]) -> dict[str, str]:
        for column, text in value.items():
            if not text.strip():
                raise ValueError(f"parent.{column}: empty expression")
        return value

    @model_validator(mode="after")
    def _columns(self) -> ExplodeSettings:
        names = self.columns
        for label, wanted in (("conflict_key", self.conflict_key), ("parent", list(self.parent)),
                              ("index_as", [self.index_as] if self.index_as else [])):
            missing = [c for c in wanted if c not in names]
            if missing:
                raise ValueError(f"{label} {missing} not among columns {list(names)}")
        if len(set(self.conflict_key)) != len(self.conflict_key):
            raise ValueError("conflict_key lists a column twice")
        if self.index_as is not None and self.index_as in self.parent:
            raise ValueError(f"index_as {self.index_as!r} is also a parent column")
        for name in [*self.parent, *([self.index_as] if self.index_as else [])]:
            source = names[name].source
            if source is not None and source != f"$.{name}":
                raise ValueError(f"column {name!r} takes its value from parent/index_as: give it no source")
        for name in names:
            if name.startswith("_ingest_"):
                raise ValueError(f"column {name!r}: names starting with '_ingest_' are reserved for ingest")
        return self


class TransformStep(Frozen):
    """One step of ``transforms:`` (see the module docstring): exactly one step key, plus ``when``/``name``."""

    #: CEL predicate: records for which it is false are not written (counted, offsets committed as done).
    filter: str | None = Field(default=None, min_length=1)
    #: ``field: CEL expression``: computed or constant fields, every expression reading the value as it
    #: was before this step.
    set: dict[str, str] | None = Field(default=None, min_length=1)
    #: Top-level fields removed (a missing one is no error).
    drop: list[str] | None = Field(default=None, min_length=1)
    #: ``old: new`` top-level field names (a missing old field is no error; an existing new one is).
    rename: dict[str, str] | None = Field(default=None, min_length=1)
    flatten: FlattenSettings | None = None
    timestamp: TimestampSettings | None = None
    explode: ExplodeSettings | None = None
    #: CEL predicate: the step applies only where it holds (elsewhere the record passes unchanged).
    when: str | None = Field(default=None, min_length=1)
    #: The step's label (metrics, DLQ messages, the run summary); default ``<index>-<kind>``.
    name: str | None = None
    #: ``false``: the step's expressions may read ``ingest_time`` (when this process transformed the
    #: record), so a replayed record may get another result. Elsewhere reading it is refused at load.
    replay_stable: bool = True

    @property
    def kind(self) -> str:
        """Which step this is: one of :data:`STEP_KINDS`."""
        return next(k for k in STEP_KINDS if getattr(self, k) is not None)

    @model_validator(mode="before")
    @classmethod
    def _bare_flatten(cls, data: object) -> object:
        """``flatten: {}`` and ``flatten: true`` both mean the defaults."""
        if isinstance(data, dict) and data.get("flatten") in ({}, True):
            return {**data, "flatten": {}}
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> TransformStep:
        present = [k for k in STEP_KINDS if getattr(self, k) is not None]
        if len(present) != 1:
            raise ValueError(f"a step has exactly one of {', '.join(STEP_KINDS)}; got "
                             f"{', '.join(present) if present else 'none'}")
        return self

    @field_validator("set", "rename")
    @classmethod
    def _names(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            for k, v in value.items():
                _field(k)
                if not v.strip():
                    raise ValueError(f"{k}: empty value")
        return value

    @field_validator("rename")
    @classmethod
    def _targets(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            for v in value.values():
                _field(v)
            if len(set(value.values())) != len(value):
                raise ValueError("two fields renamed to one name")
        return value

    @field_validator("drop")
    @classmethod
    def _drop(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [_field(v) for v in value]

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME_RE.match(value):
            raise ValueError("a step name is [A-Za-z0-9][A-Za-z0-9_.:-]*, at most 63 characters")
        return value

    def label(self, index: int) -> str:
        """The step's label: ``name``, else ``<index>-<kind>``."""
        return self.name or f"{index}-{self.kind}"

    def expressions(self) -> list[tuple[str, str]]:
        """``(path below the step, CEL text)`` of every expression: ``when``, ``filter``, ``set.FIELD``,
    ``explode.parent.COLUMN``."""
        out = [("when", self.when)] if self.when is not None else []
        if self.filter is not None:
            out.append(("filter", self.filter))
        if self.set is not None:
            out += [(f"set.{field}", text) for field, text in self.set.items()]
        if self.explode is not None:
            out += [(f"explode.parent.{column}", text) for column, text in self.explode.parent.items()]
        return out

"""The settings of a pipeline's ``transforms:`` list: what each step is, checked for shape only.

Each entry of ``transforms`` is one step, a mapping with exactly one of the step keys
(``filter``, ``set``, ``drop``, ``rename``, ``flatten``, ``timestamp``) plus the optional ``when``
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

from ingest.config.base import Frozen

#: The step kinds, in the order the README lists them.
STEP_KINDS = ("filter", "set", "drop", "rename", "flatten", "timestamp")
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
        """``(path below the step, CEL text)`` of every expression: ``when``, ``filter``, ``set.FIELD``."""
        out = [("when", self.when)] if self.when is not None else []
        if self.filter is not None:
            out.append(("filter", self.filter))
        if self.set is not None:
            out += [(f"set.{field}", text) for field, text in self.set.items()]
        return out

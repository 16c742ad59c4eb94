"""Settings of change data capture: envelopes, tombstones and how deletes are written (``ingest.cdc``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ingest.config.base import Frozen, check_identifier


class DeleteSettings(Frozen):
    """How a delete reaches the table (pipelines with ``envelope: debezium`` or ``tombstones: delete``).

    ``hard`` removes the row; ``soft`` keeps it and sets ``soft_column`` (``timestamptz``: the time of
    the delete, ``boolean``: true); an upsert of the key clears it again. Either way a PostgreSQL table
    keeps each deleted key's version (or source position) in a tombstone table, so a stale record older
    than the delete cannot bring the row back, for ``tombstone_retention_s`` (0: forever).
    ClickHouse deletes are rows with ``_ingest_deleted = 1`` in a ``ReplacingMergeTree(version,
    _ingest_deleted)`` table (hard only): ``FINAL`` hides them.
    """

    mode: Literal["hard", "soft"] = "hard"
    soft_column: str = "deleted_at"
    soft_column_type: Literal["timestamptz", "boolean"] = "timestamptz"
    #: PostgreSQL: the tombstone table's name (default ``<table>_ingest_deleted``).
    tombstone_table: str | None = None
    #: How long a PostgreSQL tombstone guards its key against stale records (default 7 days).
    tombstone_retention_s: int = Field(default=7 * 24 * 3600, ge=0)

    @field_validator("soft_column", "tombstone_table")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        return None if value is None else check_identifier(value)

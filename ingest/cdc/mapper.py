"""Records → rows for pipelines whose records can delete (``envelope: debezium``, ``tombstones: delete``).

:class:`ChangeMapper` has the mapper's contract (``map(record) -> (row, ordering_key)``, raising
:class:`~ingest.errors.InvalidRecord` for poison) and two more outcomes:

- a :class:`~ingest.types.DeleteRow` for a record that deletes its key: a Debezium delete event
  (op ``d``: the key read from the ``before`` image, or from the record key when the source table
  sends no before image), or a tombstone (``tombstones: delete``: the key read from the record key);
- :class:`~ingest.errors.NoChange` for a record handled without a row: a truncate with
  ``truncate: ignore``, and a Debezium tombstone when the version column comes from the event
  (the delete event just before it carried the version and did the delete; the tombstone, which
  carries none, cannot be ordered against the key's other records and adds nothing).

A delete row carries the key columns, the version column and the sink's hidden ``_ingest_*``
columns (where the record was read: the order guard of tables without a version); every other
position holds the sink's filler. Upserts (ops ``c``, ``r``, ``u``) map the ``after`` image with
the pipeline's columns: ``$`` paths read the row image, ``@source.PATH`` reads the event's
``source`` block (e.g. ``@source.lsn`` as the version), metadata sources read the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ingest.cdc.debezium import SchemaParts, unwrap, unwrap_key
from ingest.config import PipelineSettings
from ingest.core.mapping import Mapper
from ingest.core.transforms import Transformer, compile_transforms
from ingest.errors import IngestError, InvalidRecord, NoChange
from ingest.formats.base import Decoder
from ingest.formats.json import JsonDecoder, decode_error
from ingest.types import DeleteRow, FamilyRow, Record

__all__ = ["ChangeMapper", "ChildMapper", "TransformingMapper", "mapper_for"]

#: Where a row image carries the event's ``source`` block for ``@source.PATH`` columns.
_SOURCE_KEY = "@source"
_UPSERT_OPS = frozenset(("c", "r", "u"))
#: Hidden columns a sink adds to its rows (the PostgreSQL order guard's source columns).
_HIDDEN_PREFIX = "_ingest_"


def mapper_for(settings: PipelineSettings, *, decoder: Decoder | None = None,
               key_decoder: Decoder | None = None) -> Any:
    """The mapper of ``settings`` (:func:`_mapper_for`), wrapped in a
    :class:`~ingest.mirror.router.RoutingMapper` when ``sink.table`` is a template; with ``columns: auto``
    an :class:`~ingest.mirror.auto.AutoMapper`, which routes itself."""
    if not settings.routes_tables:
        return _mapper_for(settings, decoder=decoder, key_decoder=key_decoder)
    from ingest.mirror.names import Reserved
    from ingest.mirror.router import RoutingMapper, TableRouter

    tombstones = getattr(settings.deletes, "tombstone_table", None) if settings.has_deletes else None
    router = TableRouter(settings.table_template, settings.topic_selector, settings.sink.kind,
                         reserved=Reserved(settings.dlq.table, frozenset([tombstones] if tombstones else [])),
                         deletes=settings.has_deletes, database=getattr(settings.sink, "database", "default"))
    if settings.auto_columns:
        return _auto_mapper(settings, decoder, key_decoder, router)
    decode = (decoder or JsonDecoder()).decode
    return RoutingMapper(_mapper_for(settings, decoder=decoder, key_decoder=key_decoder), router, decode)


def _auto_mapper(settings: PipelineSettings, decoder: Decoder | None, key_decoder: Decoder | None,
                 router: Any) -> Any:
    """The :class:`~ingest.mirror.auto.AutoMapper` of a ``columns: auto`` pipeline: values coerced by the
    row mapper's coercer of each column type."""
    from ingest.config.base import ColumnSpec
    from ingest.core.mapping.mapper import column_coercer
    from ingest.mirror.auto import AutoMapper

    dialect = settings.sink.kind

    def coercer(type_text: str, nullable: bool) -> tuple[Any, bool]:
        if dialect == "clickhouse":
            return _ch_auto_coercer(type_text, nullable)
        return column_coercer(ColumnSpec(type=type_text, required=not nullable), dialect)

    soft = settings.deletes.soft_column if settings.has_deletes and settings.deletes.mode == "soft" else None
    auto_version = getattr(settings.sink, "version", None)  # the sink's version: (PostgreSQL, ClickHouse)
    reserved = _reserved_columns(dialect, getattr(auto_version, "column", None))
    version = None
    if auto_version is not None:  # one column's mapper: "@source.PATH" reads the block map() passes
        source = auto_version.source
        version = Mapper({"version": ColumnSpec(type=auto_version.type, required=True,
                                                source="$." + source if source.startswith("@source.") else source)},
                         None, dialect=dialect)
    return AutoMapper(dialect=dialect, envelope=settings.envelope, fmt=settings.format, decoder=decoder,
                      key_decoder=key_decoder, coercer=coercer, tombstones=settings.effective_tombstones,
                      truncate=settings.truncate, reserved_columns=reserved, soft_column=soft, version=version,
                      router=router, overrides=list(getattr(settings.sink, "tables", {}).items()),
                      sourced_mapper=lambda specs: Mapper(
                          {name: ColumnSpec(type=type_text, source=source) for name, (type_text, source) in specs.items()},
                          None, dialect=dialect, key_decoder=key_decoder))


def _reserved_columns(dialect: str, version: str | None) -> tuple[str, ...]:
    """Field names a ``columns: auto`` table cannot take as columns (besides its soft-delete column): the
    sink's ``version`` column and, in ClickHouse, the hidden version column (``_version``: a field of that
    name would version the table)."""
    names = (version,) if version else ()
    if dialect == "clickhouse":
        from ingest.sinks.clickhouse.settings import CH_DEFAULT_VERSION_COLUMN

        names = (*names, CH_DEFAULT_VERSION_COLUMN)
    return names


def _ch_auto_coercer(type_text: str, nullable: bool) -> tuple[Any, bool]:
    """``(coercer, required)`` of a ``columns: auto`` ClickHouse column (a shape's type has no ``Nullable``):
    a nullable field's column is ``Nullable(T)``, so its null is a value, not a missing one; an
    ``Array`` is never Nullable (a null array is written as its ``DEFAULT []``), so never required."""
    from ingest.config.base import ColumnSpec
    from ingest.core.mapping.mapper import column_coercer
    from ingest.mirror.types import ch_nullable

    is_array = type_text.startswith("Array(")
    spelled = ch_nullable(type_text) if nullable and not is_array else type_text
    coerce, required = column_coercer(ColumnSpec(type=spelled, required=not nullable and not is_array), "clickhouse")
    return coerce, required and not is_array


def _mapper_for(settings: PipelineSettings, *, decoder: Decoder | None = None,
                key_decoder: Decoder | None = None) -> Mapper | ChangeMapper | TransformingMapper:
    """The mapper of ``settings``: a plain :class:`Mapper`, a :class:`ChangeMapper` when records can
    delete, a :class:`TransformingMapper` when the pipeline has transforms and no deletes (a
    ChangeMapper applies them itself). Every caller -- the pipeline, ``replay-dlq``, ``preview`` --
    gets its mapper here, so each applies the configuration's current transforms.
    Raises ConfigError for a transform that does not compile."""
    transformer = compile_transforms(settings.transforms, f"pipeline {settings.name!r} transforms",
                                     plain_values=settings.format == "json" and settings.envelope == "none")
    if not settings.has_deletes:
        mapper = Mapper(settings.sink.columns, settings.key, decoder=decoder, key_decoder=key_decoder)
        if transformer is None:
            return mapper
        children = [ChildMapper(i, settings.transforms[i].label(i), e, settings.explode_columns(e))
                    for i, e in settings.explode_steps]
        return TransformingMapper(mapper, transformer, children, columnar_steps=settings.transforms)
    return ChangeMapper(settings, decoder=decoder, key_decoder=key_decoder, transformer=transformer)


class TransformingMapper:
    """A :class:`Mapper` whose records go through the pipeline's transforms between decode and map.

    The mapper's contract (``map(record) -> (row, ordering_key)``, raising InvalidRecord for poison)
    plus :class:`~ingest.errors.Filtered` (a :class:`~ingest.errors.NoChange`) for a record a filter
    drops. A tombstone is not transformed (the mapper decides it, as without transforms). A
    columnar plan when every step is one the columnar tier evaluates
    (:mod:`ingest.core.transforms.columnar`); :meth:`columnar_refusal` names the step that is not.
    """

    def __init__(self, mapper: Mapper, transformer: Transformer, children: Sequence[ChildMapper] = (), *,
                 columnar_steps: Sequence[Any] = ()) -> None:
        """``children``: one per ``explode`` step, in order: rows become :class:`~ingest.types.FamilyRow`.
        ``columnar_steps``: the configured steps behind ``transformer``
        (:class:`ingest.config.transforms.TransformStep`), for the columnar tier; none: no columnar plan."""
        self._mapper = mapper
        self.transformer = transformer
        self._children = tuple(children)
        self._steps = tuple(columnar_steps)
        self._columnar: tuple[Any, str | None] | None = None  # (compiled for the tier, why not): once
        self.column_names = mapper.column_names
        self.column_types = mapper.column_types

    @property
    def fast_misses(self) -> int:
        """See :attr:`Mapper.fast_misses` (documents given to the compiled path that it declined)."""
        return self._mapper.fast_misses

    #: transformed documents skip the typed tier (see :attr:`Mapper.typed_misses`)
    typed_misses = 0

    def review_typed(self, offered: int) -> None:
        """Nothing to review: no typed tier here (see :meth:`Mapper.review_typed`)."""

    def _columnar_transform(self) -> tuple[Any, str | None]:
        """The steps compiled for the columnar tier, or None and why not (compiled once)."""
        if self._columnar is None:
            if not self._steps:
                self._columnar = (None, "transforms run on the row path (their settings were not given)")
            else:
                from ingest.core.transforms.subset import Unsupported  # no pyarrow

                try:
                    from ingest.core.transforms.columnar import compile_columnar  # imports pyarrow

                    self._columnar = (compile_columnar(self._steps, self.transformer), None)
                except Unsupported as exc:
                    self._columnar = (None, str(exc))
                except ImportError as exc:  # pragma: no cover - the tier checks for pyarrow first
                    self._columnar = (None, f"pyarrow is not installed ({exc})")
        return self._columnar

    def columnar_plan(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> Any:
        """The row mapper's columnar plan applying the transforms to each batch first, or None when a step
        is not one the tier evaluates, or the columns cannot be staged (see :meth:`columnar_refusal`)."""
        transform, _ = self._columnar_transform()
        if transform is None:
            return None
        return self._mapper.columnar_plan(key_index, version_index, transform=transform)

    def columnar_refusal(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> str | None:
        """Why :meth:`columnar_plan` makes no plan -- the first step the tier does not evaluate, naming it
        (``transforms[1] (1-set): set.label: ...``), or the columns' reason -- or None when it makes one."""
        _, why = self._columnar_transform()
        if why is None:
            why = self._mapper.nested_refusal()
        return why if why is not None else self._mapper.columnar_refusal(key_index, version_index)

    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """``(row, ordering_key)`` of the transformed record. Raises InvalidRecord, Filtered. With
        ``explode`` steps the row is a :class:`~ingest.types.FamilyRow` carrying the child rows; an
        element that cannot be a child row fails the whole record (stage ``transform``)."""
        if record.value is None:
            return self._mapper.map(record)
        if not self._children:
            doc = self.transformer.apply(record, self._mapper.decode(record))
            return self._mapper.map_document(record, doc)
        doc, exploded = self.transformer.apply_exploding(record, self._mapper.decode(record))
        row, key = self._mapper.map_document(record, doc)
        family = FamilyRow(row)
        family.families = tuple(None if found is None else child.rows(record, *found)
                                for child, found in zip(self._children, exploded, strict=True))
        return family, key


class ChildMapper:
    """Maps one ``explode`` step's child documents (:class:`~ingest.core.transforms.steps.ExplodeStep`)
    into the child table's rows, and its parent link values into their columns' types."""

    def __init__(self, index: int, label: str, explode: Any, columns: dict[str, Any]) -> None:
        """``explode``: the step's ExplodeSettings; ``columns``: the child table's (with hidden ones)."""
        self._where = f"transforms[{index}] ({label}): "
        self._rows = Mapper(columns, None)
        self._links = Mapper({name: columns[name] for name in explode.parent}, None)
        #: the child table's column names, in row order (the hidden ones last)
        self.column_names = list(columns)
        names = list(columns)
        self._key_index = tuple(names.index(k) for k in explode.conflict_key)

    def rows(self, record: Record, links: dict[str, Any], docs: list[dict[str, Any]]) -> tuple[
            tuple[Any, ...], list[tuple[Any, ...]]]:
        """``(link, rows)`` of one record (see :class:`~ingest.types.FamilyRow`). Raises InvalidRecord
        (stage ``transform``, class ``transform_error``) naming the element that fails or repeats a key."""
        try:
            link, _ = self._links.map_document(record, links)
        except InvalidRecord as exc:
            raise InvalidRecord("transform", "transform_error", f"{self._where}explode parent: {exc.message}") from None
        rows, seen = [], {}
        key_index = self._key_index
        for position, doc in enumerate(docs):
            try:
                row, _ = self._rows.map_document(record, doc)
            except InvalidRecord as exc:
                raise InvalidRecord("transform", "transform_error",
                                    f"{self._where}explode element {position}: {exc.message}") from None
            key = tuple(row[i] for i in key_index)
            if key in seen:
                raise InvalidRecord("transform", "transform_error",
                                    f"{self._where}explode elements {seen[key]} and {position} have one child "
                                    f"key {[str(v)[:40] for v in key]}")
            seen[key] = position
            rows.append(row)
        return link, rows


class ChangeMapper:
    """Maps upserts, deletes and the records handled without a row (see the module docstring).

    Used by one thread (the pipeline's, or replay's): it caches the schema parts of JSON events it has
    seen (:class:`~ingest.cdc.debezium.SchemaParts`). Raises ValueError for settings it cannot map.
    """

    def __init__(self, settings: PipelineSettings, *, decoder: Decoder | None = None,
                 key_decoder: Decoder | None = None, transformer: Transformer | None = None) -> None:
        """``transformer``: the pipeline's transforms, applied to an upsert's ``after`` image and to plain
        records' values; a delete's ``before`` image goes through the steps that move fields only
        (rename, flatten, drop: with ``REPLICA IDENTITY DEFAULT`` it holds the key alone, so a filter
        or a computed field would fail or drop every delete); a tombstone or a delete keyed by the
        record key is not transformed."""
        sink = settings.sink
        self._transformer = transformer
        columns = {name: (spec.model_copy(update={"source": "$." + spec.source})
                          if (spec.source or "").startswith("@source.") else spec)
                   for name, spec in sink.columns.items()}
        self._wants_source = any((spec.source or "").startswith("@source.") for spec in sink.columns.values())
        self._upserts = Mapper(columns, settings.key, decoder=decoder, key_decoder=key_decoder)
        self.column_names = self._upserts.column_names
        self.column_types = self._upserts.column_types
        rule = sink.collapse_rule()
        assert rule.key_index is not None, "validated by the pipeline settings"
        names = list(columns)
        kept = set(rule.key_index) | {i for i, n in enumerate(names) if n.startswith(_HIDDEN_PREFIX)}
        if rule.version_index is not None:
            kept.add(rule.version_index)
        self._positions = sorted(kept)
        key_names = {names[i] for i in rule.key_index}
        delete_columns = {names[i]: (columns[names[i]].model_copy(update={"required": True})
                                     if names[i] in key_names else columns[names[i]]) for i in self._positions}
        self._deletes = Mapper(delete_columns, None, decoder=decoder, key_decoder=key_decoder)
        self._filler = tuple(sink.delete_filler())
        self._sink_columns = dict(sink.columns)
        self._debezium = settings.envelope == "debezium"
        self._soft = getattr(settings.deletes, "mode", "hard") == "soft"
        self._tombstones = settings.effective_tombstones
        self._truncate = settings.truncate
        version_source = (sink.column_source(names[rule.version_index]) if rule.version_index is not None else "@")
        #: a Debezium tombstone cannot carry the version: it is only a delete when the version is metadata
        self._tombstone_is_delete = not (self._debezium and (version_source.startswith("$")
                                                             or version_source.startswith("@source.")))
        self._key_decoder = key_decoder
        #: JSON with the schema part: each distinct schema part is parsed once (ingest.cdc.debezium)
        loads = (decoder.value_loader() if decoder is not None else orjson.loads)
        self._parts = SchemaParts(loads) if self._debezium and loads is not None else None

    @property
    def fast_misses(self) -> int:
        """Row images the compiled fast paths declined (see :attr:`Mapper.fast_misses`)."""
        return self._upserts.fast_misses + self._deletes.fast_misses

    #: change events are decoded whole by their envelope: no typed tier (see :attr:`Mapper.typed_misses`)
    typed_misses = 0

    def review_typed(self, offered: int) -> None:
        """Nothing to review: no typed tier here (see :meth:`Mapper.review_typed`)."""

    @property
    def skips_tombstones(self) -> bool:
        """Every tombstone is a :class:`NoChange` here: the pipeline may count them done without mapping."""
        return self._tombstones == "skip" or (self._tombstones == "delete" and not self._tombstone_is_delete)

    def columnar_refusal(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> str | None:
        """Why :meth:`columnar_plan` makes no plan -- the first reason -- or None when it makes one."""
        if not self._debezium:
            return "deletes by tombstones (envelope: none) are written by rows"
        if self._transformer is not None:
            return "a change pipeline's transforms run on the row path"
        why = self._upserts.columnar_refusal(None, version_index) or self._deletes.columnar_refusal(None, None)
        if why is not None:
            return why
        flat = self._flat_columns()
        if flat is None:
            return "a column reads a nested path of the source block (the tier reads @source.KEY)"
        if Mapper(flat[0], None).columnar_plan(None, None) is None or Mapper(flat[0], None).columnar_plan(
                None, None).nested:
            return "a column reads a nested path of the row image (the tier reads its top-level keys)"
        plan = self._upserts.columnar_plan(None, None)
        if plan is not None:
            for i in key_index or ():
                if plan.columns[i].kind not in ("int", "text") or plan.columns[i].default is not None:
                    return (f"the key column {plan.columns[i].name!r} is collapsed by the row mapper's values: "
                            "the tier takes integer and text keys without a default")
        return None if self.columnar_plan(key_index, version_index) is not None else "its columns cannot be staged"

    def columnar_plan(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> Any:
        """A :class:`~ingest.cdc.columnar.ChangePlan` of this mapper's upserts and deletes (Debezium, no
        transforms, integer or text key columns, every ``$`` column reading a top-level key of the row
        image and every ``@source`` column a key of the source block), or None."""
        if not self._debezium or self._transformer is not None or not key_index:
            return None
        from ingest.cdc.columnar import ChangePlan, text_keys  # imports pyarrow
        from ingest.core.mapping.columnar import VERSION_KINDS

        flat = self._flat_columns()
        if flat is None:
            return None
        columns, sources = flat
        names = list(columns)
        keys = {names[i] for i in key_index}
        flat_mapper = Mapper(columns, None)
        upserts = flat_mapper.columnar_plan(None, None)
        deletes = Mapper({names[i]: (columns[names[i]].model_copy(update={"required": True})
                                     if names[i] in keys else columns[names[i]]) for i in self._positions},
                         None).columnar_plan(None, None)
        if upserts is None or deletes is None or upserts.nested or deletes.nested:
            return None
        kinds = upserts.columns
        if any(kinds[i].kind not in ("int", "text") or kinds[i].default is not None for i in key_index):
            return None
        if version_index is not None and kinds[version_index].kind not in VERSION_KINDS:
            return None
        if any(d.kind != kinds[p].kind or d.aware != kinds[p].aware for d, p in zip(deletes.columns, self._positions)):
            return None
        fast_columns = flat_mapper.columnar_columns()
        route = [(fast_columns[i].doc_key, kinds[i]) for i in key_index]
        return ChangePlan(self, upserts, deletes, self._positions, key_index, version_index,
                          text_keys(fast_columns, kinds), sources=sources, merge_deletes=self._soft,
                          route=route if all(k is not None for k, _ in route) else None)

    def _flat_columns(self) -> tuple[dict[str, Any], list[tuple[str, str]]] | None:
        """The sink's columns with each ``@source.KEY`` source read from a top-level key of its own instead
        (``__source_<n>``), and those keys with the source block's key each stands for; None when a column
        reads a deeper path of the source block, or one of those names."""
        columns: dict[str, Any] = {}
        sources: list[tuple[str, str]] = []
        for name, spec in self._sink_columns.items():
            source = spec.source or ""
            if source.startswith("@source."):
                path = source[len("@source."):]
                if "." in path or "[" in path or not path:
                    return None
                flat = f"__source_{len(sources)}"
                sources.append((flat, path))
                spec = spec.model_copy(update={"source": "$." + flat})
            elif "__source_" in source:
                return None
            columns[name] = spec
        return columns, sources

    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """``(row, ordering_key)``: an upsert's row or a :class:`DeleteRow`. Raises InvalidRecord, NoChange."""
        if record.value is None:
            return self._tombstone(record)
        if not self._debezium:
            if self._transformer is not None:
                doc = self._transformer.apply(record, self._upserts.decode(record))
                return self._upserts.map_document(record, doc)
            return self._upserts.map(record)
        op, image = self.change_image(record)
        if op == "u":
            return self._upserts.map_document(record, image)
        if op == "d":
            return self._delete(record, image)
        # op "t" (unwrap accepts no other)
        if self._truncate == "ignore":
            raise NoChange("truncate ignored")
        raise InvalidRecord("map", "truncate", "a truncate event (op t) cannot be applied by key; "
                            "it is dead-lettered (truncate: dlq)")

    def change_image(self, record: Record) -> tuple[str, Any]:
        """What :meth:`map` maps of a Debezium event with a value: ``("u", image)`` for an upsert (ops
        ``c``, ``r``, ``u``: the transformed ``after`` image, with the event's ``source`` block under
        ``@source`` when a column reads it), ``("d", image)`` for a delete (the ``before`` image, or the
        record key decoded), ``("t", None)`` for a truncate. Raises InvalidRecord (an undecodable value, not
        a change event). Requires ``envelope: debezium``."""
        change = self._parts.change(record.value) if self._parts is not None else None
        if change is None:
            doc = self._upserts.decode(record)
            if self._parts is not None:
                self._parts.remember(record.value, doc)
            change = unwrap(doc)
        op = change.op
        if op in _UPSERT_OPS:
            image: Any = change.after
            if self._transformer is not None:
                image = self._transformer.apply(record, image)
            if self._wants_source:
                image[_SOURCE_KEY] = change.source
            return "u", image
        if op == "d":
            if change.before is not None:
                image = (change.before if self._transformer is None
                         else self._transformer.apply(record, change.before, shape_only=True))
            else:
                image = self._key_document(record)
            if self._wants_source and type(image) is dict:
                image[_SOURCE_KEY] = change.source
            return "d", image
        return "t", None

    def _tombstone(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        if self._tombstones == "dlq":
            raise InvalidRecord("decode", "tombstone", "record value is null (tombstone)")
        if self.skips_tombstones:
            raise NoChange("tombstone")
        return self._delete(record, self._key_document(record) if self._debezium else None)

    def _delete(self, record: Record, image: Any) -> tuple[tuple[Any, ...], bytes | None]:
        values, key = self._deletes.map_document(record, image)
        row = list(self._filler)
        for position, value in zip(self._positions, values):
            row[position] = value
        return DeleteRow(row), key

    def _key_document(self, record: Record) -> Any:
        """The record key decoded (by ``key_format``, else as JSON) and unwrapped (Debezium's schema part)."""
        if record.key is None:
            raise InvalidRecord("map", "missing_field", "a delete without a row image needs the record key, "
                                "and the record has none")
        if self._key_decoder is not None:
            try:
                doc = self._key_decoder.decode(record)
            except IngestError:
                raise
            except Exception as exc:  # noqa: BLE001 - a decoder's bug must not crash the pipeline
                raise InvalidRecord("decode", "undecodable", f"record key could not be decoded: {exc}"[:300]) from None
        else:
            try:
                doc = orjson.loads(record.key)
            except orjson.JSONDecodeError as exc:
                raise decode_error(record.key, exc, "key") from None
        return unwrap_key(doc) if self._debezium else doc

"""``format: protobuf``: Protobuf values in the Schema Registry wire format (Confluent's
``ProtobufSerializer``): magic byte, schema id, the message indexes, then the message.

A config-only service has no compiled classes, so message classes are built from the registry's
own schema: asked for in the ``serialized`` format, it is a ``FileDescriptorProto``; its references
(other ``.proto`` files, fetched the same way) and the well-known types are added to a private
descriptor pool, and protobuf's ``message_factory`` makes the classes. Parsing is protobuf's own
(``FromString``), never hand-written wire parsing. Classes and converters are cached per schema id
and message index.

What columns receive (a message becomes a dict by field name, so ``$`` paths work as for JSON):
scalars as Python values (64-bit integers as int, ``bytes`` as bytes), enums as their value's
name (an unknown number as the int), nested messages as dicts, repeated fields as lists, maps as
dicts, and the well-known types as values: ``Timestamp`` → aware UTC datetime, ``Duration`` →
timedelta, the wrappers (``Int64Value``, ``StringValue``, ...) → their value, ``Struct`` /
``Value`` / ``ListValue`` → plain JSON values.

Presence: a field with presence (``optional`` scalars, message-typed fields -- wrappers included --
and ``oneof`` members) that is not set is *missing* (the column's default, NULL, or ``missing_field``
when required). A proto3 scalar without ``optional`` has no presence: unset and zero look the same
on the wire, so it is always present with its value (0, "", false), ``required`` never fails for it,
and a column default never replaces it. Use ``optional`` or a wrapper where "absent" must differ from
zero.

Poison (stage ``decode``): ``bad_magic_byte``, ``unknown_schema``, ``schema_mismatch`` (a schema that
is not Protobuf or does not build, message indexes that name no message, bytes that do not parse).
"""

from __future__ import annotations

import datetime as dt
import keyword
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ingest.errors import FatalPipelineError, InvalidRecord, TransientError
from ingest.formats import wire
from ingest.formats.avro_batch import DATETIME_MICROS_MAX, DATETIME_MICROS_MIN
from ingest.formats.registered import RegistryDecoder
from ingest.formats.schemas import SchemaStore
from ingest.types import Record

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_WRAPPERS = frozenset(f"google.protobuf.{n}Value" for n in
                      ("Double", "Float", "Int64", "UInt64", "Int32", "UInt32", "Bool", "String", "Bytes"))
_JSON_TYPES = frozenset({"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"})


class ProtoSchema:
    """One registered schema: its file in a private descriptor pool, and per message index path the
    message class and its to-dict converter (built on first use)."""

    def __init__(self, pool: Any, file_proto: Any) -> None:
        self._pool = pool
        self._file = file_proto
        self._messages: dict[tuple[int, ...], tuple[Any, Callable[[Any], dict[str, Any]]]] = {}
        self._converters: dict[tuple[Any, Any], Callable[[Any], dict[str, Any]]] = {}

    def message(self, indexes: Sequence[int]) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
        """``(message class, converter)`` of the message at ``indexes``; ValueError when there is none."""
        key = tuple(indexes)
        found = self._messages.get(key)
        if found is None:
            from google.protobuf import message_factory

            descriptor = self._pool.FindMessageTypeByName(self._full_name(key))
            found = (message_factory.GetMessageClass(descriptor), converter(descriptor))
            self._messages[key] = found
        return found

    def first_converter(self, only: tuple[str, ...] | None,
                        staged: tuple[tuple[str, type], ...] | None) -> Callable[[Any], dict[str, Any]]:
        """The converter of the first message (indexes ``[0]``) with :func:`converter`'s ``only`` and
        ``staged`` (as sorted pairs); ValueError when there is no such message."""
        found = self._converters.get((only, staged))
        if found is None:
            found = self._converters[only, staged] = converter(self.descriptor(), only, dict(staged or ()))
        return found

    def descriptor(self, indexes: Sequence[int] = (0,)) -> Any:
        return self._pool.FindMessageTypeByName(self._full_name(tuple(indexes)))

    def _full_name(self, indexes: tuple[int, ...]) -> str:
        names = []
        types = self._file.message_type
        for index in indexes:
            if not 0 <= index < len(types):
                raise ValueError(f"message indexes {list(indexes)} name no message of {self._file.name}")
            names.append(types[index].name)
            types = types[index].nested_type
        return ".".join(([self._file.package] if self._file.package else []) + names)


def parse_protobuf(schema: Any, store: SchemaStore | None = None) -> ProtoSchema:
    """A registry ``Schema`` (serialized ``FileDescriptorProto``, base64) built into a descriptor pool
    with its references and the well-known types. ValueError when it is not a usable Protobuf schema."""
    from confluent_kafka.schema_registry.common.protobuf import (
        _init_pool,
        _is_builtin,
        _str_to_proto,
    )
    from google.protobuf import descriptor_pool

    if schema.schema_type != "PROTOBUF":
        raise ValueError(f"it is a {schema.schema_type or 'AVRO'} schema, not Protobuf")
    pool = descriptor_pool.DescriptorPool()
    _init_pool(pool)
    try:
        _add_references(schema, store, pool, set(), _is_builtin, _str_to_proto)
        file_proto = _str_to_proto("schema.proto", schema.schema_str)
        pool.Add(file_proto)
    except (ValueError, TransientError, FatalPipelineError):
        raise  # unusable (ValueError), or the registry could not give a reference now: not poison
    except Exception as exc:  # noqa: BLE001 - SerializationError, TypeError (a broken descriptor)
        raise ValueError(f"it does not build: {type(exc).__name__}: {exc}"[:300]) from None
    return ProtoSchema(pool, file_proto)


def _add_references(schema: Any, store: SchemaStore | None, pool: Any, seen: set[str], is_builtin: Any,
                    to_proto: Any) -> None:
    """Add the files ``schema`` imports (depth first), except the well-known types already there."""
    for ref in schema.references or []:
        if is_builtin(ref.name) or ref.name in seen:
            continue
        if store is None:
            raise ValueError("it references other schemas, which need a registry")
        seen.add(ref.name)
        referenced = store.referenced(ref.subject, ref.version)
        _add_references(referenced, store, pool, seen, is_builtin, to_proto)
        pool.Add(to_proto(ref.name, referenced.schema_str))


def converter(descriptor: Any, only: Collection[str] | None = None,
              staged: Mapping[str, type] | None = None) -> Callable[[Any], dict[str, Any]]:
    """A function message → dict by field name, for messages of ``descriptor`` (see the module
    docstring for what each kind of field becomes); ``only``: of these fields alone (each exactly as
    the whole converter gives it: lane routing reads the key fields so); ``staged``: fields whose
    ``google.protobuf.Timestamp`` (not repeated) is given as that type, when it is an ``int`` subclass
    (any other field, or type, as always), of its microseconds
    since the epoch (the columnar plan's staged form of the datetime it would be), raising ValueError
    where that datetime does not exist (the whole converter raises OverflowError there).

    Compiled once per message type into straight-line code (one attribute read per field, a
    ``HasField`` test only for fields with presence), since it runs for every record."""
    lines = ["def convert(m):", "    out = {}"]
    env: dict[str, Any] = {}
    for i, field in enumerate(descriptor.fields):
        name = field.name
        if only is not None and name not in only:
            continue
        read = f"m.{name}" if name.isidentifier() and not keyword.iskeyword(name) else f"getattr(m, {name!r})"
        as_type = (staged or {}).get(name)
        value_of = _staged_timestamp(as_type) if as_type is not None and issubclass(as_type, int) \
            and _is_timestamp(field) else _value_converter(field)
        if value_of is not None:
            env[f"c{i}"] = value_of
            read = f"c{i}({read})"
        if field.has_presence:
            lines.append(f"    if m.HasField({name!r}):")
            lines.append(f"        out[{name!r}] = {read}")
        else:
            lines.append(f"    out[{name!r}] = {read}")
    lines.append("    return out")
    exec(compile("\n".join(lines), f"<protobuf converter {descriptor.full_name}>", "exec"), env)  # noqa: S102
    return env["convert"]  # type: ignore[no-any-return]


def _is_timestamp(field: Any) -> bool:
    """A single (not repeated) ``google.protobuf.Timestamp`` field."""
    return not field.is_repeated and field.message_type is not None \
        and field.message_type.full_name == "google.protobuf.Timestamp"


def _staged_timestamp(as_type: type) -> Callable[[Any], Any]:
    """A Timestamp as ``as_type`` of the microseconds since the epoch of the datetime
    :func:`_single_converter` makes of it (``_EPOCH + timedelta(seconds, microseconds=nanos // 1000)``);
    ValueError where that datetime does not exist."""

    def stage(m: Any) -> Any:
        micros = m.seconds * 1_000_000 + m.nanos // 1000
        if not DATETIME_MICROS_MIN <= micros <= DATETIME_MICROS_MAX:
            raise ValueError(f"{micros} microseconds since the epoch is beyond datetime")
        return as_type(micros)

    return stage


def _value_converter(field: Any) -> Any:
    """How one field's value becomes a plain value: None means as is."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        single = _single_converter(value_field)
        return (lambda m: dict(m)) if single is None else (lambda m: {k: single(v) for k, v in m.items()})
    single = _single_converter(field)
    if field.is_repeated:
        return (lambda values: list(values)) if single is None else (lambda values: [single(v) for v in values])
    return single


def _single_converter(field: Any) -> Any:
    if field.enum_type is not None:
        names = {v.number: v.name for v in field.enum_type.values}
        return lambda number: names.get(number, number)
    message_type = field.message_type
    if message_type is None:
        return None
    full_name = message_type.full_name
    if full_name == "google.protobuf.Timestamp":  # as Timestamp.ToDatetime(tzinfo=utc), without its checks
        return lambda m: _EPOCH + dt.timedelta(seconds=m.seconds, microseconds=m.nanos // 1000)
    if full_name == "google.protobuf.Duration":
        return lambda m: dt.timedelta(seconds=m.seconds, microseconds=m.nanos // 1000)
    if full_name in _WRAPPERS:
        return lambda m: m.value
    if full_name in _JSON_TYPES:
        from google.protobuf import json_format

        return json_format.MessageToDict
    nested: list[Callable[[Any], dict[str, Any]]] = []  # built lazily: messages may be recursive

    def convert(message: Any) -> dict[str, Any]:
        if not nested:
            nested.append(converter(message_type))
        return nested[0](message)

    return convert


class ProtobufDecoder(RegistryDecoder):
    """Protobuf values (or keys) whose schemas live in the registry."""

    name = "protobuf"
    document = "a Protobuf message"
    registry_format = "serialized"
    #: the columnar plan may read this decoder's documents (:meth:`decode_fields`: each message parsed by
    #: protobuf and converted exactly as :meth:`decode` does; a record it refuses is left to the row mapper)
    columnar_documents = True
    #: :meth:`decode_fields` takes ``staged`` (the plan's ``documents_stage``)
    stages_logical_types = True
    parse = staticmethod(parse_protobuf)
    has_path = staticmethod(lambda schema, steps: has_path(schema.descriptor(), steps))

    def decode_fields(self, records: Sequence[Record], keys: Sequence[str],
                      staged: Mapping[str, type] | None = None) -> tuple[list[list[Any]], set[int]]:
        """For the columnar plan: per key of ``keys``, each record's value of that top-level field (None
        where its document lacks it), and the positions of the records whose decode fails (the row
        mapper decides them). The values are exactly what :meth:`decode` gives: the records in the
        classic inline format (magic byte, schema id, message indexes ``[0]``) are parsed and
        converted a writer schema at a time -- its message class and converter looked up once, not per
        record -- and every other record, or one whose parse or conversion raises, by :meth:`decode`.
        Raises what :meth:`decode` raises but InvalidRecord (a registry that cannot answer).
        ``staged``: keys whose Timestamps the caller stages as they are, with the type to give them as
        (:func:`converter`'s ``staged``; the records :meth:`decode` decodes give datetimes)."""
        return self._fields(records, keys, route=False, staged=staged)

    def route_fields(self, records: Sequence[Record], keys: Sequence[str]) -> tuple[list[list[Any]], set[int]]:
        """:meth:`decode_fields` for lane routing: only the fields ``keys`` converted (each exactly as
        :meth:`decode` converts it), for the records it vouches for."""
        return self._fields(records, keys, route=True)

    def _fields(self, records: Sequence[Record], keys: Sequence[str], *, route: bool,
                staged: Mapping[str, type] | None = None) -> tuple[list[list[Any]], set[int]]:
        n = len(records)
        docs: list[Any] = [None] * n
        if self._field != "value" or self._store is None:
            values: list[Any] = []
            groups: dict[bytes, list[int]] = {}
            slow = list(range(n))
        else:
            values, groups, slow = wire.inline_groups(records, 6)
        for head, positions in groups.items():
            try:
                schema: ProtoSchema = self._store.prepared(int.from_bytes(head[1:5], "big"))  # type: ignore[union-attr]
                cls, convert = schema.message([0])
                if route or staged:
                    convert = schema.first_converter(tuple(keys) if route else None,
                                                     tuple(sorted(staged.items())) if staged else None)
            except Exception:  # noqa: BLE001 - an unknown id, no such message...: decode() decides each
                slow += positions
                continue
            parse = cls.FromString
            for i in positions:
                try:
                    docs[i] = convert(parse(values[i][6:]))  # type: ignore[index]
                except Exception:  # noqa: BLE001 - a parse or conversion error: decode() decides
                    slow.append(i)
        for i in slow:
            try:
                docs[i] = self.decode(records[i])
            except InvalidRecord:
                docs[i] = None
        rejected = {i for i, doc in enumerate(docs) if type(doc) is not dict}
        if rejected:
            docs = [doc if type(doc) is dict else {} for doc in docs]
        return [[doc.get(key) for doc in docs] for key in keys], rejected

    def decode(self, record: Record) -> Any:
        store = self._store
        assert store is not None
        data = record.value if self._field == "value" else record.key
        if not record.headers and data is not None and len(data) >= 6 and data[0] == 0 and data[5] == 0:
            # the common case, inline: magic 0, a 4-byte id, message indexes [0] (one zero byte)
            ref: wire.SchemaRef = int.from_bytes(data[1:5], "big")
            indexes: list[int] = [0]
            message_bytes: bytes | memoryview = data[6:]
        else:
            ref, indexes, message_bytes = wire.split_protobuf(record, self._field)
        schema: ProtoSchema = store.prepared(ref)
        try:
            cls, convert = schema.message(indexes)
        except (ValueError, KeyError) as exc:
            raise InvalidRecord("decode", "schema_mismatch", f"{wire.ref_text(ref)}: {exc}"[:300]) from None
        try:
            message = cls.FromString(message_bytes if type(message_bytes) is bytes else bytes(message_bytes))
        except Exception as exc:  # noqa: BLE001 - google.protobuf.message.DecodeError
            raise InvalidRecord("decode", "schema_mismatch",
                                f"record {self._field} does not parse as {cls.DESCRIPTOR.full_name} "
                                f"({wire.ref_text(ref)}): {exc}"[:300]) from None
        try:
            return convert(message)
        except Exception as exc:  # noqa: BLE001 - OverflowError (a Timestamp past datetime), ValueError (NaN in a Struct)
            raise InvalidRecord("decode", "schema_mismatch",
                                f"record {self._field} has a value that cannot be converted ({wire.ref_text(ref)}): "
                                f"{type(exc).__name__}: {exc}"[:300]) from None


def has_path(descriptor: Any, steps: Sequence[tuple[bool, str | int]]) -> bool:
    """Whether messages of ``descriptor`` can hold a value at ``steps``: fields by name, map keys,
    list indexes; a Struct / Value holds anything."""
    node = descriptor
    for i, (is_key, step) in enumerate(steps):
        if node is None:
            return False
        if node.full_name in _JSON_TYPES:
            return True
        if not is_key:
            return False  # an index step is handled with the repeated field below
        field = node.fields_by_name.get(step)
        if field is None:
            return False
        rest = steps[i + 1:]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            return not rest or (rest[0][0] and (not rest[1:] or has_path(value.message_type, rest[1:])))
        if field.is_repeated:
            if not rest:
                return True
            if rest[0][0]:
                return False
            rest = rest[1:]
        if not rest:
            return True
        return field.message_type is not None and has_path(field.message_type, rest)
    return True

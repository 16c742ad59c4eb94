"""The decoder seam (ingest/formats): the JSON decoder's classes, the registry, and a format that needs its
record's context going through the mapper's fast path and generic loop alike."""

from __future__ import annotations

from typing import Any

import pytest

from ingest.config import ColumnSpec, PipelineSettings
from ingest.core.mapping import Mapper
from ingest.errors import InvalidRecord
from ingest.formats import registry
from ingest.formats.base import decode_each
from ingest.formats.json import JsonDecoder
from ingest.types import Record


def rec(value: bytes | None, headers: Any = ()) -> Record:
    return Record("t", 0, 7, b"k", value, None, headers)


@pytest.mark.parametrize("value,error_class", [(b"{nope", "invalid_json"), (b'{"a": "\xff"}', "invalid_utf8"),
                                               (b"", "invalid_json")])
def test_json_decode_errors_are_poison_of_the_decode_stage(value: bytes, error_class: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        JsonDecoder().decode(rec(value))
    assert (info.value.stage, info.value.error_class) == ("decode", error_class)
    out = JsonDecoder().decode_batch([rec(value), rec(b'{"a": 1}')])
    assert isinstance(out[0], InvalidRecord) and out[1] == {"a": 1}


class HeaderPrefixed:
    """A test format that needs its record's context: the document is ``{header "f": value text}``."""

    name = "prefixed"
    document = "a prefixed record"

    def __init__(self, pipeline: Any = None) -> None:
        pass

    def decode(self, record: Record) -> Any:
        field = dict(record.headers).get("f")
        if field is None:
            raise InvalidRecord("decode", "no_field_header", "header f is missing")
        return {field.decode(): record.value.decode()}  # type: ignore[union-attr]

    def decode_batch(self, records: Any) -> list[Any]:
        return decode_each(self, records)

    def value_loader(self) -> None:
        return None


def test_a_context_format_maps_the_same_on_the_fast_path_and_the_generic_loop() -> None:
    mapper = Mapper({"name": ColumnSpec(type="text", required=True)}, decoder=HeaderPrefixed())
    good, bad = rec(b"ada", (("f", b"name"),)), rec(b"ada")
    assert mapper.map(good) == mapper.map_generic(good) == (("ada",), b"k")
    assert mapper._fast(good) == (("ada",), b"k")  # the compiled path decodes through the decoder itself
    for fn in (mapper.map, mapper.map_generic):
        with pytest.raises(InvalidRecord) as info:
            fn(bad)
        assert (info.value.stage, info.value.error_class) == ("decode", "no_field_header")


def test_formats_are_chosen_by_name_and_an_unknown_one_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"name": "p", "topics": ["t"], "sink": {"table": "t", "conflict_key": ["id"],
                                                   "columns": {"id": {"type": "bigint"}}}}
    with pytest.raises(ValueError, match="format must be one of 'json'"):
        PipelineSettings.model_validate({**base, "format": "avro-but-not-registered"})
    monkeypatch.setitem(registry._formats, "prefixed", HeaderPrefixed)
    p = PipelineSettings.model_validate({**base, "format": "prefixed"})
    assert isinstance(registry.build_decoder(p), HeaderPrefixed)
    assert isinstance(registry.build_decoder(PipelineSettings.model_validate(base)), JsonDecoder)

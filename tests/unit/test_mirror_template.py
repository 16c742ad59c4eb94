"""The sink.table template (ingest.mirror.template): parsing at config time, rendering per record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.core.topics import TopicSelector
from ingest.mirror.errors import TemplateError, Unroutable
from ingest.mirror.template import Part, TableTemplate, pattern_groups

SOURCE = {"db": "shop", "schema": "public", "table": "orders", "lsn": 123, "snapshot": False, "extra": {"a": 1}}


def test_every_kind_of_placeholder_renders() -> None:
    t = TableTemplate("{source.schema}_{source.table}/{region}/{header.tenant}/{topic}", {"region"})
    out = t.render("eu.shop.public.orders", groups={"region": "eu"}, source=SOURCE,
                   headers=(("other", b"x"), ("tenant", "acmé".encode())))
    assert out == "public_orders/eu/acmé/eu.shop.public.orders"
    assert t.uses_source and not t.is_constant


def test_a_constant_template_is_one_table() -> None:
    t = TableTemplate("orders")
    assert t.is_constant and t.parts == (Part("text", "orders"),)
    assert t.render("anything") == "orders"


def test_doubled_braces_are_literal_braces() -> None:
    assert TableTemplate("a{{b}}c_{topic}").render("t") == "a{b}c_t"


def test_scalars_render_as_text() -> None:
    t = TableTemplate("{source.lsn}-{source.snapshot}")
    assert t.render("x", source=SOURCE) == "123-false"


def test_groups_come_from_the_pattern_that_matched() -> None:
    topics = [r"^(?P<server>[^.]+)\.public\.(?P<table>.+)$", r"^legacy\.(?P<table>.+)$", "plain"]
    t = TableTemplate.for_topics("{table}", topics)
    selector = TopicSelector(topics)
    assert t.render("db1.public.items", groups=pattern_groups(selector, "db1.public.items")) == "items"
    assert t.render("legacy.old", groups=pattern_groups(selector, "legacy.old")) == "old"
    with pytest.raises(Unroutable) as err:
        t.render("plain", groups=pattern_groups(selector, "plain"))  # a literal name has no groups
    assert err.value.reason == "missing_group" and err.value.error_class == "unroutable"


def test_an_optional_group_that_did_not_match_is_unroutable() -> None:
    topics = [r"^shop\.(?P<schema>[a-z]+\.)?(?P<table>[a-z]+)$"]
    t = TableTemplate.for_topics("{schema}{table}", topics)
    groups = pattern_groups(TopicSelector(topics), "shop.orders")
    with pytest.raises(Unroutable) as err:
        t.render("shop.orders", groups=groups)
    assert err.value.reason == "missing_group"


@pytest.mark.parametrize(("source", "headers", "reason"), [
    (None, (), "no_source_block"),
    ({"schema": "public"}, (), "missing_source_field"),
    ({"schema": "public", "table": None}, (), "missing_source_field"),
    ({"schema": "public", "table": {"nested": 1}}, (), "not_a_scalar"),
    ({"schema": "public", "table": [1]}, (), "not_a_scalar"),
])
def test_source_parts_that_are_missing_are_unroutable(source, headers, reason) -> None:
    with pytest.raises(Unroutable) as err:
        TableTemplate("{source.schema}.{source.table}").render("t", source=source, headers=headers)
    assert err.value.reason == reason
    assert err.value.stage == "route"


@pytest.mark.parametrize(("headers", "reason"), [
    ((), "missing_header"),
    ((("tenant", None),), "missing_header"),
    ((("Tenant", b"x"),), "missing_header"),  # header names are case-sensitive
    ((("tenant", b"\xff\xfe"),), "header_not_utf8"),
])
def test_header_parts_that_are_missing_are_unroutable(headers, reason) -> None:
    with pytest.raises(Unroutable) as err:
        TableTemplate("t_{header.tenant}").render("t", headers=headers)
    assert err.value.reason == reason


def test_the_first_header_of_a_name_wins_as_for_header_sources() -> None:
    assert TableTemplate("{header.h}").render("t", headers=(("h", b"one"), ("h", b"two"))) == "one"


@pytest.mark.parametrize(("text", "position", "words"), [
    ("", 0, "empty"),
    ("orders_{", 7, "without its '}'"),
    ("orders_}", 7, "lone '}'"),
    ("a{b{c}}", 3, "inside a placeholder"),
    ("x{}", 1, "empty placeholder"),
    ("{source.}", 1, "needs a source field"),
    ("{header.}", 1, "needs a header name"),
    ("{topic:>10}", 6, "not a placeholder"),
    ("{topic!r}", 6, "not a placeholder"),
    ("{nope}", 1, "not a named group"),
    ("ab{source}", 3, "needs a name"),
])
def test_a_template_that_does_not_parse_names_the_position(text, position, words) -> None:
    with pytest.raises(TemplateError) as err:
        TableTemplate(text, {"table"})
    assert err.value.position == position
    assert words in str(err.value)
    assert f"at position {position}" in str(err.value)


def test_unknown_groups_are_named_with_the_ones_there_are() -> None:
    with pytest.raises(TemplateError, match=r"they have: schema, table"):
        TableTemplate.for_topics("{tabel}", [r"^x\.(?P<schema>\w+)\.(?P<table>\w+)"])


_TEXT = st.text(st.characters(blacklist_characters="{}"), max_size=12)
_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)


@given(st.lists(st.one_of(_TEXT.map(lambda s: ("text", s)), st.just(("topic", "")),
                          _NAMES.map(lambda n: ("source", n)), _NAMES.map(lambda n: ("header", n))), max_size=6),
       st.text(max_size=20))
def test_rendering_is_the_concatenation_of_the_parts(pieces, topic) -> None:
    """Property: a template written from pieces renders to the pieces' values, in order."""
    text, expected, source, headers = [], [], {}, []
    for kind, value in pieces:
        if kind == "text":
            text.append(value)
            expected.append(value)
        elif kind == "topic":
            text.append("{topic}")
            expected.append(topic)
        elif kind == "source":
            text.append("{source.%s}" % value)
            source.setdefault(value, f"s-{value}")
            expected.append(source[value])
        else:
            text.append("{header.%s}" % value)
            if value not in dict(headers):
                headers.append((value, f"h-{value}".encode()))
            expected.append(dict(headers)[value].decode())
    if not "".join(text):
        return
    t = TableTemplate("".join(text))
    assert t.render(topic, source=source, headers=tuple(headers)) == "".join(expected)


@given(st.text(max_size=30))
def test_any_text_either_parses_or_raises_a_template_error(text) -> None:
    """Property: parsing never fails with anything but TemplateError, and a parsed template of text
    without braces renders to itself."""
    try:
        t = TableTemplate(text)
    except TemplateError as exc:
        assert 0 <= exc.position <= max(len(text) - 1, 0)
        return
    if "{" not in text and "}" not in text:
        assert t.render("topic") == text

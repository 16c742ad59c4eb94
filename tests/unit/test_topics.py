"""Topic names and patterns (ingest.core.topics) and their config fields."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ingest.config import PipelineSettings
from ingest.core.topics import DEFAULT_EXCLUDE_TOPICS, TopicSelector

DEBEZIUM = ["shop", "shop.transaction", "shop.public.orders", "shop.public.order_items", "shop.inventory.stock",
            "shop.public.transaction", "__debezium-heartbeat.shop", "__consumer_offsets", "other.public.orders"]


def test_a_pattern_over_a_captured_database_takes_its_tables_and_leaves_the_rest() -> None:
    selector = TopicSelector([r"^shop\."])
    assert selector.select(DEBEZIUM) == ["shop.inventory.stock", "shop.public.order_items", "shop.public.orders",
                                         "shop.public.transaction"]  # a table named transaction is a table


def test_literal_names_are_always_taken_and_never_excluded() -> None:
    selector = TopicSelector(["shop.transaction", "missing", r"^other\."], exclude=[r"^[^.]+\.transaction$", "^miss"])
    assert selector.select(DEBEZIUM) == ["missing", "other.public.orders", "shop.transaction"]


def test_without_patterns_the_listing_adds_nothing() -> None:
    selector = TopicSelector(["a", "b", "a"])
    assert not selector.has_patterns
    assert selector.select(["a", "c", "b2"]) == ["a", "b"]


def test_patterns_match_from_the_start_and_are_anchored_at_the_end_only_with_a_dollar() -> None:
    assert TopicSelector(["^orders"]).select(["orders", "orders-eu", "x-orders"]) == ["orders", "orders-eu"]
    assert TopicSelector(["^orders$"]).select(["orders", "orders-eu"]) == ["orders"]


def test_the_default_exclusions_are_debeziums_and_the_brokers_internal_topics() -> None:
    selector = TopicSelector(["^"])  # every topic
    assert selector.select(DEBEZIUM) == sorted(set(DEBEZIUM) - {"shop.transaction", "__debezium-heartbeat.shop",
                                                                "__consumer_offsets"})
    assert tuple(TopicSelector(["^"]).exclude[i].pattern for i in range(2)) == DEFAULT_EXCLUDE_TOPICS


names = st.text(alphabet="ab._-", min_size=1, max_size=8)


@given(st.lists(names, max_size=12), st.lists(names, max_size=3), st.lists(names, max_size=3))
def test_a_selected_topic_is_a_literal_or_a_listed_match_not_excluded(listed, literals, excluded) -> None:
    import re

    patterns = ["^a", r"^b\."]
    exclude = [re.escape(e) for e in excluded]
    selector = TopicSelector([*literals, *patterns], exclude)
    chosen = selector.select(listed)
    assert chosen == sorted(set(chosen))
    for topic in chosen:
        assert topic in literals or (topic in listed and topic[0] in "ab"
                                     and not any(re.match(e, topic) for e in exclude))
    for topic in listed:
        if topic.startswith("a") and not any(re.match(e, topic) for e in exclude):
            assert topic in chosen
    assert set(literals) <= set(chosen)


def _pipeline(**extra) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["^shop\\."],
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
                 "columns": {"id": {"type": "bigint"}}},
        **extra,
    })


def test_the_config_takes_patterns_and_their_defaults() -> None:
    p = _pipeline()
    assert p.exclude_topics == list(DEFAULT_EXCLUDE_TOPICS) and p.topic_refresh_s == 30
    assert p.topic_selector.has_patterns and p.literal_topics == []
    assert p.value_subjects() == []  # a pattern's subjects are not known before the broker lists its topics
    q = _pipeline(topics=["orders", "^shop\\."])
    assert q.literal_topics == ["orders"] and q.value_subjects() == ["orders-value"]


@pytest.mark.parametrize(("extra", "field", "words"), [
    ({"topics": ["^shop.(", "x"]}, "topics", "topics[0] '^shop.(' is not a regular expression"),
    ({"topics": ["ok", ""]}, "topics", "topics[1] is empty"),
    ({"exclude_topics": ["[a"]}, "exclude_topics", "exclude_topics[0] '[a' is not a regular expression"),
    ({"topic_refresh_s": 0}, "topic_refresh_s", "greater than 0"),
])
def test_a_bad_pattern_is_refused_naming_the_field(extra, field, words) -> None:
    with pytest.raises(ValidationError) as info:
        _pipeline(**extra)
    text = str(info.value)
    assert field in text and words in text, text

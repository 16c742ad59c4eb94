"""Secrets masked everywhere ingest prints or logs (ingest/redact.py), whatever characters they hold."""

from __future__ import annotations

import io
import logging

import pytest

from ingest import redact
from ingest.config import Settings


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redact, "_secrets", ())


@pytest.mark.parametrize("dsn,expected", [
    ("postgresql://u:Se%zzcret@h:5432/db", {"Se%zzcret"}),  # malformed percent-encoding: the raw token
    ("postgresql://u:p%25w%20d@h/db", {"p%25w%20d", "p%w d"}),
    ("postgresql://u:a@b/c@h/db", {"a@b/c"}),  # unencoded @ and / in the password
    ("postgresql://u@h/db?password=q%40z&sslmode=off", {"q%40z", "q@z"}),
    ("host=h password=Sp4ce s3cret-7b2 user=u", {"Sp4ce s3cret-7b2", "Sp4ce", "s3cret-7b2"}),
    ("host=h password='it\\'s a % secret' user=u", {"it's a % secret", "it\\'s a % secret"}),
    ("host=h user=u", set()),
])
def test_dsn_secrets_in_every_form_a_message_could_quote(dsn: str, expected: set[str]) -> None:
    assert redact.dsn_secrets(dsn) == expected


def test_register_settings_finds_every_secret() -> None:
    settings = Settings.model_validate({
        "kafka": {"client": {"sasl.password": "Kafka-Pw-1", "sasl.username": "svc"}},
        "pipelines": [{
            "name": "p", "topics": ["t"],
            "sink": {"kind": "postgres", "dsn": "postgresql://u:Pg%20Pw@h/db", "table": "t", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint"}}},
            "dlq": {"dsn": "host=h password='Dlq pw'"},
        }, {
            "name": "c", "topics": ["t"], "dlq": {"dsn": "postgresql://u@h/db"},
            "sink": {"kind": "clickhouse", "url": "http://h:8123", "password": "Ch-Pw-2", "table": "t",
                     "order_by": ["id"], "columns": {"id": {"type": "UInt64"}}},
        }],
    })
    redact.register_settings(settings)
    text = "a Kafka-Pw-1 b Pg Pw c Pg%20Pw d Dlq pw e Ch-Pw-2 f svc"
    assert redact.scrub(text) == "a ********** b ********** c ********** d ********** e ********** f svc"


def test_short_strings_are_not_registered() -> None:
    redact.register("ab", "abc")
    assert redact.registered() == ("abc",)
    assert redact.scrub("ab abc") == "ab **********"


def test_the_log_filter_scrubs_message_arguments_extras_and_tracebacks() -> None:
    redact.register("Hunter%2")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(redact.RedactingFilter())
    handler.setFormatter(logging.Formatter("%(message)s %(error)s"))
    logger = logging.getLogger("test-redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise RuntimeError('invalid percent-encoded token: "Hunter%2"')
        except RuntimeError:
            logger.exception("connect failed for %s", "Hunter%2", extra={"error": "token Hunter%2"})
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "Hunter%2" not in out and out.count("**********") >= 3, out

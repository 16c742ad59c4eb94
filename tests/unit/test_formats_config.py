"""The configuration of registry-backed formats: the top-level ``schema_registry`` section
(ingest/config/formats.py), a pipeline's ``format`` / ``avro_schema`` / ``subject_strategy``
(ingest/config/pipeline.py), and the cross-check that a registry format has a registry
(ingest/config/load.py). Loaded from YAML files the way ``ingest`` loads them."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from harness import write_config
from pydantic import ValidationError

from ingest.config import PipelineSettings, Settings, load_settings
from ingest.config.formats import SchemaRegistrySettings
from ingest.errors import ConfigError
from ingest.redact import MASK, scrub

PASSWORD = "s3cr3tPW-registry"
KEY_PASSWORD = "s3cr3tPW-regkey"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No INGEST_* variable of the developer's shell may leak into these tests."""
    for name in list(os.environ):
        if name.startswith("INGEST_") and not name.startswith("INGEST_TEST_"):
            monkeypatch.delenv(name, raising=False)


def config(**pipeline: Any) -> dict[str, Any]:
    """A minimal valid config: one pipeline (``pipeline`` keys override or add to it)."""
    p: dict[str, Any] = {
        "name": "orders",
        "topics": ["orders"],
        "sink": {
            "kind": "postgres",
            "dsn": "postgresql://ingest@127.0.0.1:5432/app",
            "table": "orders",
            "conflict_key": ["id"],
            "columns": {"id": {"type": "bigint"}, "v": {"type": "text"}},
        },
    }
    p.update(pipeline)
    return {"pipelines": [p]}


def with_registry(data: dict[str, Any], **registry: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    data["schema_registry"] = {"url": "http://127.0.0.1:8081", **registry}
    return data


def load(tmp_path: Path, data: dict[str, Any]) -> Settings:
    return load_settings(write_config(tmp_path, data))


def error_of(tmp_path: Path, data: dict[str, Any]) -> str:
    """The ConfigError's message; the config must have exactly one problem (so the test checks that one)."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    message = str(info.value)
    problems = [line for line in message.splitlines()[1:] if line.startswith("  ")]
    assert len(problems) == 1, message
    return message


# -- the baseline ---------------------------------------------------------------------------------------

def test_the_minimal_config_loads_as_json_without_a_registry(tmp_path: Path) -> None:
    s = load(tmp_path, config())
    assert s.schema_registry is None
    assert s.pipelines[0].format == "json"


def test_avro_with_a_registry_loads(tmp_path: Path) -> None:
    s = load(tmp_path, with_registry(config(format="avro")))
    assert s.pipelines[0].format == "avro"
    assert s.schema_registry is not None and s.schema_registry.url == ["http://127.0.0.1:8081"]


# -- a registry format needs a registry ------------------------------------------------------------------

def test_avro_without_a_schema_registry_is_a_config_error_naming_the_pipeline(tmp_path: Path) -> None:
    data = config(format="avro")
    data["pipelines"].append({**copy.deepcopy(data["pipelines"][0]), "name": "fine", "format": "json"})
    message = error_of(tmp_path, data)
    assert "'orders'" in message
    assert "schema_registry" in message
    assert "avro_schema" in message  # says the alternative
    assert "'fine'" not in message
    assert str(tmp_path) in message  # names the file


def test_avro_with_an_avro_schema_file_needs_no_registry(tmp_path: Path) -> None:
    avsc = tmp_path / "order.avsc"
    avsc.write_text(json.dumps({"type": "record", "name": "Order", "fields": [{"name": "id", "type": "long"}]}))
    s = load(tmp_path, config(format="avro", avro_schema=str(avsc)))
    assert s.schema_registry is None
    assert s.pipelines[0].avro_schema == str(avsc)


def test_avro_schema_is_only_for_format_avro(tmp_path: Path) -> None:
    message = error_of(tmp_path, config(format="json", avro_schema="x.avsc"))
    assert "avro_schema" in message and "avro" in message


def test_an_unknown_format_is_a_config_error(tmp_path: Path) -> None:
    message = error_of(tmp_path, config(format="xml"))
    assert "format" in message and "'avro'" in message and "'json'" in message


# -- schema_registry.url -----------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://u:secret@registry:8081", "https://u:secret@registry",
                                 ["http://ok:1", "http://admin:secret@registry:8081"]])
def test_a_url_with_credentials_is_refused_without_showing_them(tmp_path: Path, url: Any) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), url=url))
    assert "secret" not in message
    assert "schema_registry" in message and "url" in message
    assert "credentials" in message


def test_a_url_with_only_a_user_name_is_refused_too(tmp_path: Path) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), url="http://admin@registry:8081"))
    assert "credentials" in message and "admin" not in message


@pytest.mark.parametrize("url", ["ftp://registry:8081", "registry:8081", "127.0.0.1:8081", "http://", "file:///x"])
def test_a_url_that_is_not_http_or_https_is_refused(tmp_path: Path, url: str) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), url=url))
    assert "schema_registry" in message and "url" in message
    assert "http" in message


def test_an_empty_url_list_is_refused(tmp_path: Path) -> None:
    assert "url" in error_of(tmp_path, with_registry(config(format="avro"), url=[]))


def test_a_missing_url_is_refused(tmp_path: Path) -> None:
    data = with_registry(config(format="avro"))
    del data["schema_registry"]["url"]
    message = error_of(tmp_path, data)
    assert "schema_registry.url" in message and "required" in message


def test_a_comma_separated_url_is_a_list(tmp_path: Path) -> None:
    s = load(tmp_path, with_registry(config(format="avro"), url="http://a:8081, https://b:8082/ ,,http://c"))
    assert s.schema_registry is not None
    assert s.schema_registry.url == ["http://a:8081", "https://b:8082", "http://c"]
    assert s.schema_registry.client_config()["url"] == "http://a:8081,https://b:8082,http://c"


def test_a_yaml_list_of_urls_is_kept_in_order_without_trailing_slashes(tmp_path: Path) -> None:
    s = load(tmp_path, with_registry(config(format="avro"), url=["https://b:1/", "http://a:2"]))
    assert s.schema_registry is not None and s.schema_registry.url == ["https://b:1", "http://a:2"]


# -- credentials --------------------------------------------------------------------------------------

def test_a_password_without_a_username_is_refused(tmp_path: Path) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), password=PASSWORD))
    assert "password needs username" in message
    assert PASSWORD not in message


def test_an_unknown_registry_key_is_refused(tmp_path: Path) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), basic_auth="u:p"))
    assert "schema_registry.basic_auth" in message and "unknown key" in message


def test_client_config_has_basic_auth_and_no_client_retries(tmp_path: Path) -> None:
    s = load(tmp_path, with_registry(config(format="avro"), username="user", password="pw", timeout_s=3))
    assert s.schema_registry is not None
    conf = s.schema_registry.client_config()
    assert conf["basic.auth.user.info"] == "user:pw"
    assert conf["max.retries"] == 0
    assert conf["url"] == "http://127.0.0.1:8081"
    assert conf["timeout"] == 3


def test_client_config_without_credentials_has_no_basic_auth() -> None:
    conf = SchemaRegistrySettings(url="http://r:1").client_config()
    assert "basic.auth.user.info" not in conf
    assert conf["max.retries"] == 0


def test_client_config_carries_tls_settings() -> None:
    conf = SchemaRegistrySettings(url="https://r:1", ssl_ca_location="/ca.pem", ssl_certificate_location="/c.pem",
                                  ssl_key_location="/k.pem", ssl_key_password=KEY_PASSWORD).client_config()
    assert (conf["ssl.ca.location"], conf["ssl.certificate.location"], conf["ssl.key.location"]) == (
        "/ca.pem", "/c.pem", "/k.pem")
    assert conf["ssl.key.password"] == KEY_PASSWORD


def test_the_passwords_never_appear_in_repr_or_dumps(tmp_path: Path) -> None:
    s = load(tmp_path, with_registry(config(format="avro"), username="user", password=PASSWORD,
                                     ssl_certificate_location="/c.pem", ssl_key_password=KEY_PASSWORD))
    registry = s.schema_registry
    assert registry is not None
    for text in (repr(registry), str(registry), registry.model_dump_json(), json.dumps(registry.model_dump(),
                                                                                        default=str),
                 repr(s), s.model_dump_json()):
        assert PASSWORD not in text
        assert KEY_PASSWORD not in text
    assert "user" in repr(registry)  # the user name is not a secret
    # ... while the client still gets them
    assert registry.client_config()["basic.auth.user.info"] == f"user:{PASSWORD}"
    assert registry.client_config()["ssl.key.password"] == KEY_PASSWORD


def test_loading_registers_the_registry_passwords_for_masking(tmp_path: Path) -> None:
    load(tmp_path, with_registry(config(format="avro"), username="user", password=PASSWORD,
                                 ssl_certificate_location="/c.pem", ssl_key_password=KEY_PASSWORD))
    assert scrub(f"401 for user:{PASSWORD} / {KEY_PASSWORD}") == f"401 for user:{MASK} / {MASK}"


def test_a_tls_key_needs_its_certificate(tmp_path: Path) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro"), ssl_key_password=KEY_PASSWORD))
    assert "ssl_certificate_location" in message and KEY_PASSWORD not in message


@pytest.mark.parametrize("field,value", [("timeout_s", 0), ("timeout_s", 301), ("cache_capacity", 0),
                                         ("cache_latest_ttl_s", 0)])
def test_registry_bounds(tmp_path: Path, field: str, value: Any) -> None:
    assert f"schema_registry.{field}" in error_of(tmp_path, with_registry(config(format="avro"), **{field: value}))


# -- subjects -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["record_name", "topic_record_name"])
def test_a_record_name_strategy_needs_record_name(tmp_path: Path, strategy: str) -> None:
    message = error_of(tmp_path, with_registry(config(format="avro", subject_strategy=strategy)))
    assert f"subject_strategy {strategy} needs record_name" in message
    assert "orders" in message


def test_an_unknown_subject_strategy_is_refused(tmp_path: Path) -> None:
    assert "subject_strategy" in error_of(tmp_path, with_registry(config(format="avro", subject_strategy="nope")))


def pipeline(tmp_path: Path, **kw: Any) -> PipelineSettings:
    return load(tmp_path, with_registry(config(format="avro", topics=["orders", "refunds"], **kw))).pipelines[0]


def test_value_subjects_topic_name_is_the_default(tmp_path: Path) -> None:
    p = pipeline(tmp_path)
    assert p.subject_strategy == "topic_name"
    assert p.value_subjects() == ["orders-value", "refunds-value"]


def test_value_subjects_record_name(tmp_path: Path) -> None:
    p = pipeline(tmp_path, subject_strategy="record_name", record_name="com.acme.Order")
    assert p.value_subjects() == ["com.acme.Order"]


def test_value_subjects_topic_record_name(tmp_path: Path) -> None:
    p = pipeline(tmp_path, subject_strategy="topic_record_name", record_name="com.acme.Order")
    assert p.value_subjects() == ["orders-com.acme.Order", "refunds-com.acme.Order"]


def test_value_subjects_topic_name_ignores_record_name(tmp_path: Path) -> None:
    p = pipeline(tmp_path, record_name="com.acme.Order")
    assert p.value_subjects() == ["orders-value", "refunds-value"]


# -- the settings model on its own --------------------------------------------------------------------

def test_the_settings_model_refuses_credentials_directly() -> None:
    with pytest.raises(ValidationError) as info:
        SchemaRegistrySettings(url="http://u:secret@h:1")
    assert "secret" not in str(info.value)


def test_the_settings_model_is_frozen() -> None:
    s = SchemaRegistrySettings(url="http://h:1")
    with pytest.raises(ValidationError):
        s.username = "x"  # type: ignore[misc]

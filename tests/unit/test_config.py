"""Unit tests for ingest.config: loading, defaults, env overrides, validation messages, secrets."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from harness import REPO_ROOT, write_config

from ingest.config import KafkaSettings, Settings, load_settings
from ingest.errors import ConfigError

EXAMPLE = REPO_ROOT / "config" / "example.yaml"
DSN_PASSWORD = "s3cr3tPW-dsn"
DLQ_DSN_PASSWORD = "s3cr3tPW-dlq"
SASL_PASSWORD = "s3cr3tPW-sasl"
SSL_KEY_PASSWORD = "s3cr3tPW-sslkey"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No INGEST_* variable of the developer's shell may leak into these tests."""
    for name in list(os.environ):
        if name.startswith("INGEST_") and not name.startswith("INGEST_TEST_"):
            monkeypatch.delenv(name, raising=False)


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))


def minimal() -> dict[str, Any]:
    """The smallest valid config: one pipeline, everything else default."""
    return {
        "pipelines": [
            {
                "name": "p1",
                "topics": ["t1"],
                "sink": {
                    "kind": "postgres",
                    "table": "t",
                    "conflict_key": ["id"],
                    "columns": {"id": {"type": "bigint"}, "v": {"type": "text"}},
                },
            }
        ]
    }


def load(tmp_path: Path, data: Any) -> Settings:
    return load_settings(write_config(tmp_path, data))


def sink(data: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return data["pipelines"][i]["sink"]


def error_of(tmp_path: Path, data: Any) -> tuple[str, str]:
    """Load ``data`` expecting a ConfigError; return (message, path of the file)."""
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    return str(info.value), str(path)


# --------------------------------------------------------------------------- happy paths


def test_example_yaml_loads() -> None:
    s = load_settings(EXAMPLE)
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert s.kafka.client == {}
    (p,) = s.pipelines
    assert p.name == "orders"
    assert p.topics == ["orders.v1"]
    assert p.effective_group_id == "ingest-orders"
    assert p.key == "$.order_id"
    assert p.lanes == 4
    assert p.sink.kind == "postgres"
    assert p.sink.table == "orders"
    assert p.sink.db_schema == "public"
    assert p.sink.conflict_key == ["order_id"]
    assert p.sink.on_conflict == "update"
    assert p.sink.version_column == "kafka_offset"
    assert list(p.sink.columns) == ["order_id", "status", "amount", "updated_at", "kafka_offset",
                                    "_ingest_stream", "_ingest_offset"]  # the hidden source columns
    assert p.sink.columns["amount"].type == "numeric(12,2)"
    assert p.sink.columns["order_id"].required is True
    assert p.sink.columns["kafka_offset"].source == "@offset"
    assert p.dlq.kind == "postgres"
    assert p.dlq.table == "ingest_dlq"
    assert s.pipeline("orders") is p


def test_defaults(tmp_path: Path) -> None:
    s = load(tmp_path, minimal())
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert s.kafka.client == {}
    assert s.kafka.consume_batch_size == 5000
    assert s.kafka.poll_timeout_ms == 100
    (p,) = s.pipelines
    assert p.group_id is None
    assert p.effective_group_id == "ingest-p1"
    assert p.format == "json"
    assert p.key is None
    assert p.lanes == 1
    assert p.priority == 0
    assert p.unkeyed == "round_robin"
    assert p.effective_tombstones == "dlq" and p.envelope == "none" and not p.has_deletes
    assert (p.batch.max_rows, p.batch.max_bytes, p.batch.max_latency_ms) == (5000, 8 * 1024 * 1024, 500)
    assert (p.retry.max_attempts, p.retry.initial_backoff_ms, p.retry.max_backoff_ms) == (10, 100, 30_000)
    assert p.sink.kind == "postgres"
    assert p.sink.db_schema == "public"
    assert p.sink.on_conflict == "update"
    assert p.sink.version_column is None
    assert p.sink.write_method == "copy"
    assert p.sink.column_source("v") == "$.v"
    assert p.dlq.kind == "postgres"
    assert p.dlq.table == "ingest_dlq"
    assert p.dlq.dsn is None
    assert p.dlq.max_ratio == 0.5
    assert p.dlq.max_consecutive == 1000


def test_sink_kind_defaults_to_postgres(tmp_path: Path) -> None:
    # PostgresSink declares ``kind = "postgres"`` as its default, so a sink without ``kind`` is a PostgreSQL sink.
    data = minimal()
    sink(data).pop("kind")
    p = load(tmp_path, data).pipelines[0]
    assert p.sink.kind == "postgres"
    assert p.sink.table == "t"


def test_explicit_group_id_wins(tmp_path: Path) -> None:
    data = minimal()
    data["pipelines"][0]["group_id"] = "custom-group"
    assert load(tmp_path, data).pipelines[0].effective_group_id == "custom-group"


def test_partial_batch_keeps_other_defaults(tmp_path: Path) -> None:
    data = minimal()
    data["pipelines"][0]["batch"] = {"max_rows": 7}
    data["pipelines"][0]["retry"] = {"max_attempts": 0}
    p = load(tmp_path, data).pipelines[0]
    assert (p.batch.max_rows, p.batch.max_bytes, p.batch.max_latency_ms) == (7, 8 * 1024 * 1024, 500)
    assert (p.retry.max_attempts, p.retry.initial_backoff_ms, p.retry.max_backoff_ms) == (0, 100, 30_000)


def test_settings_are_frozen(tmp_path: Path) -> None:
    s = load(tmp_path, minimal())
    with pytest.raises(Exception):
        s.kafka.bootstrap_servers = "elsewhere:9092"  # type: ignore[misc]
    with pytest.raises(Exception):
        s.pipelines[0].lanes = 3  # type: ignore[misc]


def test_unknown_pipeline_name_lookup(tmp_path: Path) -> None:
    s = load(tmp_path, minimal())
    with pytest.raises(ConfigError, match="nope"):
        s.pipeline("nope")


# --------------------------------------------------------------------------- env overrides


def test_env_overrides_bootstrap_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = example()
    data["kafka"]["bootstrap_servers"] = "yaml-host:9092"
    path = write_config(tmp_path, data)
    assert load_settings(path).kafka.bootstrap_servers == "yaml-host:9092"
    monkeypatch.setenv("INGEST_KAFKA__BOOTSTRAP_SERVERS", "env-host:19092")
    s = load_settings(path)
    assert s.kafka.bootstrap_servers == "env-host:19092"
    assert s.kafka.client_config()["bootstrap.servers"] == "env-host:19092"
    # The rest of the file still applies.
    assert s.pipelines[0].name == "orders"
    assert s.pipelines[0].lanes == 4


def test_env_overrides_kafka_client_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = example()
    data["kafka"]["client"] = {"security.protocol": "PLAINTEXT", "session.timeout.ms": 10000}
    path = write_config(tmp_path, data)
    monkeypatch.setenv(
        "INGEST_KAFKA__CLIENT",
        json.dumps({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "session.timeout.ms": 45000}),
    )
    s = load_settings(path)
    assert s.kafka.client["security.protocol"] == "SASL_SSL"
    assert s.kafka.client["sasl.mechanism"] == "PLAIN"
    assert s.kafka.client["session.timeout.ms"] == 45000
    cfg = s.kafka.client_config()
    assert cfg["security.protocol"] == "SASL_SSL"
    assert cfg["bootstrap.servers"] == "127.0.0.1:9092"


def test_env_override_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, example())
    monkeypatch.setenv("INGEST_KAFKA__CONSUME_BATCH_SIZE", "not-a-number")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(path) in str(info.value)
    assert "kafka.consume_batch_size" in str(info.value)


def test_ingest_config_env_used_without_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = minimal()
    data["pipelines"][0]["name"] = "from-env-file"
    path = write_config(tmp_path, data)
    monkeypatch.setenv("INGEST_CONFIG", str(path))
    s = load_settings()
    assert [p.name for p in s.pipelines] == ["from-env-file"]
    # An explicit path beats INGEST_CONFIG.
    assert [p.name for p in load_settings(EXAMPLE).pipelines] == ["orders"]


def test_no_path_and_no_env_var() -> None:
    with pytest.raises(ConfigError, match="INGEST_CONFIG"):
        load_settings()


# --------------------------------------------------------------------------- invalid configs

Mutation = Callable[[dict[str, Any]], Any]


def _append_duplicate(d: dict[str, Any]) -> None:
    d["pipelines"].append(copy.deepcopy(d["pipelines"][0]))


def _set(obj: dict[str, Any], **kw: Any) -> None:
    obj.update(kw)


# (id, mutation of example.yaml, field path the message must name, regex for the problem)
INVALID: list[tuple[str, Mutation, str, str]] = [
    ("unknown-top-level-key", lambda d: _set(d, bogus_section=1), "bogus_section", r"unknown key"),
    ("unknown-kafka-key", lambda d: _set(d["kafka"], bootstrap="x:1"), "kafka.bootstrap", r"unknown key"),
    ("unknown-pipeline-key", lambda d: _set(d["pipelines"][0], lane=2), "pipelines[0](orders).lane", r"unknown key"),
    ("unknown-sink-key", lambda d: _set(sink(d), tabel="x"), "pipelines[0](orders).sink.tabel", r"unknown key"),
    (
        "unknown-column-key",
        lambda d: _set(sink(d)["columns"]["status"], nullable=True),
        "pipelines[0](orders).sink.columns.status.nullable",
        r"unknown key",
    ),
    ("wrong-type-lanes", lambda d: _set(d["pipelines"][0], lanes="abc"), "pipelines[0](orders).lanes", r"integer"),
    ("lanes-out-of-range", lambda d: _set(d["pipelines"][0], lanes=0), "pipelines[0](orders).lanes", r"1"),
    ("missing-sink-table", lambda d: sink(d).pop("table"), "pipelines[0](orders).sink.table", r"required field missing"),
    ("missing-pipelines", lambda d: d.pop("pipelines"), "pipelines", r"required field missing"),
    ("empty-pipelines", lambda d: _set(d, pipelines=[]), "pipelines", r"at least 1"),
    ("missing-topics", lambda d: d["pipelines"][0].pop("topics"), "pipelines[0](orders).topics", r"required field missing"),
    (
        "unsupported-column-type",
        lambda d: _set(sink(d)["columns"]["status"], type="money"),
        "pipelines[0](orders).sink.columns",
        r"status.*unsupported column type 'money'",
    ),
    (
        "type-modifier-not-allowed",
        lambda d: _set(sink(d)["columns"]["status"], type="text(5)"),
        "pipelines[0](orders).sink.columns",
        r"status.*modifier",
    ),
    ("duplicate-pipeline-name", _append_duplicate, "pipelines", r"duplicate pipeline name 'orders'"),
    (
        "conflict-key-not-a-column",
        lambda d: _set(sink(d), conflict_key=["order_no"]),
        "pipelines[0](orders).sink",
        r"conflict_key.*order_no.*not among columns",
    ),
    (
        "version-column-not-a-column",
        lambda d: _set(sink(d), version_column="kafka_offs"),
        "pipelines[0](orders).sink",
        r"version_column.*kafka_offs.*not among columns",
    ),
    (
        "update-without-conflict-key",
        lambda d: (sink(d).pop("conflict_key"), sink(d).pop("version_column")),
        "pipelines[0](orders).sink",
        r"conflict_key is required",
    ),
    (
        "nothing-without-conflict-key",
        lambda d: (_set(sink(d), on_conflict="nothing", conflict_key=[])),
        "pipelines[0](orders).sink",
        r"conflict_key is required",
    ),
    (
        "bad-on-conflict",
        lambda d: _set(sink(d), on_conflict="merge"),
        "pipelines[0](orders).sink.on_conflict",
        r"update.*nothing.*none",
    ),
    (
        "bad-source-path",
        lambda d: _set(sink(d)["columns"]["status"], source="status"),
        "pipelines[0](orders).sink.columns.status.source",
        r"invalid source 'status'",
    ),
    (
        "bad-metadata-source",
        lambda d: _set(sink(d)["columns"]["status"], source="@partitionx"),
        "pipelines[0](orders).sink.columns.status.source",
        r"invalid source '@partitionx'",
    ),
    ("bad-key-path", lambda d: _set(d["pipelines"][0], key="order_id"), "pipelines[0](orders).key", r"invalid key path"),
    (
        "kafka-dlq-without-topic",
        lambda d: _set(d["pipelines"][0], dlq={"kind": "kafka"}),
        "pipelines[0](orders).dlq",
        r"dlq.topic is required",
    ),
    ("bad-pipeline-name", lambda d: _set(d["pipelines"][0], name="has space"), "pipelines[0](has space).name", r"pattern"),
    ("bad-sink-kind", lambda d: _set(sink(d), kind="mysql"), "pipelines[0](orders).sink", r"postgres.*clickhouse"),
    ("empty-columns", lambda d: _set(sink(d), columns={}), "pipelines[0](orders).sink.columns", r"at least one column"),
    ("table-name-too-long", lambda d: _set(sink(d), table="x" * 64), "pipelines[0](orders).sink.table", r"1-63 bytes"),
]


@pytest.mark.parametrize(("mutate", "field", "problem"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_names_file_field_and_problem(
    tmp_path: Path, mutate: Mutation, field: str, problem: str
) -> None:
    data = example()
    mutate(data)
    message, path = error_of(tmp_path, data)
    assert path in message, message
    lines = message.splitlines()
    assert lines[0] == f"invalid config {path}:", message
    # One line names the field path and states the problem.
    assert any(
        line.strip().startswith(f"{field}:") and re.search(problem, line) for line in lines[1:]
    ), f"expected a line '{field}: ...{problem}...' in:\n{message}"


def test_every_bad_field_is_reported(tmp_path: Path) -> None:
    data = example()
    data["pipelines"][0]["lanes"] = "abc"
    data["pipelines"][0]["sink"]["columns"]["status"]["extra"] = 1
    data["surprise"] = True
    message, path = error_of(tmp_path, data)
    assert path in message
    assert "pipelines[0](orders).lanes" in message
    assert "pipelines[0](orders).sink.columns.status.extra: unknown key" in message
    assert "surprise: unknown key" in message


def test_second_pipeline_error_names_that_pipeline(tmp_path: Path) -> None:
    data = example()
    second = copy.deepcopy(data["pipelines"][0])
    second["name"] = "refunds"
    second["sink"]["columns"]["status"]["type"] = "varchar(x)"
    data["pipelines"].append(second)
    message, path = error_of(tmp_path, data)
    assert path in message
    assert "pipelines[1](refunds).sink.columns" in message
    assert "unsupported column type 'varchar(x)'" in message
    assert "pipelines[0](orders)" not in message


def test_on_conflict_none_without_key_is_ok(tmp_path: Path) -> None:
    data = example()
    s_ = sink(data)
    s_.pop("conflict_key")
    s_.pop("version_column")
    s_["on_conflict"] = "none"
    s = load(tmp_path, data)
    assert s.pipelines[0].sink.on_conflict == "none"
    assert s.pipelines[0].sink.conflict_key == []


def test_type_aliases_and_modifiers_accepted(tmp_path: Path) -> None:
    data = minimal()
    sink(data)["columns"] = {
        "id": {"type": "int8"},
        "a": {"type": "varchar(64)"},
        "b": {"type": "Timestamp With Time Zone"},
        "c": {"type": "decimal(10, 2)"},
        "d": {"type": "double precision"},
        "e": {"type": "jsonb", "source": "$.payload.items[0]"},
        "f": {"type": "text", "source": "@header.trace-id"},
    }
    cols = load(tmp_path, data).pipelines[0].sink.columns
    assert cols["e"].source == "$.payload.items[0]"
    assert cols["f"].source == "@header.trace-id"


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("pipelines: [\n  - name: x\n    topics: [a\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(path) in str(info.value)
    assert "not valid YAML" in str(info.value)


def test_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(path) in str(info.value)
    assert "not found" in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "", "42\n"], ids=["list", "scalar", "empty", "int"])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "toplevel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(path) in str(info.value)
    assert "top level must be a mapping" in str(info.value)


# --------------------------------------------------------------------------- secrets


def _secret_config() -> dict[str, Any]:
    data = example()
    data["kafka"]["client"] = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "svc-user",
        "sasl.password": SASL_PASSWORD,
        "ssl.key.password": SSL_KEY_PASSWORD,
    }
    sink(data)["dsn"] = f"postgresql://postgres:{DSN_PASSWORD}@db.example:5432/app"
    data["pipelines"][0]["dlq"] = {"kind": "postgres", "dsn": f"postgresql://dlq:{DLQ_DSN_PASSWORD}@db2:5432/dlq"}
    return data


SECRETS = (DSN_PASSWORD, DLQ_DSN_PASSWORD, SASL_PASSWORD, SSL_KEY_PASSWORD)


def _assert_no_secret(text: str, what: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{what} leaks {secret!r}:\n{text}"


def test_secrets_are_usable(tmp_path: Path) -> None:
    s = load(tmp_path, _secret_config())
    assert DSN_PASSWORD in s.pipelines[0].sink.dsn.get_secret_value()
    assert DLQ_DSN_PASSWORD in s.pipelines[0].dlq.dsn.get_secret_value()
    cfg = s.kafka.client_config()
    assert cfg["sasl.password"] == SASL_PASSWORD
    assert cfg["ssl.key.password"] == SSL_KEY_PASSWORD
    assert cfg["sasl.username"] == "svc-user"


def test_secrets_not_in_repr_or_str(tmp_path: Path) -> None:
    s = load(tmp_path, _secret_config())
    for what, text in [
        ("repr(settings)", repr(s)),
        ("str(settings)", str(s)),
        ("repr(kafka)", repr(s.kafka)),
        ("str(kafka)", str(s.kafka)),
        ("repr(pipeline)", repr(s.pipelines[0])),
        ("str(sink)", str(s.pipelines[0].sink)),
        ("f-string", f"{s}"),
    ]:
        _assert_no_secret(text, what)
    # Non-secret client settings stay visible.
    assert "svc-user" in repr(s.kafka)
    assert "SASL_SSL" in repr(s)


def test_secrets_not_in_model_dump_json(tmp_path: Path) -> None:
    s = load(tmp_path, _secret_config())
    _assert_no_secret(s.model_dump_json(), "settings.model_dump_json()")
    _assert_no_secret(s.kafka.model_dump_json(), "kafka.model_dump_json()")
    _assert_no_secret(s.pipelines[0].model_dump_json(), "pipeline.model_dump_json()")


def test_kafka_client_secret_keys_masked() -> None:
    k = KafkaSettings(
        client={
            "sasl.password": SASL_PASSWORD,
            "ssl.key.password": SSL_KEY_PASSWORD,
            "sasl.oauthbearer.config": "principal=x clientSecret=s3cr3tPW-oauth",
            "sasl.oauthbearer.client.secret": "s3cr3tPW-client-secret",
            "ssl.key.pem": "-----BEGIN PRIVATE KEY----- s3cr3tPW-pem",
            "security.protocol": "SASL_SSL",
        }
    )
    redacted = k.redacted_client()
    assert redacted["security.protocol"] == "SASL_SSL"
    for key in ("sasl.password", "ssl.key.password", "sasl.oauthbearer.config",
                "sasl.oauthbearer.client.secret", "ssl.key.pem"):
        assert redacted[key] == "**********", key
    for text in (repr(k), str(k), k.model_dump_json()):
        assert "s3cr3tPW" not in text, text


def test_env_supplied_secret_not_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, example())
    monkeypatch.setenv("INGEST_KAFKA__CLIENT", json.dumps({"sasl.password": SASL_PASSWORD}))
    s = load_settings(path)
    assert s.kafka.client_config()["sasl.password"] == SASL_PASSWORD
    _assert_no_secret(repr(s), "repr(settings)")
    _assert_no_secret(str(s), "str(settings)")
    _assert_no_secret(s.model_dump_json(), "settings.model_dump_json()")


def test_config_error_does_not_echo_secret_values(tmp_path: Path) -> None:
    data = _secret_config()
    data["pipelines"][0]["lanes"] = "abc"
    sink(data)["columns"]["status"]["type"] = "money"
    message, _ = error_of(tmp_path, data)
    _assert_no_secret(message, "ConfigError message")


def test_version_column_is_required_unless_it_has_a_default() -> None:
    from ingest.sinks.postgres.settings import PostgresSinkSettings as PostgresSink

    base = {"table": "t", "conflict_key": ["id"], "version_column": "v"}
    plain = PostgresSink.model_validate({**base, "columns": {"id": {"type": "bigint"}, "v": {"type": "bigint"}}})
    assert plain.columns["v"].required is True
    with_default = PostgresSink.model_validate(
        {**base, "columns": {"id": {"type": "bigint"}, "v": {"type": "bigint", "default": 0}}})
    assert with_default.columns["v"].required is False
    assert plain.collapse_rule().version_index == 1 and plain.collapse_rule().key_index == (0,)
    nothing = PostgresSink.model_validate({**base, "on_conflict": "nothing",
                                           "columns": {"id": {"type": "bigint"}, "v": {"type": "bigint"}}})
    assert nothing.collapse_rule().keep == "first"

"""SchemaStore (ingest/formats/schemas.py): the one place Schema Registry answers are classified.

Pure logic: a scripted fake client stands in for confluent-kafka's ``SchemaRegistryClient`` (the real
client against a registry is covered by the integration tests). What is checked is the classification
-- found / unknown / unusable / unavailable / empty registry -- and what is remembered.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError

from ingest.config.formats import SchemaRegistrySettings
from ingest.errors import FatalPipelineError, InvalidRecord, TransientError
from ingest.formats import schemas
from ingest.formats.schemas import UNKNOWN_TTL_S, SchemaStore

try:  # the transport confluent-kafka's client uses (httpx2 when installed, else httpx)
    from confluent_kafka.schema_registry.common._httpx_compat import httpx

    CONNECT_ERROR: Exception = httpx.ConnectError("[Errno 111] Connection refused")
except Exception:  # noqa: BLE001 - any exception without http_status_code is a transport failure
    CONNECT_ERROR = ConnectionRefusedError(111, "Connection refused")

URL = "http://127.0.0.1:1"
GUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

NOT_FOUND_SCHEMA = SchemaRegistryError(404, 40403, "Schema not found")


class FakeSchema:
    def __init__(self, text: str) -> None:
        self.schema_str = text
        self.schema_type = "AVRO"
        self.references: list[Any] = []


class FakeClient:
    """Answers scripted per call: ``answers[ref]`` is a list of schemas or exceptions, used in order (the
    last one repeats). Records every call. Its methods take the arguments of confluent-kafka's
    ``SchemaRegistryClient`` methods, under the same names."""

    def __init__(self, answers: dict[Any, list[Any]] | None = None, subjects: list[str] | Exception | None = None,
                 latest: dict[str, Any] | None = None, versions: dict[tuple[str, int], Any] | None = None) -> None:
        self.answers = answers or {}
        self.subject_list = ["t-value"] if subjects is None else subjects
        self.latest_by_subject = latest or {}
        self.versions = versions or {}
        self.calls: list[tuple[Any, ...]] = []

    def _answer(self, ref: Any) -> Any:
        queue = self.answers.get(ref, [NOT_FOUND_SCHEMA])
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def get_schema(self, schema_id: int, subject_name: str | None = None, fmt: str | None = None,
                   reference_format: str | None = None) -> Any:
        self.calls.append(("get_schema", schema_id, fmt))
        return self._answer(schema_id)

    def get_schema_by_guid(self, guid: str, fmt: str | None = None) -> Any:
        self.calls.append(("get_schema_by_guid", guid, fmt))
        return self._answer(guid)

    def get_subjects(self, subject_prefix: str | None = None, deleted: bool = False, deleted_only: bool = False,
                     offset: int = 0, limit: int = -1) -> list[str]:
        self.calls.append(("get_subjects",))
        if isinstance(self.subject_list, Exception):
            raise self.subject_list
        return self.subject_list

    def get_latest_version(self, subject_name: str, fmt: str | None = None) -> Any:
        self.calls.append(("get_latest_version", subject_name))
        answer = self.latest_by_subject.get(subject_name, SchemaRegistryError(404, 40401, "Subject not found"))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def get_version(self, subject_name: str, version: Any = "latest", deleted: bool = False,
                    fmt: str | None = None) -> Any:
        self.calls.append(("get_version", subject_name, version, fmt))
        answer = self.versions.get((subject_name, version), SchemaRegistryError(404, 40402, "Version not found"))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def lookups(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] in ("get_schema", "get_schema_by_guid")]


class Parse:
    """A parse function that counts its calls; raises ``error`` when set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[Any] = []

    def __call__(self, schema: Any, store: SchemaStore) -> Any:
        self.calls.append(schema)
        if self.error is not None:
            raise self.error
        return ("parsed", schema.schema_str)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(schemas.time, "monotonic", c)
    return c


def store_of(client: FakeClient, parse: Parse | None = None, *, url: Any = URL, fmt: str | None = None) -> SchemaStore:
    return SchemaStore(SchemaRegistrySettings(url=url), parse or Parse(), fmt=fmt, client=client)


# -- found --------------------------------------------------------------------------------------------

def test_a_found_schema_is_parsed_once_and_kept() -> None:
    schema = FakeSchema('"string"')
    client = FakeClient({7: [schema]})
    parse = Parse()
    store = store_of(client, parse)
    assert store.get(7) == ("parsed", '"string"')
    assert parse.calls == [schema]
    assert client.lookups() == [("get_schema", 7, None)]
    assert store.get(7) == ("parsed", '"string"')
    assert store.get(7) is store.get(7)
    assert parse.calls == [schema]  # parsed once
    assert client.lookups() == [("get_schema", 7, None)]  # no second request
    assert store.parsed == {7: ("parsed", '"string"')}


def test_fmt_is_passed_to_the_client() -> None:
    client = FakeClient({3: [FakeSchema("x")], GUID: [FakeSchema("y")]})
    store = store_of(client, fmt="serialized")
    store.get(3)
    store.get(GUID)
    assert client.lookups() == [("get_schema", 3, "serialized"), ("get_schema_by_guid", GUID, "serialized")]


def test_a_guid_is_looked_up_by_guid() -> None:
    client = FakeClient({GUID: [FakeSchema("by-guid")]})
    store = store_of(client)
    assert store.get(GUID) == ("parsed", "by-guid")
    assert client.lookups() == [("get_schema_by_guid", GUID, None)]
    store.get(GUID)
    assert len(client.lookups()) == 1


def test_an_id_and_a_guid_are_kept_apart() -> None:
    client = FakeClient({5: [FakeSchema("int-five")], "5": [FakeSchema("str-five")]})
    store = store_of(client)
    assert store.get(5) == ("parsed", "int-five")
    assert store.get("5") == ("parsed", "str-five")
    assert client.lookups() == [("get_schema", 5, None), ("get_schema_by_guid", "5", None)]


def test_a_found_schema_never_expires(clock: Clock) -> None:
    client = FakeClient({7: [FakeSchema("s")]})
    store = store_of(client)
    store.get(7)
    clock.now += 10 * 365 * 24 * 3600.0
    store.get(7)
    assert len(client.lookups()) == 1


# -- not found: unknown_schema ------------------------------------------------------------------------

def test_an_unknown_id_is_poison_naming_the_schema_id_and_the_url(clock: Clock) -> None:
    client = FakeClient({}, subjects=["t-value"])
    store = store_of(client)
    with pytest.raises(InvalidRecord) as info:
        store.get(42)
    assert (info.value.stage, info.value.error_class) == ("decode", "unknown_schema")
    assert "schema id 42" in info.value.message
    assert URL in info.value.message


def test_an_unknown_guid_names_the_guid(clock: Clock) -> None:
    store = store_of(FakeClient({}))
    with pytest.raises(InvalidRecord) as info:
        store.get(GUID)
    assert info.value.error_class == "unknown_schema"
    assert f"schema guid {GUID}" in info.value.message


def test_an_unknown_id_is_remembered_for_the_ttl_then_asked_again(clock: Clock) -> None:
    client = FakeClient({42: [NOT_FOUND_SCHEMA, FakeSchema("registered later")]})
    store = store_of(client)
    with pytest.raises(InvalidRecord):
        store.get(42)
    assert len(client.lookups()) == 1
    clock.now += UNKNOWN_TTL_S - 0.5
    with pytest.raises(InvalidRecord) as again:
        store.get(42)
    assert again.value.error_class == "unknown_schema"
    assert len(client.lookups()) == 1  # remembered: no second request within the TTL
    clock.now += 1.0  # past the TTL
    assert store.get(42) == ("parsed", "registered later")  # a schema registered later is found
    assert len(client.lookups()) == 2


def test_an_unknown_id_asked_again_after_the_ttl_is_still_unknown_and_remembered_again(clock: Clock) -> None:
    client = FakeClient({42: [NOT_FOUND_SCHEMA]})
    store = store_of(client)
    with pytest.raises(InvalidRecord):
        store.get(42)
    clock.now += UNKNOWN_TTL_S + 1
    with pytest.raises(InvalidRecord):
        store.get(42)
    assert len(client.lookups()) == 2
    clock.now += 1
    with pytest.raises(InvalidRecord):
        store.get(42)
    assert len(client.lookups()) == 2


def test_the_ttl_is_positive() -> None:
    assert UNKNOWN_TTL_S > 0


# -- an empty registry: fatal, nothing dead-lettered ---------------------------------------------------

def test_unknown_in_a_registry_with_no_subjects_is_fatal(clock: Clock) -> None:
    client = FakeClient({}, subjects=[])
    store = store_of(client)
    with pytest.raises(FatalPipelineError) as info:
        store.get(1)
    assert not isinstance(info.value, InvalidRecord)
    assert URL in str(info.value)
    assert "schema id 1" in str(info.value)
    assert ("get_subjects",) in client.calls


def test_unknown_after_a_schema_was_found_once_is_poison_even_with_no_subjects(clock: Clock) -> None:
    client = FakeClient({1: [FakeSchema("one")]}, subjects=[])
    store = store_of(client)
    store.get(1)
    with pytest.raises(InvalidRecord) as info:
        store.get(2)
    assert info.value.error_class == "unknown_schema"
    assert "schema id 2" in info.value.message


def test_the_subjects_list_failing_is_transient_not_poison(clock: Clock) -> None:
    client = FakeClient({}, subjects=SchemaRegistryError(503, 50300, "unavailable"))
    store = store_of(client)
    with pytest.raises(TransientError) as info:
        store.get(1)
    assert info.value.error_class == "schema_registry_unavailable"
    # not remembered as poison: the next get asks again
    with pytest.raises(TransientError):
        store.get(1)
    assert len(client.lookups()) == 2


# -- unavailable: transient -----------------------------------------------------------------------------

@pytest.mark.parametrize("status,error_code", [(503, 50301), (500, 50001), (401, 40101), (403, 40301),
                                               (429, 42901), (408, -1), (502, -1)])
def test_an_unavailable_registry_is_transient_naming_the_url_and_the_status(status: int, error_code: int) -> None:
    client = FakeClient({7: [SchemaRegistryError(status, error_code, "nope")]})
    store = store_of(client)
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert info.value.error_class == "schema_registry_unavailable"
    message = str(info.value)
    assert URL in message
    assert f"HTTP {status}" in message
    assert "schema id 7" in message


@pytest.mark.parametrize("status", [401, 403])
def test_refused_credentials_say_authentication(status: int) -> None:
    store = store_of(FakeClient({7: [SchemaRegistryError(status, -1, "Unauthorized")]}))
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert "authentication" in str(info.value)


def test_a_404_without_a_registry_error_code_is_transient_not_unknown() -> None:
    client = FakeClient({7: [SchemaRegistryError(404, -1, "Not Found")]}, subjects=[])
    store = store_of(client)
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert info.value.error_class == "schema_registry_unavailable"
    assert "HTTP 404" in str(info.value) and URL in str(info.value)
    assert ("get_subjects",) not in client.calls  # not taken for "not found"


def test_a_connection_error_is_transient_naming_the_url_and_the_error() -> None:
    store = store_of(FakeClient({7: [CONNECT_ERROR]}))
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert info.value.error_class == "schema_registry_unavailable"
    message = str(info.value)
    assert URL in message
    assert type(CONNECT_ERROR).__name__ in message
    assert "Connection refused" in message


def test_a_transient_answer_is_not_remembered() -> None:
    client = FakeClient({7: [SchemaRegistryError(503, 50301, "busy"), FakeSchema("back")]})
    store = store_of(client)
    with pytest.raises(TransientError):
        store.get(7)
    assert store.get(7) == ("parsed", "back")
    assert len(client.lookups()) == 2


def test_several_urls_are_all_named() -> None:
    client = FakeClient({7: [SchemaRegistryError(503, 50301, "busy")]})
    store = store_of(client, url="http://a:1,http://b:2")
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert "http://a:1" in str(info.value) and "http://b:2" in str(info.value)


def test_a_long_transport_message_is_cut() -> None:
    store = store_of(FakeClient({7: [ConnectionError("x" * 5000)]}))
    with pytest.raises(TransientError) as info:
        store.get(7)
    assert len(str(info.value)) < 600


# -- a schema the format cannot use: schema_mismatch, remembered forever ---------------------------------

def test_an_unusable_schema_is_schema_mismatch_and_remembered_forever(clock: Clock) -> None:
    client = FakeClient({9: [FakeSchema("{not avro")]})
    parse = Parse(ValueError("not a valid Avro schema: boom"))
    store = store_of(client, parse)
    with pytest.raises(InvalidRecord) as info:
        store.get(9)
    assert (info.value.stage, info.value.error_class) == ("decode", "schema_mismatch")
    assert "schema id 9" in info.value.message and "boom" in info.value.message
    clock.now += 1e9  # far past any TTL
    with pytest.raises(InvalidRecord) as again:
        store.get(9)
    assert again.value.error_class == "schema_mismatch"
    assert len(client.lookups()) == 1 and len(parse.calls) == 1
    assert 9 not in store.parsed


def test_a_schema_mismatch_message_is_bounded() -> None:
    store = store_of(FakeClient({9: [FakeSchema("x")]}), Parse(ValueError("y" * 5000)))
    with pytest.raises(InvalidRecord) as info:
        store.get(9)
    assert len(info.value.message) <= 400


def test_an_unusable_schema_does_not_count_as_found(clock: Clock) -> None:
    """Only a parsed schema proves the registry is the right one: after a mismatch, an unknown id in a
    registry with no subjects is still fatal."""
    client = FakeClient({9: [FakeSchema("x")]}, subjects=[])
    store = store_of(client, Parse(ValueError("bad")))
    with pytest.raises(InvalidRecord):
        store.get(9)
    with pytest.raises(FatalPipelineError):
        store.get(10)


# -- resolve ----------------------------------------------------------------------------------------------

def test_resolve_fetches_the_unknown_refs_once(clock: Clock) -> None:
    client = FakeClient({1: [FakeSchema("a")], 2: [FakeSchema("b")], GUID: [FakeSchema("g")]})
    store = store_of(client)
    store.get(1)
    store.resolve([1, 2, 2, GUID])
    assert client.lookups() == [("get_schema", 1, None), ("get_schema", 2, None),
                                ("get_schema_by_guid", GUID, None)]
    assert set(store.parsed) == {1, 2, GUID}


def test_resolve_swallows_poison_and_leaves_it_for_the_records_decode(clock: Clock) -> None:
    client = FakeClient({1: [FakeSchema("a")], 3: [FakeSchema("bad")]})

    def parse(schema: Any, store: SchemaStore) -> Any:
        if schema.schema_str == "bad":
            raise ValueError("unusable")
        return schema.schema_str

    store = SchemaStore(SchemaRegistrySettings(url=URL), parse, client=client)
    store.resolve([1, 2, 3])  # 2 unknown, 3 unusable: no exception
    assert store.parsed == {1: "a"}
    n = len(client.lookups())
    with pytest.raises(InvalidRecord) as unknown:
        store.get(2)
    with pytest.raises(InvalidRecord) as mismatch:
        store.get(3)
    assert (unknown.value.error_class, mismatch.value.error_class) == ("unknown_schema", "schema_mismatch")
    assert len(client.lookups()) == n  # both remembered by resolve


def test_resolve_raises_transient() -> None:
    client = FakeClient({1: [FakeSchema("a")], 2: [SchemaRegistryError(503, 50301, "busy")]})
    store = store_of(client)
    with pytest.raises(TransientError) as info:
        store.resolve([1, 2])
    assert info.value.error_class == "schema_registry_unavailable"
    assert 1 in store.parsed


def test_resolve_raises_fatal_for_an_empty_registry() -> None:
    store = store_of(FakeClient({}, subjects=[]))
    with pytest.raises(FatalPipelineError):
        store.resolve([1])


# -- latest, referenced, subjects ---------------------------------------------------------------------------

def test_latest_is_none_for_a_subject_that_does_not_exist() -> None:
    client = FakeClient()
    store = store_of(client)
    assert store.latest("missing-value") is None
    assert ("get_latest_version", "missing-value") in client.calls


def test_latest_returns_the_registered_schema() -> None:
    registered = object()
    store = store_of(FakeClient(latest={"t-value": registered}))
    assert store.latest("t-value") is registered


@pytest.mark.parametrize("exc", [SchemaRegistryError(503, 50301, "busy"), SchemaRegistryError(404, -1, "?"),
                                 CONNECT_ERROR])
def test_latest_is_transient_when_the_registry_cannot_answer(exc: Exception) -> None:
    store = store_of(FakeClient(latest={"t-value": exc}))
    with pytest.raises(TransientError) as info:
        store.latest("t-value")
    assert info.value.error_class == "schema_registry_unavailable"
    assert "t-value" in str(info.value) and URL in str(info.value)


def test_referenced_returns_the_versions_schema() -> None:
    schema = FakeSchema("ref")

    class Registered:
        def __init__(self, s: Any) -> None:
            self.schema = s

    client = FakeClient(versions={("other-value", 3): Registered(schema)})
    store = store_of(client, fmt="serialized")
    assert store.referenced("other-value", 3) is schema
    assert client.calls == [("get_version", "other-value", 3, "serialized")]


@pytest.mark.parametrize("exc", [SchemaRegistryError(503, 50301, "busy"), CONNECT_ERROR])
def test_referenced_is_transient_naming_the_subject_and_version_when_the_registry_cannot_answer(
        exc: Exception) -> None:
    store = store_of(FakeClient(versions={("other-value", 3): exc}))
    with pytest.raises(TransientError) as info:
        store.referenced("other-value", 3)
    assert info.value.error_class == "schema_registry_unavailable"
    assert "other-value" in str(info.value) and "version 3" in str(info.value) and URL in str(info.value)


def test_subjects_lists_them_and_is_transient_on_failure() -> None:
    assert store_of(FakeClient(subjects=["a", "b"])).subjects() == ["a", "b"]
    with pytest.raises(TransientError):
        store_of(FakeClient(subjects=CONNECT_ERROR)).subjects()


# -- a referenced schema the registry does not have -------------------------------------------------------
#
# The registry's own "not found" for a referenced schema (40401 subject / 40402 version) is an answer,
# not an outage: the referencing schema cannot be used (schema_mismatch), and the message says why.

@pytest.mark.parametrize("error_code", [40401, 40402])
def test_a_missing_reference_is_not_reported_as_a_404_without_an_error_code(error_code: int) -> None:
    store = store_of(FakeClient(versions={("other-value", 3): SchemaRegistryError(404, error_code, "not found")}))
    with pytest.raises(Exception) as info:  # whichever class, the text must be true
        store.referenced("other-value", 3)
    assert "without a Schema Registry error code" not in str(info.value)
    assert "other-value" in str(info.value) and "version 3" in str(info.value)


def test_a_schema_whose_reference_the_registry_does_not_have_is_schema_mismatch(clock: Clock) -> None:
    class WithReference(FakeSchema):
        def __init__(self) -> None:
            super().__init__('{"type": "record", "name": "Order", "fields": [{"name": "c", "type": "Customer"}]}')
            self.references = [type("Ref", (), {"name": "Customer", "subject": "customer-value", "version": 1})()]

    def parse(schema: Any, store: SchemaStore) -> Any:  # as ingest.formats.avro.parse_avro does
        return [store.referenced(ref.subject, ref.version) for ref in schema.references]

    client = FakeClient({7: [WithReference()]}, versions={("customer-value", 1): SchemaRegistryError(
        404, 40402, "Version 1 not found.")})
    store = SchemaStore(SchemaRegistrySettings(url=URL), parse, client=client)
    with pytest.raises(InvalidRecord) as info:
        store.get(7)
    assert (info.value.stage, info.value.error_class) == ("decode", "schema_mismatch")
    assert "customer-value" in info.value.message

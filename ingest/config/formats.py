"""The settings of the Schema Registry that registry-backed formats (``avro``, ``json_schema``,
``protobuf``) look schemas up in: one top-level ``schema_registry`` section shared by every pipeline.

The client is confluent-kafka's own ``SchemaRegistryClient``; :meth:`SchemaRegistrySettings.client_config`
is the configuration it takes. Secrets (the basic-auth password, the TLS key password) are
:class:`~pydantic.SecretStr`; a URL may not carry credentials (``user:pass@host``), so that no
URL printed in a log or an error can hold one.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from ingest.config.base import Frozen


class SchemaRegistrySettings(Frozen):
    """Where schemas are looked up, how to authenticate, and how long answers are cached."""

    #: One or several base URLs (``http(s)://host:port``), tried in order.
    url: list[str] = Field(min_length=1)
    #: Basic auth user name and password (the Registry's ``basic.auth.user.info``).
    username: str | None = None
    password: SecretStr | None = None
    #: TLS: a CA bundle file or directory to verify the Registry with; a client certificate and key.
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    #: Seconds one HTTP request may take before it counts as a (transient) failure.
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    #: Schemas kept in the client's cache (schemas by id never change, so they never expire).
    cache_capacity: int = Field(default=1000, ge=1)
    #: Seconds ``ingest check``'s "latest version of a subject" answers stay cached.
    cache_latest_ttl_s: float = Field(default=60.0, gt=0)

    @field_validator("url", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> Any:
        """One URL or a list of them (a comma-separated string too); http(s), no credentials in them."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            return value
        for url in value:
            parts = urlsplit(str(url))
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("each url must be http://host:port or https://host:port")
            if parts.username or parts.password:
                raise ValueError("a url may not carry credentials: set username and password instead")
        return [str(url).rstrip("/") for url in value]

    @field_validator("password")
    @classmethod
    def _password_needs_user(cls, value: SecretStr | None, info: Any) -> SecretStr | None:
        if value is not None and not info.data.get("username"):
            raise ValueError("password needs username")
        return value

    @model_validator(mode="after")
    def _client_certificate(self) -> SchemaRegistrySettings:
        if (self.ssl_key_location or self.ssl_key_password) and not self.ssl_certificate_location:
            raise ValueError("ssl_key_location / ssl_key_password need ssl_certificate_location")
        return self

    def client_config(self) -> dict[str, Any]:
        """confluent-kafka's ``SchemaRegistryClient`` configuration, secrets included (only for building
        the client). The client's own retries are off: the pipeline retries with its partitions paused,
        polling meanwhile, which a retry inside one lookup could not do."""
        conf: dict[str, Any] = {
            "url": ",".join(self.url),
            "timeout": self.timeout_s,
            "cache.capacity": self.cache_capacity,
            "cache.latest.ttl.sec": self.cache_latest_ttl_s,
            "max.retries": 0,
        }
        if self.username is not None:
            secret = self.password.get_secret_value() if self.password is not None else ""
            conf["basic.auth.user.info"] = f"{self.username}:{secret}"
        optional = {
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
            "ssl.key.password": self.ssl_key_password.get_secret_value() if self.ssl_key_password else None,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        return conf

"""Loading the configuration: one YAML file plus ``INGEST_`` environment overrides.

Sources, highest priority first:

1. environment variables ``INGEST_<SECTION>__<KEY>`` (``__`` separates nesting
   levels, e.g. ``INGEST_KAFKA__BOOTSTRAP_SERVERS=host:9092``; a list such as
   ``pipelines`` can only be replaced whole, as JSON),
2. the YAML file given by ``--config`` or ``INGEST_CONFIG``,
3. the defaults.

:func:`load_settings` turns any validation failure into a :class:`ConfigError`
whose message names the file, the field path and the problem (never a value),
and registers every secret of the loaded configuration for masking
(:mod:`ingest.redact`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from ingest.config import kinds
from ingest.config.formats import SchemaRegistrySettings
from ingest.config.pipeline import KafkaSettings, PipelineSettings, SchedulerSettings
from ingest.core.transforms import check_transforms
from ingest.errors import ConfigError
from ingest.redact import register_settings


class Settings(BaseSettings):
    """The whole configuration file."""

    model_config = SettingsConfigDict(
        env_prefix="INGEST_", env_nested_delimiter="__", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    #: Where registry-backed formats (avro, json_schema, protobuf) look schemas up.
    schema_registry: SchemaRegistrySettings | None = None
    pipelines: list[PipelineSettings] = Field(min_length=1)

    @field_validator("pipelines")
    @classmethod
    def _unique_names(cls, value: list[PipelineSettings]) -> list[PipelineSettings]:
        seen: set[str] = set()
        for pipeline in value:
            if pipeline.name in seen:
                raise ValueError(f"duplicate pipeline name {pipeline.name!r}")
            seen.add(pipeline.name)
        return value

    @model_validator(mode="after")
    def _registry_present(self) -> Settings:
        if self.schema_registry is None:
            for p in self.pipelines:
                if kinds.uses_schema_registry(p):
                    raise ValueError(f"pipeline {p.name!r}: format {p.format} (key_format {p.key_format}) needs a "
                                     "schema_registry section" + (" (or avro_schema: FILE)" if p.format == "avro" else ""))
        return self

    def pipeline(self, name: str) -> PipelineSettings:
        for pipeline in self.pipelines:
            if pipeline.name == name:
                return pipeline
        raise ConfigError(f"no pipeline named {name!r}; have {[p.name for p in self.pipelines]}")


def _format_error(path: str, exc: ValidationError, data: Any) -> str:
    lines = [f"invalid config {path}:"]
    for err in exc.errors():
        # ``pipelines[0](orders).sink.table``: list indices in brackets (as the transforms' compile
        # errors name a step: ``pipelines[0].transforms[2].set.x``), a pipeline's name after its index
        loc = ""
        node = data
        for part in err["loc"]:
            if isinstance(part, int):
                name = None
                if isinstance(node, list) and part < len(node):
                    name = node[part].get("name") if isinstance(node[part], dict) else None
                    node = node[part]
                else:
                    node = None
                loc += f"[{part}]" + (f"({name})" if name else "")
            else:
                if part in ("function-after", "function-before"):
                    continue
                loc += ("." if loc else "") + str(part)
                node = node.get(part) if isinstance(node, dict) else None
        loc = loc or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field missing"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Load and validate the config file (``path`` or ``$INGEST_CONFIG``) plus env overrides.

    Raises :class:`ConfigError` naming the file and every bad field.
    """
    path = path or os.environ.get("INGEST_CONFIG")
    if not path:
        raise ConfigError("no config file: pass --config FILE or set INGEST_CONFIG")
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {file} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {file}: top level must be a mapping")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(yaml_file=str(file))

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))

    try:
        loaded = _FileSettings()
    except ValidationError as exc:
        raise ConfigError(_format_error(str(file), exc, data)) from None
    try:
        check_transforms(loaded.pipelines)  # every expression compiles (cached for the run)
    except ConfigError as exc:
        raise ConfigError(f"invalid config {file}:\n  {exc}") from None
    register_settings(loaded)  # every secret of it is masked in output and logs from now on
    return loaded

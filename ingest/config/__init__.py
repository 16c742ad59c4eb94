"""Configuration: frozen pydantic-settings models loaded from one YAML file (:mod:`.load`).

- :mod:`.base`: the building blocks (frozen models, identifier and DSN checks, columns,
  :class:`SinkSettingsBase`);
- :mod:`.pipeline`: the broker connection and one pipeline (its sink section is validated
  by the settings class its ``kind`` names in :mod:`.kinds`);
- :mod:`.transforms`: the steps of a pipeline's ``transforms:`` list (shape only; the expressions
  are compiled by :mod:`ingest.core.transforms` when the file is loaded);
- :mod:`.kinds`: the settings-side registry (sink kind → settings class, format names), which
  :mod:`ingest.sinks.registry`, :mod:`ingest.formats.registry` and plugins fill;
- :mod:`.load`: the whole file, environment overrides, and errors naming the field.

Everything reads this package, so it imports nothing of the runtime: only pydantic, itself,
:mod:`ingest.errors`, :mod:`ingest.redact` and :mod:`ingest.core` (checked by
``tests/unit/test_import_graph.py``).

Secrets (database DSNs and passwords, librdkafka ``sasl.password`` /
``ssl.key.password``) are :class:`pydantic.SecretStr` and print as ``**********``.
"""

from ingest.config.base import (
    ColumnSpec,
    Frozen,
    SinkSettingsBase,
    check_dsn_syntax,
    check_identifier,
)
from ingest.config.load import Settings, load_settings
from ingest.config.pipeline import (
    BatchSettings,
    DlqSettings,
    KafkaSettings,
    PipelineSettings,
    RetrySettings,
    SchedulerSettings,
)

__all__ = [
    "BatchSettings", "ColumnSpec", "DlqSettings", "Frozen", "KafkaSettings", "PipelineSettings", "RetrySettings",
    "SchedulerSettings", "Settings", "SinkSettingsBase", "check_dsn_syntax", "check_identifier", "load_settings",
]

"""Every shipped config file validates (the README points users at them)."""

from pathlib import Path

import pytest

from ingest.config import load_settings

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_validates(path, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("INGEST_"):
            monkeypatch.delenv(name)
    settings = load_settings(path)
    assert settings.pipelines, path

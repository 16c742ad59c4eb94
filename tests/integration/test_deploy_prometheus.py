"""deploy/prometheus/alerts.yaml: promtool checks and unit-tests every rule; each has a runbook.

``promtool`` comes with Debian's ``prometheus`` package (scripts/test.sh installs it). When it is
missing the tests fail, like any other unavailable test service: they are never skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"

pytestmark = pytest.mark.timeout(60)


def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if path is None:
        pytest.fail("promtool unavailable: install Debian's prometheus package (bash scripts/test.sh does)",
                    pytrace=False)
    return path


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules():
    res = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in res.stdout


def test_promtool_unit_tests_pass():
    res = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_rule_is_unit_tested_firing_and_not_firing():
    """Each alert has a test case that expects it and an evaluation where it must stay silent."""
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), "rules never tested firing"
    assert names - silent == set(), "rules never tested silent"


def test_every_rule_has_a_runbook_line_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for rule in alert_rules():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == f"runbook-{rule['alert'].lower()}"
        # The README's runbook table names each rule in a row with its anchor.
        assert re.search(rf'<a id="{anchor}"></a>`?{rule["alert"]}`?', readme), f"no runbook row for {rule['alert']}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}

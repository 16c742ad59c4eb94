"""A real Prometheus scrapes a real ``ingest run``; every rule and dashboard expression is asked of it.

Debian's Prometheus server (started on loopback by :mod:`harness.prometheus`, scrape and rule
evaluation every second, ``deploy/prometheus/alerts.yaml`` loaded) scrapes ``ingest run`` (real
Tansu broker, real PostgreSQL, two lanes) through a short run with poison records (dead letters)
and a pause (the sink table locked until backpressure pauses the consumer). Then, over the whole
run, through Prometheus's HTTP API:

- every alert rule is loaded and evaluates without error (``/api/v1/rules``: health ``ok``);
- every rule expression parses, and its value without the thresholds (each ``> N`` / ``== N``
  turned into ``>= -Inf``) returns series carrying every label the rule's annotations use;
- every dashboard query (``deploy/grafana/ingest.json``, ``$pipeline`` and ``$__rate_interval``
  filled in) returns series carrying every label its legend uses;
- every metric those expressions name is documented in the README and is served with exactly the
  labels the README documents for it (plus ``pipeline``, ``job``, ``instance``; ``le`` for buckets).

This is the check that metric names and labels in the docs, the rules, the dashboard and the code
agree. Two static checks go with it: the dashboard imports without edits (a data source variable,
a pipeline variable every query filters on), and each panel's unit is what its queries compute
from the metric names' unit suffixes (``_seconds``, ``_total`` under ``rate``, ``_share``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import yaml
from harness import run_ingest, start_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from harness.metrics import get
from harness.prometheus import PrometheusServer, start_prometheus
from harness.services import ServiceError, free_port
from pipeline_helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ingest.json"
PIPELINE = "scrape"
RATE_WINDOW = "5s"  # what Grafana makes of $__rate_interval at a 1 s scrape interval (4 x interval)

pytestmark = pytest.mark.timeout(180)

_THRESHOLD = re.compile(r"(==|!=|>=|<=|>|<)\s*-?[0-9][0-9.e+]*")
_METRIC = re.compile(r"\b(ingest_[a-z_]+|up)\b(?=\s*[{\[)\s])")
_DOC_METRIC = re.compile(r"`(ingest_[a-z_]+)(?:\{([^}`]*)\})?`")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def dashboard_targets() -> list[tuple[str, str, str]]:
    """``(panel title, expr, legendFormat)`` of every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p["targets"]]


def fill(expr: str) -> str:
    return expr.replace("$pipeline", PIPELINE).replace("$__rate_interval", RATE_WINDOW)


def without_thresholds(expr: str) -> str:
    """The rule's value: each comparison with a number keeps every (non-NaN) sample."""
    return _THRESHOLD.sub(">= -Inf", expr)


def documented_labels() -> dict[str, set[str]]:
    """README: ``metric{a,b}`` / ``metric{a="x"}`` → {a, b} (+ pipeline); a bare mention → {pipeline}."""
    out: dict[str, set[str]] = {}
    for name, labels in _DOC_METRIC.findall((ROOT / "README.md").read_text()):
        names = {part.split("=", 1)[0].strip() for part in labels.split(",") if part.strip()}
        out.setdefault(name, {"pipeline"}).update(names)
    return out


def series_of(prom: PrometheusServer, expr: str, start: float, end: float) -> list[dict[str, str]]:
    res = prom.query_range(expr, start, end)
    assert res["status"] == "success", f"{expr}: {res}"
    return [s["metric"] for s in res["data"]["result"]]


def _config(bootstrap: str, dsn: str, topic: str, group: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": PIPELINE, "topics": [topic], "group_id": group, "lanes": 2, "commit_interval_ms": 200,
            "max_buffered_records": 300, "hot_key_interval_s": 1, "hot_key_share": 0.5,
            "batch": {"max_rows": 50, "max_latency_ms": 50},
            "sink": {"kind": "postgres", "dsn": dsn, "table": "scrape", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "text"}}},
        }],
    }


def _records(start: int, n: int) -> list[tuple[bytes, bytes]]:
    # One key in four is "hot": the hot-key gauges have something to show.
    return [(b"hot" if i % 4 == 0 else str(i).encode(), orjson.dumps({"id": i, "v": f"v{i}"}))
            for i in range(start, start + n)]


def _status(port: int) -> dict[str, Any] | None:
    try:
        code, body = get(port, "/status")
    except OSError:
        return None
    return orjson.loads(body)["pipelines"].get(PIPELINE) if code == 200 else None


def _caught_up(port: int, total: int):
    def check() -> bool:
        s = _status(port)
        return bool(s and s["state"] == "running" and s["partitions"]
                    and sum(p["committed"] or 0 for p in s["partitions"]) == total)
    return check


def _has(prom: PrometheusServer, expr: str) -> bool:
    res = prom.query(expr)
    return res["status"] == "success" and bool(res["data"]["result"])


def test_every_rule_and_panel_query_returns_documented_series(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                               group_id):
    topic = new_topic(partitions=3)
    path = write_config(tmp_path, _config(kafka_bootstrap, pg_dsn, topic, group_id))
    assert run_ingest(["migrate", "-c", path], timeout_s=60, log_dir=tmp_path).returncode == 0
    port = free_port()
    try:  # Prometheus first, so it sees the whole run from the first scrape on
        prom = start_prometheus([f"127.0.0.1:{port}"], [RULES], tmp_path / "prometheus")
    except ServiceError as exc:
        pytest.fail(f"test service unavailable: {exc}", pytrace=False)
    start = time.time()
    proc = start_ingest(["run", "-c", path, "--metrics-port", str(port)], log_dir=tmp_path)
    try:
        wait_until(lambda: _has(prom, f'ingest_pipeline_state{{pipeline="{PIPELINE}",state="running"}} == 1'),
                   60, what="Prometheus to scrape a running pipeline", proc=proc)
        poison = [(b"bad", b"{not json") for _ in range(10)]
        produce(kafka_bootstrap, topic, _records(0, 600) + poison + _records(600, 400))
        wait_until(_caught_up(port, 1010), 60, what="the first 1010 records committed", proc=proc)
        # A pause: the table locked, writes wait, records pile up in flight until backpressure pauses.
        locker = psycopg.connect(pg_dsn, autocommit=False)
        try:
            locker.execute("LOCK TABLE scrape IN ACCESS EXCLUSIVE MODE")
            produce(kafka_bootstrap, topic, _records(1000, 1000))
            wait_until(lambda: _has(prom, f'sum_over_time(ingest_pipeline_state{{pipeline="{PIPELINE}",'
                                          f'state="paused"}}[1h]) >= 3'),
                       60, what="Prometheus to scrape the pause three times", proc=proc)
        finally:
            locker.rollback()
            locker.close()
        wait_until(_caught_up(port, 2010), 60, what="all 2010 records committed", proc=proc)
        # Enough samples after the run for every rate window; the hot-key report came at least once.
        wait_until(lambda: _has(prom, f'ingest_records_handled_total{{pipeline="{PIPELINE}"}} == 2010'
                                      f' and on() count_over_time(ingest_records_handled_total'
                                      f'{{pipeline="{PIPELINE}"}}[1h]) >= 15'
                                      f' and on() ingest_hot_key_share{{pipeline="{PIPELINE}"}} >= 0'),
                   60, what="Prometheus to scrape the end of the run", proc=proc)
        wait_until(lambda: all(r.get("health") == "ok" and r.get("lastEvaluation", "").startswith("20")
                               for g in prom.api("rules")["data"]["groups"] for r in g["rules"]), 20,
                   what="every rule evaluated")
        end = time.time()
        failures = check_all(prom, start, end)
        if failures:  # how well the run was scraped
            ups = [v for r in prom.query_range("up", start, end)["data"]["result"] for _, v in r["values"]]
            failures.append(f"scrapes in the run: {len(ups)}, of them failed: {ups.count('0')}; "
                            f"{prom.describe()}")
        assert not failures, "\n".join(failures)
    finally:
        proc.stop()
        prom.stop()
    assert proc.returncode == 0, proc.describe()


def check_all(prom: PrometheusServer, start: float, end: float) -> list[str]:
    """Every check of the module docstring; returns what failed (empty: all agree)."""
    failures: list[str] = []
    loaded = {r["name"]: r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]}
    used_metrics: set[str] = set()
    for rule in alert_rules():
        name, expr = rule["alert"], rule["expr"].strip()
        used_metrics.update(_METRIC.findall(expr))
        if loaded.get(name, {}).get("health") != "ok":
            failures.append(f"{name}: not loaded or not healthy in Prometheus: {loaded.get(name)}")
        res = prom.query(expr)
        if res["status"] != "success":
            failures.append(f"{name}: {expr!r} does not evaluate: {res.get('error')}")
            continue
        value = without_thresholds(expr)
        series = series_of(prom, value, start, end)
        wanted = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule.get("annotations", {}))))
        if not series:
            failures.append(f"{name}: {value!r} returned no series")
        elif not any(wanted <= set(s) for s in series):
            failures.append(f"{name}: {value!r} series {series[:3]} lack labels {sorted(wanted)}")
    for title, expr, legend in dashboard_targets():
        query = fill(expr)
        used_metrics.update(_METRIC.findall(query))
        series = series_of(prom, query, start, end)
        wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        if not series:
            failures.append(f"panel {title!r}: {query!r} returned no series")
        elif not any(wanted <= set(s) for s in series):
            failures.append(f"panel {title!r}: {query!r} series {series[:3]} lack legend labels {sorted(wanted)}")
    documented = documented_labels()
    for metric in sorted(used_metrics - {"up"}):
        base = _HISTOGRAM_SUFFIX.sub("", metric)
        if base not in documented:
            failures.append(f"{metric}: used by the rules or the dashboard but not documented in the README")
            continue
        want = documented[base] | {"job", "instance"} | ({"le"} if metric.endswith("_bucket") else set())
        got = [set(s) - {"__name__"} for s in series_of(prom, metric, start, end)]
        if not got:
            failures.append(f"{metric}: never scraped")
        elif any(labels != want for labels in got):
            failures.append(f"{metric}: served with labels {sorted(got[0])}, README documents {sorted(want)}")
    return failures


def test_the_dashboard_is_importable_with_its_variables():
    """Grafana's import needs no edit: the data source is a variable, every query filters on $pipeline."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    pipeline = variables["pipeline"]
    assert pipeline["type"] == "query" and pipeline["includeAll"] and pipeline["multi"]
    assert pipeline["datasource"]["uid"] == "${datasource}"
    assert "label_values(" in pipeline["query"]["query"] and ", pipeline)" in pipeline["query"]["query"]
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        for target in panel["targets"]:
            assert 'pipeline=~"$pipeline"' in target["expr"], (panel["title"], target["expr"])
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_units_follow_the_metric_units():
    """A panel's unit agrees with what its queries compute from the metric names' unit suffixes."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            expr = target["expr"]
            metric = _METRIC.findall(expr)[0]
            if "histogram_quantile" in expr or (metric.endswith("_seconds") and "rate(" not in expr):
                want = {"s"}  # a duration
            elif metric == "ingest_paused_seconds_total" or metric.endswith("_share"):
                want = {"percentunit"}  # seconds per second; a share
            elif metric.endswith("_total") and "rate(" in expr:
                want = {"rps"}  # events per second
            elif metric == "ingest_pipeline_state":
                want = {"none", "percentunit"}  # 0/1
            else:
                want = {"short"}  # a count (records, offsets)
            assert unit in want, f"panel {panel['title']!r}: unit {unit!r} for {expr!r}, expected {sorted(want)}"

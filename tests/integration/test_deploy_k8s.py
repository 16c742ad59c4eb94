"""deploy/k8s/: the manifests are valid and agree with each other, the config and the image.

- Core kinds (ConfigMap, Secret, Deployment, Service, PodDisruptionBudget, CronJob) validate
  strictly (no unknown field) against the Kubernetes JSON schemas that ``kubernetes-validate``
  ships (offline).
- KEDA's ScaledObject has no offline schema: its fields are checked against the documented spec
  below (``keda.sh/v1alpha1``; the Apache Kafka scaler's trigger metadata, every value a string).
- The ConfigMap's config.yaml loads with ingest's own loader; the ScaledObject's topic, group and
  brokers are that config's; maxReplicaCount is the topic's partition count; the grace period is
  above ``shutdown_timeout_s``; probes hit /healthz and /readyz on the metrics port; the pod runs
  as the image's non-root user with a read-only root filesystem.
- The Secret's way of carrying the DSN (a libpq service file, ``PGSERVICEFILE``, the config naming
  ``service=ingest-sink``) works: ``ingest migrate`` and ``ingest run --until-idle`` of the
  ConfigMap's own config reach the real test PostgreSQL through such a file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import psycopg
import pytest
import yaml
from harness import run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce

from ingest.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"
TOPIC_PARTITIONS = 6  # the example topic "orders" (README "Deploying")

pytestmark = pytest.mark.timeout(120)

# KEDA's ScaledObject (keda.sh/v1alpha1): the documented fields of spec, and of the kafka trigger.
KEDA_SPEC_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                    "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
KEDA_TARGET_FIELDS = {"apiVersion", "kind", "name", "envSourceContainerName"}
KEDA_ADVANCED_FIELDS = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"}
KEDA_TRIGGER_FIELDS = {"type", "metadata", "authenticationRef", "name", "metricType", "useCachedMetrics"}
KAFKA_METADATA = {"bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold",
                  "offsetResetPolicy", "allowIdleConsumers", "scaleToZeroOnInvalidOffset", "excludePersistentLag",
                  "limitToPartitionsWithLag", "partitionLimitation", "version", "sasl", "tls",
                  "unsafeSsl", "ensureEvenDistributionOfPartitions"}
KAFKA_REQUIRED = {"bootstrapServers", "consumerGroup", "topic"}


def docs() -> dict[str, dict[str, Any]]:
    """Every manifest of deploy/k8s by kind (one object per kind there)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} manifests"
            out[doc["kind"]] = doc
    return out


def config_of(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    data = docs()["ConfigMap"]["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(data)
    return yaml.safe_load(data), path


def mem_mib(text: str) -> float:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", text)
    assert m, text
    return int(m[1]) * (1024 if m[2] == "Gi" else 1)


@pytest.mark.parametrize("kind", ["ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget", "CronJob"])
def test_core_kinds_validate_strictly_against_the_kubernetes_schemas(kind):
    doc = docs()[kind]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{kind}: {exc.message} at {list(exc.path)}")


def test_kustomization_lists_the_streaming_form():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert set(k["resources"]) == {"configmap.yaml", "deployment.yaml", "service.yaml", "pdb.yaml",
                                   "scaledobject.yaml"}
    assert all((K8S / r).exists() for r in k["resources"])


def test_the_scaled_object_follows_kedas_spec_and_the_config(tmp_path):
    d = docs()
    so, deployment = d["ScaledObject"], d["Deployment"]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    spec = so["spec"]
    assert set(spec) <= KEDA_SPEC_FIELDS, set(spec) - KEDA_SPEC_FIELDS
    target = spec["scaleTargetRef"]
    assert set(target) <= KEDA_TARGET_FIELDS and target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
    assert set(spec.get("advanced", {})) <= KEDA_ADVANCED_FIELDS
    for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        assert isinstance(spec[key], int) and spec[key] >= 0, key
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] == TOPIC_PARTITIONS
    (trigger,) = spec["triggers"]
    assert set(trigger) <= KEDA_TRIGGER_FIELDS and trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert KAFKA_REQUIRED <= set(meta) <= KAFKA_METADATA, set(meta) - KAFKA_METADATA
    assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata is a map of strings"
    assert int(meta["lagThreshold"]) > 0 and int(meta["activationLagThreshold"]) >= 0
    assert meta["offsetResetPolicy"] in {"earliest", "latest"} and meta["allowIdleConsumers"] == "false"
    config, path = config_of(tmp_path)
    settings = load_settings(path)  # ingest's own loader accepts the ConfigMap's config
    (pipeline,) = settings.pipelines
    assert meta["bootstrapServers"] == settings.kafka.bootstrap_servers
    assert meta["consumerGroup"] == pipeline.group_id and meta["topic"] == pipeline.topics[0]
    assert meta["offsetResetPolicy"] == "earliest"  # ingest's own auto.offset.reset default


def test_the_deployment_drains_on_sigterm_and_runs_locked_down(tmp_path):
    d = docs()
    deployment = d["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _, path = config_of(tmp_path)
    settings = load_settings(path)
    assert pod["terminationGracePeriodSeconds"] > max(p.shutdown_timeout_s for p in settings.pipelines) + 10
    args = container["args"]
    assert args[0] == "run" and "--until-idle" not in args
    config_path = Path(args[args.index("--config") + 1])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_mount = next(m for m in mounts.values() if Path(m["mountPath"]) == config_path.parent)
    assert volumes[config_mount["name"]]["configMap"]["name"] == d["ConfigMap"]["metadata"]["name"]
    assert config_path.name in d["ConfigMap"]["data"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    service_file = Path(env["PGSERVICEFILE"])
    secret_mount = next(m for m in mounts.values() if Path(m["mountPath"]) == service_file.parent)
    assert volumes[secret_mount["name"]]["secret"]["secretName"] == d["Secret"]["metadata"]["name"]
    assert service_file.name in d["Secret"]["stringData"]
    port = int(env["INGEST_METRICS_PORT"])
    (metrics_port,) = container["ports"]
    assert metrics_port["containerPort"] == port and metrics_port["name"] == "metrics"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"--uid {pod['securityContext']['runAsUser']}" in dockerfile
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/tmp" for m in mounts.values())  # the only writable path
    res = container["resources"]
    # The benchmarks' peak RSS of one process is 160-280 MiB (README "Benchmarks"): requested, with room.
    assert 280 <= mem_mib(res["requests"]["memory"]) <= mem_mib(res["limits"]["memory"])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for kind in ("PodDisruptionBudget",):
        assert d[kind]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert d["Service"]["spec"]["selector"].items() <= labels.items()
    assert d["Service"]["spec"]["ports"][0]["port"] == port


def test_the_cronjob_is_the_batch_form_with_the_same_pod_rules(tmp_path):
    d = docs()
    cron = d["CronJob"]
    job = cron["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "run" and "--until-idle" in args and float(args[args.index("--until-idle") + 1]) > 0
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and pod["restartPolicy"] == "Never"
    stream = d["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == stream["securityContext"]
    assert container["securityContext"] == stream["containers"][0]["securityContext"]
    assert container["resources"] == stream["containers"][0]["resources"]
    assert job["activeDeadlineSeconds"] < 30 * 60  # ends before the next run is due (every 30 min)
    # The batch pods are not selected by the streaming Deployment, its PDB or its Service.
    stream_selector = d["Deployment"]["spec"]["selector"]["matchLabels"]
    assert not stream_selector.items() <= job["template"]["metadata"]["labels"].items()


def test_the_dsn_comes_from_the_secret_through_a_libpq_service_file(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                     group_id):
    """The ConfigMap's own pipeline, its DSN ``service=ingest-sink`` resolved from a service file
    written like the Secret's (but naming the test database), migrates and runs."""
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    secret = docs()["Secret"]["stringData"]["pg_service.conf"]
    lines = {"host": info.get("host", "127.0.0.1"), "port": info.get("port", "5432"), "dbname": info["dbname"],
             "user": info.get("user", "postgres"), "password": "not-checked-by-trust-auth"}
    service = "\n".join([secret.splitlines()[0], *(f"{k}={v}" for k, v in lines.items())]) + "\n"
    service_file = tmp_path / "pg_service.conf"
    service_file.write_text(service)
    config, _ = config_of(tmp_path)
    topic = new_topic(partitions=2)
    config["kafka"] = {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)}
    config["pipelines"][0].update(topics=[topic], group_id=group_id)
    path = write_config(tmp_path, config, name="k8s.yaml")
    env = {"PGSERVICEFILE": str(service_file)}
    res = run_ingest(["migrate", "-c", path], timeout_s=60, env=env, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    produce(kafka_bootstrap, topic, [(str(i).encode(), orjson.dumps({"order_id": i, "status": "new", "amount": "1.50",
                                                                      "updated_at": "2026-12-05T10:00:00Z"}))
                                     for i in range(20)])
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0"], timeout_s=90, env=env,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not-checked-by-trust-auth" not in res.stdout + res.stderr
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone()[0] == 20

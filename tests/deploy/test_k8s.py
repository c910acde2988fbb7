"""deploy/k8s: every object follows its Kubernetes schema and agrees with the code."""

from __future__ import annotations

import re
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from gateway.config.settings import Settings
from gateway.observe.metrics import (
    ADMISSION_QUEUE_METRIC,
    FLEET_ENGINE_QUEUE_METRIC,
    QUEUE_DEPTH_METRIC,
)
from tests.deploy.manifests import (
    K8S,
    KUBERNETES_VERSION,
    K8sDoc,
    container,
    flags,
    k8s_docs,
    k8s_object,
    k8s_vllm_args,
    kustomization_files,
    kustomize_literals,
    named_port,
)
from tests.helpers import FakeBackend, fronting

GATEWAY_PORT = Settings.model_fields["port"].default  # 8080
VLLM_PORT = 8000
REDIS_DATA = "/data"  # the official image's working directory, where it keeps its files
# NVIDIA dcgm-exporter's GPU utilisation gauge (percent), in its default counter set.
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"


@pytest.mark.parametrize("obj", k8s_docs(), ids=str)
def test_object_follows_its_kubernetes_schema(obj: K8sDoc) -> None:
    """Strict: an unknown or misspelt field fails, as `kubectl apply --validate=strict` would."""
    kubernetes_validate.validate(obj.doc, KUBERNETES_VERSION, strict=True)


def test_schema_check_rejects_a_misspelt_field() -> None:
    doc = yaml.safe_load(yaml.safe_dump(k8s_object("Deployment", "gateway")))
    probe = container(doc, "gateway")["readinessProbe"]
    probe["initialDelay"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", kustomization_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_lists_every_manifest_beside_it(path: Any) -> None:
    kustomization = yaml.safe_load(path.read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    beside = {p.name for p in path.parent.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == beside


def test_tensor_parallel_size_sets_the_gpu_count() -> None:
    """The one parameter: the kustomize replacement copies it into the GPU request and limit."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    [replacement] = kustomization["replacements"]
    assert replacement["source"]["fieldPath"] == "data.TENSOR_PARALLEL_SIZE"
    [target] = replacement["targets"]
    assert target["select"] == {"kind": "StatefulSet", "name": "vllm"}
    prefix = "spec.template.spec.containers.[name=vllm].resources"
    assert sorted(target["fieldPaths"]) == [
        f"{prefix}.limits.[nvidia.com/gpu]",
        f"{prefix}.requests.[nvidia.com/gpu]",
    ]
    tp = kustomize_literals(K8S / "kustomization.yaml", "vllm-params")["TENSOR_PARALLEL_SIZE"]
    resources = container(k8s_object("StatefulSet", "vllm"), "vllm")["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == tp
    assert flags(k8s_vllm_args())["--tensor-parallel-size"] == tp


def test_vllm_args_expand_only_variables_the_container_defines() -> None:
    ctr = container(k8s_object("StatefulSet", "vllm"), "vllm")
    env = {e["name"] for e in ctr["env"]}
    used = {v for a in ctr["args"] for v in re.findall(r"\$\((\w+)\)", a)}
    assert used <= env
    assert ctr["command"] == ["vllm", "serve"]
    args = flags(k8s_vllm_args())
    assert args["--port"] == str(VLLM_PORT)
    assert "--enable-prefix-caching" in args
    assert "--swap-space" not in args  # removed in vLLM's V1 engine; 0.32 refuses it


def test_gateway_probes_and_ports_match_the_gateway() -> None:
    deploy = k8s_object("Deployment", "gateway")
    ctr = container(deploy, "gateway")
    assert named_port(ctr, "http") == GATEWAY_PORT
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        assert named_port(ctr, ctr[probe]["httpGet"]["port"]) == GATEWAY_PORT
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(GATEWAY_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    [port] = k8s_object("Service", "gateway")["spec"]["ports"]
    assert named_port(ctr, port["targetPort"]) == GATEWAY_PORT
    env = k8s_object("ConfigMap", "gateway-env")["data"]
    assert int(env["GATEWAY_PORT"]) == GATEWAY_PORT
    # The pod outlives the gateway's own shutdown grace.
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["GATEWAY_SHUTDOWN_GRACE"])


def test_gateway_env_is_valid_gateway_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = k8s_object("ConfigMap", "gateway-env")["data"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.limits.store == "redis"
    redis_host = settings.limits.redis.url.get_secret_value().split("//", 1)[1].split(":")[0]
    [redis_port] = k8s_object("Service", redis_host)["spec"]["ports"]
    assert redis_port["port"] == 6379


def test_redis_keeps_its_data_on_a_persistent_volume() -> None:
    """The fleet's change log, run-time keys and budgets live in Redis: an append-only file
    fsync'd every second, on a claim that outlives the pod."""
    deploy = k8s_object("Deployment", "redis")
    ctr = container(deploy, "redis")
    args = flags(ctr["args"])
    assert args["--appendonly"] == "yes"
    assert args["--appendfsync"] == "everysec"
    assert args["--dir"] == REDIS_DATA
    [mount] = [m for m in ctr["volumeMounts"] if m["mountPath"] == REDIS_DATA]
    pod = deploy["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = k8s_object("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    # Never two Redis on one volume: the old pod goes before the new one comes.
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # The non-root redis user can write the volume.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_admin_service_reaches_the_admin_port_of_any_gateway_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster-internal Service on every replica's admin port; the token only from a Secret,
    and no admin API at all without it."""
    deploy = k8s_object("Deployment", "gateway")
    ctr = container(deploy, "gateway")
    env = k8s_object("ConfigMap", "gateway-env")["data"]
    assert "GATEWAY_ADMIN__TOKEN" not in env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GATEWAY_ADMIN__TOKEN", raising=False)
    settings = Settings()
    assert settings.admin.host == "0.0.0.0"  # reachable from the Service, not loopback only
    assert settings.admin.port != settings.port
    assert settings.admin.token is None  # no Secret, no admin API
    service = k8s_object("Service", "gateway-admin")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    [port] = service["spec"]["ports"]
    assert port["port"] == named_port(ctr, port["targetPort"]) == settings.admin.port
    [token] = [e for e in ctr["env"] if e["name"] == "GATEWAY_ADMIN__TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "gateway-admin"
    assert ref["optional"] is True  # the pods start without it, with the admin API off
    # Nothing else exposes the admin port: no other Service targets it, no Ingress exists.
    for obj in k8s_docs():
        assert obj.kind != "Ingress", obj
        if obj.kind == "Service" and obj.name != "gateway-admin":
            for p in obj.doc["spec"]["ports"]:
                assert p["targetPort"] not in ("admin", settings.admin.port), obj


def test_gateway_discovers_the_headless_vllm_service() -> None:
    env = k8s_object("ConfigMap", "gateway-env")["data"]
    host, port = env["GATEWAY_DISCOVERY__DNS"].rsplit(":", 1)
    service = k8s_object("Service", host)
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS lists every ready pod
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    sts = k8s_object("StatefulSet", "vllm")
    assert sts["spec"]["serviceName"] == host
    ctr = container(sts, "vllm")
    [svc_port] = service["spec"]["ports"]
    assert svc_port["port"] == int(port) == named_port(ctr, svc_port["targetPort"]) == VLLM_PORT
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_vllm_probes_wait_for_the_model_to_load() -> None:
    ctr = container(k8s_object("StatefulSet", "vllm"), "vllm")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = ctr[probe]["httpGet"]
        assert get["path"] == "/health"
        assert named_port(ctr, get["port"]) == VLLM_PORT
        assert ctr[probe]["initialDelaySeconds"] >= 60
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert ctr["resources"]["limits"]["nvidia.com/gpu"]


def test_pod_disruption_budgets_select_their_workloads() -> None:
    for name, kind in (("gateway", "Deployment"), ("vllm", "StatefulSet")):
        pdb = k8s_object("PodDisruptionBudget", name)
        labels = k8s_object(kind, name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


def adapter_rules() -> dict[str, Any]:
    config = k8s_object("ConfigMap", "prometheus-adapter-rules")["data"]["config.yaml"]
    rules: dict[str, Any] = yaml.safe_load(config)
    return rules


def rule_for(rules: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    [rule] = [r for r in rules if r["name"]["as"] == metric]
    series = re.match(r"^([A-Za-z_:][\w:]*)\{", rule["seriesQuery"])
    assert series is not None
    assert series.group(1) == metric
    assert re.fullmatch(rule["name"]["matches"], metric)
    return rule


def test_autoscaler_metrics_are_exposed_by_the_adapter() -> None:
    hpa = k8s_object("HorizontalPodAutoscaler", "vllm")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "vllm",
    }
    by_type = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert by_type["Pods"]["pods"]["metric"]["name"] == DCGM_GPU_UTIL
    assert by_type["External"]["external"]["metric"]["name"] == QUEUE_DEPTH_METRIC
    rules = adapter_rules()
    pods_rule = rule_for(rules["rules"], DCGM_GPU_UTIL)
    overrides = pods_rule["resources"]["overrides"]
    assert {o["resource"] for o in overrides.values()} == {"namespace", "pod"}
    external_rule = rule_for(rules["externalRules"], QUEUE_DEPTH_METRIC)
    # Each gateway replica reports the whole fleet's engine queues: never sum them; the
    # replicas' own admission queues are distinct: sum those.
    query = external_rule["metricsQuery"]
    assert query.startswith(f"max by (<<.GroupBy>>) ({FLEET_ENGINE_QUEUE_METRIC}{{")
    assert f"+ sum by (<<.GroupBy>>) ({ADMISSION_QUEUE_METRIC}{{" in query


async def test_the_gateway_really_exports_the_queue_depth_metric() -> None:
    async with fronting(FakeBackend()) as gw:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{gw.url}/metrics")).text
    for name in (QUEUE_DEPTH_METRIC, FLEET_ENGINE_QUEUE_METRIC, ADMISSION_QUEUE_METRIC):
        assert re.search(rf"^{name} \d", text, re.MULTILINE), name

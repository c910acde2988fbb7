"""deploy/k8s: every object follows its Kubernetes schema and agrees with the code."""

from __future__ import annotations

import json
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
# The gateway capacity manager's gauge: engines it wants awake per model (gateway/capacity).
DESIRED_ENGINES_METRIC = "llm_gateway_capacity_desired_engines"
# Where Prometheus (and the prometheus-adapter) run: deploy/k8s/monitoring's namespace.
MONITORING_NAMESPACE = "monitoring"
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}


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


def replacements_of(field_path: str) -> list[dict[str, Any]]:
    """kustomization.yaml's replacements that copy this field of the vllm-params ConfigMap."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [
        r
        for r in kustomization["replacements"]
        if r["source"] == {"kind": "ConfigMap", "name": "vllm-params", "fieldPath": field_path}
    ]


def test_tensor_parallel_size_sets_the_gpu_count() -> None:
    """The one parameter: the kustomize replacement copies it into the GPU request and limit."""
    [replacement] = replacements_of("data.TENSOR_PARALLEL_SIZE")
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
    names = {(m["type"], m[m["type"].lower()]["metric"]["name"]) for m in hpa["spec"]["metrics"]}
    assert names == {
        ("Pods", DCGM_GPU_UTIL),
        ("External", QUEUE_DEPTH_METRIC),
        ("External", DESIRED_ENGINES_METRIC),
    }
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


def test_autoscaler_follows_the_engines_the_capacity_manager_wants() -> None:
    """The slow lever: one server per engine the capacity manager wants awake for the model
    these servers serve (ceil(desired / 1) with AverageValue), read as the max across gateway
    replicas: the fleet's one decision, whichever replica manages capacity exports it."""
    hpa = k8s_object("HorizontalPodAutoscaler", "vllm")
    metrics = hpa["spec"]["metrics"]
    [index] = [
        i
        for i, m in enumerate(metrics)
        if m["type"] == "External" and m["external"]["metric"]["name"] == DESIRED_ENGINES_METRIC
    ]
    external = metrics[index]["external"]
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    # The model is SERVED_MODEL_NAME, copied into the selector by kustomize: the file's value
    # is the same, and the replacement points at this metric.
    model = kustomize_literals(K8S / "kustomization.yaml", "vllm-params")["SERVED_MODEL_NAME"]
    assert external["metric"]["selector"] == {"matchLabels": {"model": model}}
    assert flags(k8s_vllm_args())["--served-model-name"] == model
    [replacement] = replacements_of("data.SERVED_MODEL_NAME")
    [target] = replacement["targets"]
    assert target["select"] == {"kind": "HorizontalPodAutoscaler", "name": "vllm"}
    assert target["fieldPaths"] == [
        f"spec.metrics.{index}.external.metric.selector.matchLabels.model"
    ]
    rule = rule_for(adapter_rules()["externalRules"], DESIRED_ENGINES_METRIC)
    assert 'model!=""' in rule["seriesQuery"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}}
    assert rule["metricsQuery"] == "max by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})"


def vllm_pod_labels() -> dict[str, str]:
    labels: dict[str, str] = k8s_object("StatefulSet", "vllm")["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector of only matchLabels (what these manifests use) against pod labels."""
    assert set(selector) == {"matchLabels"}, selector
    return bool(selector["matchLabels"].items() <= labels.items())


def kv_event_ports() -> set[int]:
    """The ports of vLLM's KV-cache event publisher and its replay socket, from its flags."""
    config = json.loads(flags(k8s_vllm_args())["--kv-events-config"] or "{}")
    return {int(config[key].rsplit(":", 1)[1]) for key in ("endpoint", "replay_endpoint")}


def test_network_policy_admits_only_the_gateway_and_prometheus_to_the_vllm_pods() -> None:
    """vLLM's dev routes check no API key: the engines take connections from the gateway (the
    API, /metrics and the KV-event sockets) and from Prometheus (its /metrics scrape) alone."""
    sts = k8s_object("StatefulSet", "vllm")
    ctr = container(sts, "vllm")
    [policy] = [
        d.doc
        for d in k8s_docs()
        if d.kind == "NetworkPolicy" and selects(d.doc["spec"]["podSelector"], vllm_pod_labels())
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: the weights' download
    # It selects the engines and nothing else of the deployment.
    for kind, name in (("Deployment", "gateway"), ("Deployment", "redis")):
        labels = k8s_object(kind, name)["spec"]["template"]["metadata"]["labels"]
        assert not selects(policy["spec"]["podSelector"], labels), name
    gateway_labels = k8s_object("Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    admitted: dict[str, set[int]] = {}
    for rule in policy["spec"]["ingress"]:
        # An empty or missing `from` or `ports` would admit every source or every port.
        assert rule.get("from"), rule
        assert rule.get("ports"), rule
        assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
        ports = {named_port(ctr, p["port"]) for p in rule["ports"]}
        for peer in rule["from"]:
            assert "ipBlock" not in peer, peer
            pods = peer["podSelector"]
            if "namespaceSelector" not in peer:  # pods of this namespace: the gateway's
                assert selects(pods, gateway_labels), peer
                assert not selects(pods, vllm_pod_labels()), peer
                who = "gateway"
            else:  # Prometheus, in the monitoring namespace
                assert peer["namespaceSelector"] == {
                    "matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
                }
                assert pods == {"matchLabels": PROMETHEUS_POD}
                who = "prometheus"
            admitted.setdefault(who, set()).update(ports)
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    scrape_port = int(annotations["prometheus.io/port"])
    assert admitted == {
        "gateway": {VLLM_PORT, *kv_event_ports()},
        "prometheus": {scrape_port},
    }
    assert scrape_port == VLLM_PORT
    # The same namespace as the adapter the autoscaler reads (its Prometheus beside it).
    monitoring = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert monitoring["namespace"] == MONITORING_NAMESPACE


def test_vllm_dev_routes_are_on_only_behind_the_network_policy() -> None:
    """The capacity manager sleeps and wakes engines through vLLM's dev routes, which are on;
    the NetworkPolicy that keeps them to the gateway is applied with them."""
    ctr = container(k8s_object("StatefulSet", "vllm"), "vllm")
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    [policy] = [
        d
        for d in k8s_docs()
        if d.kind == "NetworkPolicy" and selects(d.doc["spec"]["podSelector"], vllm_pod_labels())
    ]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert policy.path.name in kustomization["resources"]
    assert "vllm.yaml" in kustomization["resources"]


async def test_the_gateway_really_exports_the_queue_depth_metric() -> None:
    async with fronting(FakeBackend()) as gw:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{gw.url}/metrics")).text
    for name in (QUEUE_DEPTH_METRIC, FLEET_ENGINE_QUEUE_METRIC, ADMISSION_QUEUE_METRIC):
        assert re.search(rf"^{name} \d", text, re.MULTILINE), name

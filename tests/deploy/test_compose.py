"""compose.yaml and its Prometheus config: they follow their schemas and agree with the code."""

from __future__ import annotations

import re
import runpy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.cli import build_parser
from gateway.config.settings import Settings
from tests.deploy.manifests import (
    COMPOSE,
    PROMETHEUS,
    ROOT,
    compose,
    compose_raw,
    compose_schema,
    compose_vllm_args,
    flags,
    interpolate,
)

GATEWAY_PORT = Settings.model_fields["port"].default  # 8080
ADMIN_PORT = 8081  # compose.yaml's GATEWAY_ADMIN__PORT
VLLM_PORT = 8000  # vLLM's default --port
ENGINES = "engines"  # the internal network of the vLLM servers and simulators
# vLLM's dev routes (sleep, wake_up, ...), which the capacity manager needs; no API key on them.
DEV_MODE = "VLLM_SERVER_DEV_MODE"


def gateway_env() -> dict[str, str]:
    """The gateway's environment as compose sets it with no variables in the shell or .env:
    a name without a value (passed through from there) is left unset."""
    env = compose()["services"]["gateway"]["environment"]
    return {k: str(v) for k, v in env.items() if v is not None}


def healthcheck_url(service: dict[str, Any]) -> str:
    """host:port/path of the URL a service's health check fetches."""
    [url] = re.findall(r"http://([^'\"\s,)]+)", " ".join(service["healthcheck"]["test"]))
    return str(url)


def test_compose_follows_the_compose_specification() -> None:
    schema = compose_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []


def test_schema_check_rejects_a_misspelt_key() -> None:
    """The schema check above is not vacuous: an unknown service key fails it."""
    doc = compose()
    doc["services"]["gateway"]["helthcheck"] = doc["services"]["gateway"].pop("healthcheck")
    assert not jsonschema.Draft202012Validator(compose_schema()).is_valid(doc)


def test_gateway_discovers_the_vllm_service_by_its_compose_name() -> None:
    name = gateway_env()["GATEWAY_DISCOVERY__DNS"]
    host, port = name.rsplit(":", 1)
    services = compose()["services"]
    assert host == "vllm"
    assert host in services
    vllm_flags = flags(services["vllm"]["command"])
    assert int(port) == int(vllm_flags["--port"] or 0) == VLLM_PORT
    assert str(VLLM_PORT) in services["vllm"]["expose"]
    # The vllm service itself carries no fixed container name or host port, so --scale works.
    assert "container_name" not in services["vllm"]
    assert "ports" not in services["vllm"]


def test_sim_profile_answers_to_the_same_name_and_port() -> None:
    sim = compose()["services"]["sim"]
    assert sim["profiles"] == ["sim"]
    assert "vllm" in sim["networks"][ENGINES]["aliases"]
    args = build_parser(sim["command"]).parse_args(sim["command"])  # the real CLI accepts them
    assert args.command == "sim"
    assert args.port == VLLM_PORT
    assert args.host == "0.0.0.0"
    assert (
        args.served_model_name
        == flags(compose()["services"]["vllm"]["command"])["--served-model-name"]
    )


def networks_of(service: dict[str, Any]) -> set[str]:
    """The networks a service joins (a list or a mapping; none given: the default one)."""
    return set(service.get("networks", ["default"]))


def engine_services() -> dict[str, dict[str, Any]]:
    """Every vLLM server (the GPU slot script runs `vllm serve`) and simulator, any profile."""
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if svc.get("entrypoint") == ["bash", "/opt/llm-gateway/vllm-gpu-slot.sh"]
        or svc.get("command", [None])[0] == "sim"
    }


def test_engines_are_on_an_internal_network_alone_and_publish_no_port() -> None:
    """vLLM's dev routes answer without an API key: in every profile the engines are on an
    internal network that only the gateways and Prometheus join, with no address for the host
    on its bridge, and nothing of theirs is published."""
    doc = compose()
    engines = engine_services()
    assert set(engines) == {
        "vllm",
        "sim",
        "vllm-prefill-0",
        "vllm-decode-0",
        "sim-prefill-0",
        "sim-decode-0",
    }
    network = doc["networks"][ENGINES]
    assert network["internal"] is True
    assert network["driver_opts"] == {"com.docker.network.bridge.inhibit_ipv4": "true"}
    assert network.get("driver", "bridge") == "bridge"
    for name, svc in engines.items():
        assert networks_of(svc) == {ENGINES}, name
        assert "ports" not in svc, name
        assert "network_mode" not in svc, name
    joined = {n for n, svc in doc["services"].items() if ENGINES in networks_of(svc)}
    assert joined == set(engines) | {"gateway", "gateway-pd", "prometheus"}
    # Nothing else publishes a port on the host that leads to an engine: only the gateways,
    # Prometheus and Grafana publish, and none of those is an engine.
    published = {n for n, svc in doc["services"].items() if svc.get("ports")}
    assert published == {"gateway", "gateway-pd", "prometheus", "grafana"}
    # Those that publish need a network with a way out besides: a port on an internal network
    # alone is not published.
    for name in published:
        assert networks_of(doc["services"][name]) - {ENGINES}, name


def test_dev_mode_is_on_for_the_capacity_manager_in_the_gpu_and_sim_profiles() -> None:
    services = compose()["services"]
    assert services["vllm"]["environment"][DEV_MODE] == "1"
    assert services["sim"]["environment"][DEV_MODE] == "1"


def test_vllm_servers_load_offline_what_vllm_weights_downloaded() -> None:
    """With no way out of their network, the vLLM servers read the model from the cache volume
    that the one-shot `vllm-weights` fills first, on the ordinary network."""
    services = compose()["services"]
    weights = services["vllm-weights"]
    assert ENGINES not in networks_of(weights)
    assert "ports" not in weights
    assert weights.get("restart", "no") == "no"
    [script] = [v.split(":")[0] for v in weights["volumes"] if v.endswith(".py:ro")]
    assert (COMPOSE.parent / script).is_file()
    assert weights["entrypoint"] == ["python3", "/opt/llm-gateway/vllm-weights.py"]
    for name, svc in engine_services().items():
        if svc["command"][0] == "sim":
            continue
        assert set(svc["profiles"]) <= set(weights["profiles"]), name
        assert svc["image"] == weights["image"], name
        assert svc["environment"]["HF_HUB_OFFLINE"] == "1", name
        assert svc["depends_on"] == {
            "vllm-weights": {"condition": "service_completed_successfully"}
        }, name
        assert flags(svc["command"])["--model"] == weights["environment"]["MODEL"], name
        cache = "hf-cache:/root/.cache/huggingface"
        assert cache in svc["volumes"], name
        assert cache in weights["volumes"], name


def test_vllm_weights_fetches_one_weight_format() -> None:
    """What vllm-weights.py skips: the formats vLLM never loads, and all weight formats but
    the one vLLM would pick (safetensors first)."""
    script = runpy.run_path(str(ROOT / "deploy" / "compose" / "vllm-weights.py"))
    ignored = script["ignored"]
    both = ["config.json", "model-00001.safetensors", "pytorch_model.bin", "original/x.pth"]
    assert "*.bin" in ignored(both)
    assert "*.safetensors" not in ignored(both)
    assert "original/*" in ignored(both)
    only_bin = ["config.json", "pytorch_model.bin"]
    assert "*.bin" not in ignored(only_bin)


def test_gateway_environment_is_valid_gateway_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GATEWAY_* variable names a real setting, and together they load."""
    env = gateway_env()
    for key in env:
        path = key.removeprefix("GATEWAY_").lower().split("__")
        model: Any = Settings
        for part in path:
            assert part in model.model_fields, f"{key}: no setting {part!r}"
            model = model.model_fields[part].annotation
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.port == GATEWAY_PORT
    assert settings.host == "0.0.0.0"
    assert settings.discovery.dns == ["vllm:8000"]


def test_ports_and_health_paths_match_the_servers() -> None:
    services = compose()["services"]
    gw = services["gateway"]
    assert healthcheck_url(gw) == f"127.0.0.1:{GATEWAY_PORT}/health"
    assert any(p.endswith(f":{GATEWAY_PORT}") for p in gw["ports"])
    assert healthcheck_url(services["vllm"]) == f"127.0.0.1:{VLLM_PORT}/health"
    assert healthcheck_url(services["sim"]) == f"127.0.0.1:{VLLM_PORT}/health"


def test_gateway_waits_for_redis_and_finds_the_servers_itself() -> None:
    """Redis first; the servers are found by DNS and probed as they come, so the gateway has
    no depends_on on them (compose 2.26 cannot ``down`` a project whose depends_on names a
    service without containers: docker/compose#11686)."""
    deps = compose()["services"]["gateway"]["depends_on"]
    assert deps == {"redis": {"condition": "service_healthy"}}
    assert gateway_env()["GATEWAY_LIMITS__REDIS__URL"].startswith("redis://redis:6379")


def test_redis_keeps_its_data_on_a_named_volume() -> None:
    """The fleet's change log, run-time keys and budgets live in Redis: an append-only file
    fsync'd every second, in a volume that outlives the container."""
    redis = compose()["services"]["redis"]
    assert redis["command"][0] == "redis-server"
    args = flags(redis["command"][1:])
    assert args["--appendonly"] == "yes"
    assert args["--appendfsync"] == "everysec"
    # Named, since Debian's redis-server (the test images) starts in / and the official
    # image's in /data.
    assert args["--dir"] == "/data"
    assert "redis-data:/data" in redis["volumes"]
    assert "redis-data" in compose()["volumes"]


def test_admin_api_on_every_replica_only_with_a_token_from_the_shell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every gateway replica serves the admin API on the project's network (at gateway:8081,
    whichever replica answers), published on loopback only; and only with a token, which
    compose passes through from the shell or .env: none there, none in the container."""
    gateway = compose()["services"]["gateway"]
    assert "GATEWAY_ADMIN__TOKEN" in gateway["environment"]
    assert gateway["environment"]["GATEWAY_ADMIN__TOKEN"] is None  # passed through, no default
    for key, value in gateway_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GATEWAY_ADMIN__TOKEN", raising=False)
    settings = Settings()
    assert settings.admin.host == "0.0.0.0"
    assert settings.admin.port == ADMIN_PORT != settings.port
    assert settings.admin.token is None  # no token, no admin API
    assert str(ADMIN_PORT) in gateway["expose"]
    # Opening the gateway to other hosts (PUBLISH_ADDRESS) leaves the admin port on loopback;
    # ADMIN_PUBLISH_PORT= (empty) gives each replica a free port, as GATEWAY_PUBLISH_PORT=.
    opened = interpolate(compose_raw(), {"PUBLISH_ADDRESS": "0.0.0.0", "ADMIN_PUBLISH_PORT": ""})
    ports = opened["services"]["gateway"]["ports"]
    assert f"0.0.0.0:8080:{GATEWAY_PORT}" in ports
    assert f"127.0.0.1::{ADMIN_PORT}" in ports


def test_vllm_runs_with_production_engine_arguments() -> None:
    args = flags(compose_vllm_args())
    assert 0.5 <= float(args["--gpu-memory-utilization"] or 0) < 1
    for required in (
        "--max-num-seqs",
        "--max-model-len",
        "--block-size",
        "--kv-offloading-size",
        "--tensor-parallel-size",
    ):
        assert int(float(args[required] or 0)) > 0, required
    assert "--enable-prefix-caching" in args
    assert "--swap-space" not in args  # removed in vLLM's V1 engine; 0.32 refuses it
    gpus = compose()["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_mounted_files_exist() -> None:
    for service in compose_raw()["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):  # a file, or a folder of them (Grafana's provisioning)
                assert (COMPOSE.parent / source).exists(), source


def test_gpu_slot_script_is_valid_bash() -> None:
    script = ROOT / "deploy" / "compose" / "vllm-gpu-slot.sh"
    entry = compose()["services"]["vllm"]["entrypoint"]
    assert entry == ["bash", "/opt/llm-gateway/vllm-gpu-slot.sh"]
    done = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_prometheus_scrapes_the_gateway_and_every_vllm_replica() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    services = compose()["services"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "vllm"}
    for job, port in (("gateway", GATEWAY_PORT), ("vllm", VLLM_PORT)):
        [sd] = jobs[job]["dns_sd_configs"]
        assert sd["names"] == [job]
        assert job in services
        assert sd["port"] == port
        assert jobs[job]["metrics_path"] == "/metrics"
    mounts = services["prometheus"]["volumes"]
    rel = Path(PROMETHEUS).relative_to(ROOT)
    assert f"./{rel}:/etc/prometheus/prometheus.yml:ro" in mounts

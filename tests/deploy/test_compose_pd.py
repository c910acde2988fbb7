"""compose.yaml's pd and pd-sim profiles: a prefill pool and a decode pool behind gateway-pd,
whose backend list, roles and KV connector settings agree with each other and with the code."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import pytest

from gateway.cli import build_parser
from gateway.config.settings import Settings
from tests.deploy.manifests import compose, flags
from tools.sim.cli import config_from_args

KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def services() -> dict[str, Any]:
    return compose()["services"]  # type: ignore[no-any-return]


def gateway_pd_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in services()["gateway-pd"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    return Settings()


def engines_aliases(service: dict[str, Any]) -> list[str]:
    """The names a service answers to on the engines' network, besides its own."""
    networks = service.get("networks", [])  # a list of names, or a mapping with aliases
    if not isinstance(networks, dict):
        return []
    return list((networks.get("engines") or {}).get("aliases", []))


def kv_role(command: list[str]) -> str:
    config = json.loads(
        flags([a for a in command if a.startswith("--")])["--kv-transfer-config"] or ""
    )
    assert config["kv_connector"] == "NixlConnector"
    return str(config["kv_role"])


def test_profiles() -> None:
    s = services()
    assert s["gateway-pd"]["profiles"] == ["pd", "pd-sim"]
    assert {n for n, v in s.items() if v.get("profiles") == ["pd"]} == {
        "vllm-prefill-0",
        "vllm-decode-0",
    }
    assert {n for n, v in s.items() if v.get("profiles") == ["pd-sim"]} == {
        "sim-prefill-0",
        "sim-decode-0",
    }


def test_gateway_pd_has_a_prefill_and_a_decode_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = gateway_pd_settings(monkeypatch)
    assert sorted(b.role for b in settings.backends) == ["decode", "prefill"]
    assert settings.disagg.prefill.policy == "least_load"
    assert "depends_on" not in services()["gateway-pd"]  # it probes its backends itself
    for b in settings.backends:
        url = urlsplit(b.url)
        assert url.port == 8000
        vllm = services()[str(url.hostname)]  # the vLLM service of that name (profile pd)...
        assert kv_role(vllm["command"]) == KV_ROLE[b.role]
        assert "--port=8000" in vllm["command"]
        assert vllm["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == url.hostname
        [sim_name] = [  # ...and the simulator answering to that name (profile pd-sim)
            n for n, v in services().items() if url.hostname in engines_aliases(v)
        ]
        sim = services()[sim_name]
        args = build_parser(sim["command"]).parse_args(sim["command"])
        assert args.command == "sim"
        assert args.port == 8000
        assert config_from_args(args).kv_role == KV_ROLE[b.role]

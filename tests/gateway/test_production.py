"""The production configuration, every feature on at once: what breaks only in combination."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import QUEUE_DEPTH_METRIC
from tests.gateway.production import ADMIN, ALIAS, auth, running_production

CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


async def test_metrics_answer_with_the_admission_queue_and_every_other_feature_on(
    redis_url: str, redis_prefix: str
) -> None:
    """/metrics (and /admin/metrics) must not fail exactly when the queue matters (issue 16.1)."""
    async with (
        running_production(redis_url, redis_prefix) as prod,
        aiohttp.ClientSession() as s,
    ):
        for name in ("alice", "bob"):
            async with s.post(
                prod.url + "/v1/chat/completions", json=CHAT, headers=auth(name)
            ) as r:
                assert r.status == 200, await r.text()
        async with s.get(prod.url + "/metrics") as r:
            assert r.status == 200
            public = families(await r.text())
        async with s.get(prod.admin_url + "/admin/metrics", headers=ADMIN) as r:
            assert r.status == 200
            admin = families(await r.text())
    for got in (public, admin):
        assert QUEUE_DEPTH_METRIC in got
        outcomes = {
            labels["outcome"]: v for labels, v in got["llm_gateway_admission_outcomes_total"]
        }
        assert outcomes["admitted_at_once"] == 2
        assert "llm_gateway_prefix_affinity_decisions_total" in got
        assert any(
            labels["pool"] in ("stable", "canary")
            for labels, _ in got["llm_gateway_pool_requests_total"]
        )

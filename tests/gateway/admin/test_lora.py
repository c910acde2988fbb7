"""LoRA adapters: routed only to the backends that serve them, loaded and unloaded across the
fleet through the admin API, and packed onto few backends on request."""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp

from gateway.admin.lora import place
from tests.helpers import RunningGateway, gateway_for, wait_for
from tools.sim import RunningSim, SimConfig

TOKEN = "lora-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = SimConfig(step_base_ms=1.0)
LORA = FAST.replace(enable_lora=True)
MODEL = "sim-model"


async def answered_by(
    s: aiohttp.ClientSession, gw: RunningGateway, model: str, n: int
) -> Counter[str]:
    """Which backend answered each of ``n`` requests for ``model`` (from the gateway's log of
    where it sent them: the backend's own model name is in the answer)."""
    seen: Counter[str] = Counter()
    for _ in range(n):
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == model
    pool = gw.svc.pool
    for b in pool.all():
        seen[b.id] = b.sent_total
    return seen


async def admin(
    s: aiohttp.ClientSession, gw: RunningGateway, path: str, body: Any
) -> tuple[int, Any]:
    assert gw.admin_url is not None
    async with s.post(gw.admin_url + path, json=body, headers=AUTH) as r:
        return r.status, await r.json()


async def test_a_static_adapter_is_routed_only_to_the_backend_that_serves_it() -> None:
    with_adapter = LORA.replace(lora_modules=(("sql-lora", "/adapters/sql"),))
    a = RunningSim(with_adapter)
    b = RunningSim(FAST)
    async with gateway_for(a, b, policy="round_robin") as (gw, s):
        async with s.get(gw.url + "/v1/models") as r:
            assert {m["id"] for m in (await r.json())["data"]} == {MODEL, "sql-lora"}
        sent = await answered_by(s, gw, "sql-lora", 6)
        assert sent == Counter({a.url[7:]: 6, b.url[7:]: 0})
        sent = await answered_by(s, gw, MODEL, 4)  # the base model still goes to both
        assert sent[b.url[7:]] == 2


async def test_adapters_load_packed_onto_few_backends_and_unload_everywhere() -> None:
    a = RunningSim(LORA)
    b = RunningSim(LORA)
    c = RunningSim(LORA)
    async with gateway_for(a, b, c, policy="round_robin", admin={"token": TOKEN}) as (gw, s):
        load = {"lora_name": "chat-lora", "lora_path": "/adapters/chat", "model": MODEL}
        status, doc = await admin(s, gw, "/admin/lora/load", load | {"replicas": 2})
        assert status == 200, doc
        assert len(doc["loaded"]) == 2
        assert doc["failed"] == {}
        holders = set(doc["loaded"])
        # Asked again, it stays on the same two: they already hold it.
        status, doc = await admin(s, gw, "/admin/lora/load", load | {"replicas": 2})
        assert status == 200
        assert set(doc["already"]) == holders
        assert doc["loaded"] == []
        before = {b.id: b.sent_total for b in gw.svc.pool.all()}
        after = await answered_by(s, gw, "chat-lora", 6)
        assert {i for i in after if after[i] > before[i]} == holders
        # Unloaded from every backend holding it: the name is unknown again.
        status, doc = await admin(s, gw, "/admin/lora/unload", {"lora_name": "chat-lora"})
        assert status == 200, doc
        assert set(doc["unloaded"]) == holders
        body = {"model": "chat-lora", "prompt": "hi", "max_tokens": 2}
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        # Loaded on all of them when no number is given.
        status, doc = await admin(s, gw, "/admin/lora/load", load)
        assert sorted(doc["loaded"]) == sorted(b.id for b in gw.svc.pool.all())


async def test_bad_adapter_requests_are_refused_and_backend_refusals_reported() -> None:
    a = RunningSim(LORA)
    plain = RunningSim(FAST)  # no --enable-lora: vLLM has no load route then
    async with gateway_for(a, plain, admin={"token": TOKEN}) as (gw, s):
        pool = gw.svc.pool
        await wait_for(lambda: all(b.models for b in pool.all()))
        good = {"lora_name": "x-lora", "lora_path": "/p", "model": MODEL}
        for bad, status in (
            ({"lora_name": "x-lora", "model": MODEL}, 400),  # no path
            (good | {"colour": "red"}, 400),
            (good | {"replicas": 0}, 400),
            (good | {"model": "nope"}, 404),
            (good | {"lora_name": MODEL}, 400),
            (good | {"backends": ["not-a-backend"]}, 400),
        ):
            got, doc = await admin(s, gw, "/admin/lora/load", bad)
            assert got == status, (bad, doc)
            assert "error" in doc
        assert all("x-lora" not in b.models for b in pool.all())  # nothing changed
        # The backend without LoRA says no; the one with it loads: both reported.
        got, doc = await admin(s, gw, "/admin/lora/load", good)
        assert got == 200
        assert doc["loaded"] == [a.url[7:]]
        assert list(doc["failed"]) == [plain.url[7:]]
        got, doc = await admin(s, gw, "/admin/lora/unload", {"lora_name": "nope"})
        assert got == 404


def test_placement_keeps_holders_then_takes_the_least_loaded() -> None:
    assert place(["b"], [("a", 5), ("c", 1), ("d", 3)], 3) == ["b", "c", "d"]
    assert place(["b", "e"], [("a", 0)], 1) == ["b"]
    assert place([], [("a", 2), ("b", 2)], 5) == ["a", "b"]

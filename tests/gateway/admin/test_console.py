"""The console's server side: its assets without the token (and nothing else), its security
headers, ``/admin/stats`` (the retry budget and the admission queue's sheddings among it), what
the capacity panel reads, the script's look-ups and the audit log of admin actions."""

from __future__ import annotations

import re
from importlib.resources import files

from redis.asyncio import Redis
from structlog.testing import capture_logs

from gateway.admin.console import ASSETS, PUBLIC_PATHS
from gateway.admin.stats import stats_document
from gateway.limits.retry_budget import LocalBudget, RetryBudgetPolicy
from gateway.limits.retry_budget_redis import RedisBudget
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.retry_budget_metrics import RetryBudgetCollector
from policies import POLICY_NAMES
from tests import budget_and_shed
from tests.helpers import FakeBackend, gateway_for, sample, stream_chat

TOKEN = "console-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_the_console_assets_are_served_without_the_token_with_a_strict_policy() -> None:
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        for path, (_name, content_type) in ASSETS.items():
            async with s.get(gw.admin_url + path) as r:
                assert r.status == 200, path
                assert r.headers["Content-Type"] == content_type
                csp = r.headers["Content-Security-Policy"]
                assert "default-src 'none'" in csp
                assert "connect-src 'self'" in csp
                assert "frame-ancestors 'none'" in csp
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                body = await r.text()
                assert TOKEN not in body
        async with s.get(gw.admin_url + "/") as r:
            page = await r.text()
        # Every asset the page names is one of ours, on this listener.
        for ref in ("/console/console.js", "/console/console.css", "/console/icon.svg"):
            assert ref in page
        assert "http://" not in page
        assert "https://" not in page


async def test_only_the_assets_are_open_everything_else_needs_the_token() -> None:
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        for method, path in (
            ("GET", "/admin/stats"),
            ("GET", "/admin/backends"),
            ("POST", "/"),  # an asset's path, but not a GET
            ("GET", "/console/"),
            ("GET", "/console/../admin/policy"),
        ):
            async with s.request(method, gw.admin_url + path) as r:
                assert r.status in (401, 404, 405), (method, path, r.status)
                assert r.status != 200
        async with s.get(gw.admin_url + "/admin/stats", headers={"Authorization": "Bearer x"}) as r:
            assert r.status == 401
    assert all(p == "/" or p.startswith("/console/") for p in PUBLIC_PATHS)


async def test_stats_count_requests_by_backend_and_status_and_their_ttft() -> None:
    a, b = FakeBackend(behaviour=stream_chat(3)), FakeBackend(behaviour=stream_chat(3))
    async with gateway_for(a, b, admin={"token": TOKEN}, policy="round_robin") as (gw, s):
        assert gw.admin_url is not None
        for _ in range(6):
            body = {"model": "m", "stream": True, "messages": []}
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
        async with s.get(gw.admin_url + "/admin/stats", headers=AUTH) as r:
            assert r.status == 200
            doc = await r.json()
        ids = {a.url[7:], b.url[7:]}
        assert set(doc["backends"]) >= ids
        for bid in ids:
            assert doc["backends"][bid]["requests"] == {"200": 3.0}
            ttft = doc["backends"][bid]["ttft"]
            assert ttft[-1][0] is None  # +Inf, as JSON can say it
            assert ttft[-1][1] == 3.0
            les = [le for le, _ in ttft[:-1]]
            assert les == sorted(les)
        assert doc["queue_depth"] == 0.0
        assert doc["admission"]["waiting"] == 0.0
        assert doc["rate_limit_rejections"] == []


async def test_get_policy_lists_the_policies_a_put_accepts() -> None:
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        async with s.get(gw.admin_url + "/admin/policy", headers=AUTH) as r:
            doc = await r.json()
        assert doc["policies"] == list(POLICY_NAMES)
        assert doc["policy"] in doc["policies"]


async def test_admin_actions_and_refused_tokens_are_logged_without_the_token() -> None:
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        bid = fake.url[7:]
        with capture_logs() as logs:
            async with s.post(f"{gw.admin_url}/admin/backends/{bid}/drain", headers=AUTH) as r:
                assert r.status == 200
            async with s.post(f"{gw.admin_url}/admin/backends/nope/drain", headers=AUTH) as r:
                assert r.status == 404
            async with s.put(gw.admin_url + "/admin/policy", json={"policy": "x"}, headers=AUTH):
                pass
            bad = {"Authorization": "Bearer not-the-token"}
            async with s.post(f"{gw.admin_url}/admin/backends/{bid}/undrain", headers=bad) as r:
                assert r.status == 401
            async with s.get(gw.admin_url + "/admin/backends", headers=AUTH):
                pass  # reads are not actions
        actions = [e for e in logs if e["event"] == "admin_action"]
        assert [(e["method"], e["path"], e["status"]) for e in actions] == [
            ("POST", f"/admin/backends/{bid}/drain", 200),
            ("POST", "/admin/backends/nope/drain", 404),
            ("PUT", "/admin/policy", 400),
        ]
        assert "error" in actions[2]
        drained = [e for e in logs if e["event"] == "backend_drain_changed"]
        assert drained == [
            {
                "event": "backend_drain_changed",
                "backend": bid,
                "draining": True,
                "was": False,
                "log_level": "info",
            }
        ]
        refused = [e for e in logs if e["event"] == "admin_token_refused"]
        assert len(refused) == 1
        assert refused[0]["given"] == "wrong"
        assert "not-the-token" not in repr(logs)
        assert TOKEN not in repr(logs)


def test_stats_document_groups_counters_from_the_registry() -> None:
    m = GatewayMetrics()
    m.requests.labels("m", "b1", "200", "chat").inc(3)
    m.requests.labels("other", "b1", "200", "embeddings").inc(2)
    m.requests.labels("m", "b1", "503", "chat").inc()
    m.ttft.labels("m", "b1").observe(0.02)
    m.ttft.labels("other", "b1").observe(0.2)
    m.itl.labels("m", "b1").observe(0.01)
    m.pool_requests.labels("chat", "stable", "200").inc(9)
    m.pool_requests.labels("chat", "canary", "200").inc(1)
    m.retries.labels("b1", "unreachable").inc()
    doc = stats_document(m.registry.collect(), at=12.5)
    assert doc["at"] == 12.5
    b1 = doc["backends"]["b1"]
    assert b1["requests"] == {"200": 5.0, "503": 1.0}  # summed over models and endpoints
    ttft = dict(b1["ttft"])
    assert ttft[0.025] == 1.0
    assert ttft[0.25] == 2.0
    assert ttft[None] == 2.0
    assert dict(b1["itl"])[None] == 1.0
    assert doc["aliases"] == {"chat": {"stable": {"200": 9.0}, "canary": {"200": 1.0}}}
    assert doc["retries"] == {"unreachable": 1.0}


async def test_stats_carry_the_retry_budget_and_the_requests_the_admission_queue_shed() -> None:
    """Retries taken and refused by the budget, and a request shed by priority, for real: the
    document says each as the registry counts it."""
    a, b = budget_and_shed.backends()
    settings = {**budget_and_shed.SETTINGS, "admin": {"token": TOKEN}}
    async with gateway_for(a, b, names=budget_and_shed.NAMES, **settings) as (gw, s):
        assert gw.admin_url is not None
        statuses = await budget_and_shed.retried(s, gw.url)
        await budget_and_shed.shed_one(s, gw.url, gw.svc, a, b)
        async with s.get(gw.admin_url + "/admin/stats", headers=AUTH) as r:
            doc = await r.json()

        def counted(kind: str, outcome: str) -> float:
            name = "llm_gateway_retry_budget_attempts_total"
            return sample(gw, name, kind=kind, outcome=outcome)

        budget = doc["retry_budget"]
        assert budget["attempts"] == {
            kind: {"taken": counted(kind, "taken"), "refused": counted(kind, "refused")}
            for kind in ("retry", "hedge", "continuation")
        }
        retry = budget["attempts"]["retry"]
        assert retry["taken"] >= 1
        assert retry["refused"] == statuses[503] >= 1  # each refusal: a's 503 passed on
        assert budget["use"] == sample(gw, "llm_gateway_retry_budget_use") > 0
        assert (budget["shared"], budget["degraded"]) == (False, False)  # its own: no Redis
        assert doc["admission"]["outcomes"]["shed"] == 1.0


async def test_stats_say_a_budget_shared_on_redis_and_one_deciding_alone() -> None:
    policy = RetryBudgetPolicy(ratio=0.5, min_per_second=0, window=10)
    client = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.05)
    shared = RedisBudget(client, policy, key_prefix="none:", clock=lambda: 0.0)
    try:
        m = GatewayMetrics()
        m.registry.register(RetryBudgetCollector(lambda: shared))
        budget = stats_document(m.registry.collect(), at=1.0)["retry_budget"]
        assert (budget["shared"], budget["degraded"], budget["use"]) == (True, False, 0.0)
        shared.deposit()
        shared.deposit()
        await shared.flush()  # Redis out of reach: decides alone from now on
        assert await shared.take("hedge") is True
        budget = stats_document(m.registry.collect(), at=2.0)["retry_budget"]
        assert (budget["shared"], budget["degraded"], budget["use"]) == (True, True, 1.0)
        assert budget["attempts"]["hedge"] == {"taken": 1.0, "refused": 0.0}
    finally:
        await client.aclose()
    # A registry without the budget's collector (a gateway of before it): none said.
    assert stats_document(GatewayMetrics().registry.collect(), at=3.0)["retry_budget"] is None
    own = GatewayMetrics()
    local = LocalBudget(policy, clock=lambda: 0.0)
    own.registry.register(RetryBudgetCollector(lambda: local))
    budget = stats_document(own.registry.collect(), at=4.0)["retry_budget"]
    assert (budget["shared"], budget["degraded"]) == (False, False)


def test_every_element_the_script_looks_up_is_on_the_page() -> None:
    """The script finds the page's parts by id (``$("...")``): a panel added to one and not the
    other would fail only in a browser."""
    package = files("gateway.admin.console")
    script = package.joinpath("console.js").read_text()
    page = package.joinpath("index.html").read_text()
    wanted = set(re.findall(r'\$\("([A-Za-z0-9_-]+)"\)', script))
    there = set(re.findall(r'\bid="([A-Za-z0-9_-]+)"', page))
    assert {"capacity-card", "engines", "capacity-models", "capacity-tiles"} <= wanted
    assert {"retry-budget-block", "retry-budget-state", "retry-budget"} <= wanted
    assert wanted - there == set()


async def test_the_capacity_view_gives_each_engines_state_and_for_how_long() -> None:
    """What the console's capacity panel reads: an engine slept by hand with the manager off is
    going to sleep (nothing puts it to sleep), since when; the others awake since it started."""
    a, b = FakeBackend(), FakeBackend()
    async with gateway_for(a, b, names=["a", "b"], admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        async with s.post(f"{gw.admin_url}/admin/backends/b/sleep", headers=AUTH) as r:
            assert r.status == 200, await r.text()
        async with s.get(gw.admin_url + "/admin/capacity", headers=AUTH) as r:
            view = await r.json()
    assert (view["enabled"], view["managing"], view["look"]) == (False, False, {})
    engines = {e["backend"]: e for e in view["engines"]}
    assert (engines["a"]["state"], engines["a"]["state_for_s"]) == ("awake", None)
    assert engines["b"]["state"] == "going_to_sleep"
    assert engines["b"]["sleep_wanted"] is True
    assert 0 <= engines["b"]["state_for_s"] < 30
    assert view["states"] == {"awake": 1, "going_to_sleep": 1, "asleep": 0, "waking": 0}

"""``docker compose --profile sim`` for real (``make compose-test``): the gateway image built,
three simulators, Redis, Prometheus and the gateway started, then scaled, broken and stopped,
as an operator would, through the ports compose publishes on 127.0.0.1.

The tests share one running project and build on each other's state (scale five, then two,
then a kill, then two gateways, an admin change and a Redis restart, then a stop), so they run
in this order; the module's fixture removes everything at the end, also when a test failed.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import httpx
import openai
import pytest

from tests.compose.stack import (
    ADMIN_TOKEN,
    KEY,
    MODEL,
    Stack,
    docker,
    eventually,
    local_images,
    metrics,
    per_backend,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(600)]

REQUESTS = "llm_gateway_requests_total"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(local_images())
    try:
        started = time.monotonic()
        s.compose("build", timeout=900)
        built = time.monotonic()
        s.up(sim=3, gateway=1)
        gateway = s.url("gateway", 8080)
        eventually(lambda: routable(gateway) == 3, within=90, what="3 simulators routable")
        print(
            f"\ncompose: built in {built - started:.0f} s, three simulators routable "
            f"{time.monotonic() - built:.0f} s after `up`"
        )
        yield s
    finally:
        s.down()
        left = s.leftovers()
        assert left == [], f"compose down left {left}"


def routable(gateway: str) -> float:
    return metrics(gateway).get(("llm_gateway_routable_backends", ()), -1.0)


def backends_up(gateway: str) -> set[str]:
    return {b for b, v in per_backend(gateway, "llm_gateway_backend_up").items() if v == 1}


async def stream(
    s: aiohttp.ClientSession, url: str, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[int, int, str | None]:
    """One streamed chat request read to its end: status, content chunks, finish reason."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    chunks, finish = 0, None
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            await r.read()
            return r.status, 0, None
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            chunks += bool(choice["delta"].get("content"))
            finish = choice.get("finish_reason") or finish
    return 200, chunks, finish


def test_a_chat_stream_through_the_published_port_with_the_openai_sdk(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url("gateway", 8080) + "/v1", api_key="none")
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello from compose"}],
        max_tokens=24,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert sum(1 for p in pieces if p) == 24
    assert finish == "length"


def test_prometheus_scrapes_the_gateway_and_every_simulator(stack: Stack) -> None:
    prometheus = stack.url("prometheus", 9090)

    def targets() -> Counter[str]:
        doc = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()
        return Counter(
            t["labels"]["job"] for t in doc["data"]["activeTargets"] if t["health"] == "up"
        )

    eventually(lambda: targets() == {"gateway": 1, "vllm": 3}, within=60, what="targets up")
    rules = httpx.get(prometheus + "/api/v1/rules", timeout=5).json()["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} >= {"LLMGatewayBackendDown"}


def test_the_simulators_are_on_the_internal_engines_network_alone(stack: Stack) -> None:
    """Their dev routes answer without a key (VLLM_SERVER_DEV_MODE): each simulator is on the
    project's `engines` network only, with nothing published, and that network is internal and
    gives the host no address on its bridge, so the host has no route to them. The gateway
    reaching them is the rest of this file; Prometheus reaching them, the test above."""
    [network] = json.loads(docker("network", "inspect", f"{stack.project}_engines"))
    assert network["Internal"] is True
    bridge = network["Options"].get("com.docker.network.bridge.name") or f"br-{network['Id'][:12]}"
    host_side = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", bridge],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert host_side.strip() == "", host_side
    sims = stack.containers("sim")
    assert len(sims) == 3
    for sim in sims:
        [info] = json.loads(docker("inspect", sim))
        assert set(info["NetworkSettings"]["Networks"]) == {f"{stack.project}_engines"}
        assert all(not bound for bound in info["NetworkSettings"]["Ports"].values()), sim
        assert "VLLM_SERVER_DEV_MODE=1" in info["Config"]["Env"]


async def test_scaled_to_five_the_gateway_routes_to_all_five(stack: Stack) -> None:
    stack.up(sim=5)
    gateway = stack.url("gateway", 8080)
    eventually(lambda: len(backends_up(gateway)) == 5, within=60, what="five backends up")
    before = per_backend(gateway, REQUESTS)
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(stream(s, gateway, 40) for _ in range(25)))
    assert all(r == (200, 40, "length") for r in results), results
    after = per_backend(gateway, REQUESTS)
    served = {b for b in backends_up(gateway) if after.get(b, 0) > before.get(b, 0)}
    assert len(served) == 5, f"only {served} served"


async def test_scaled_back_to_two_its_streams_finish_and_no_new_request_goes_there(
    stack: Stack,
) -> None:
    gateway = stack.url("gateway", 8080)
    five = backends_up(gateway)
    async with aiohttp.ClientSession() as s:
        # About 4 s each at the simulator's 22 ms a token, on all five backends.
        streams = [asyncio.create_task(stream(s, gateway, 180)) for _ in range(20)]
        await asyncio.sleep(1.0)  # sleep-ok: let every stream start before the scale-down
        scaled = asyncio.create_task(asyncio.to_thread(stack.up, sim=2))
        results = await asyncio.gather(*streams)
        await scaled
    assert all(r == (200, 180, "length") for r in results), results
    eventually(lambda: len(backends_up(gateway)) == 2, within=30, what="two backends left")
    two = backends_up(gateway)
    removed = five - two
    assert len(removed) == 3
    # Gone from the gateway's view (discovery drops them once the DNS no longer lists them,
    # which may come after their probes marked them down), and nothing more is sent there.
    eventually(
        lambda: not removed & set(per_backend(gateway, "llm_gateway_backend_in_flight")),
        within=30,
        what="the three gone from the gateway's view",
    )
    before = per_backend(gateway, REQUESTS)
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(stream(s, gateway, 10) for _ in range(10)))
    assert all(r[0] == 200 for r in results)
    after = per_backend(gateway, REQUESTS)
    grew = {b for b in after if after[b] > before.get(b, 0)}
    assert grew, "nothing answered"
    assert grew <= two, grew


async def test_a_simulator_killed_under_load_loses_no_request(stack: Stack) -> None:
    gateway = stack.url("gateway", 8080)
    victim = stack.containers("sim")[0]
    async with aiohttp.ClientSession() as s:

        async def client(n: int) -> list[tuple[int, int, str | None]]:
            return [await stream(s, gateway, 60) for _ in range(n)]

        load = [asyncio.create_task(client(4)) for _ in range(8)]
        await asyncio.sleep(1.5)  # sleep-ok: the kill lands while streams are running
        await asyncio.to_thread(docker, "kill", victim)
        results = [r for rs in await asyncio.gather(*load) for r in rs]
    assert len(results) == 32
    assert all(r == (200, 60, "length") for r in results), Counter(results)
    m = metrics(gateway)
    moved = sum(v for (name, _), v in m.items() if name == "llm_gateway_retries_total")
    moved += sum(v for (name, _), v in m.items() if name.startswith("llm_gateway_stream_cont"))
    assert moved > 0, "the kill cut nothing: no retry and no continuation"
    await asyncio.to_thread(docker, "rm", "-f", victim)
    stack.up(sim=2)  # a new one in its place
    eventually(lambda: len(backends_up(gateway)) == 2, within=60, what="two backends again")


async def test_two_gateway_replicas_share_one_key_limit_through_redis(stack: Stack) -> None:
    stack.up(gateway=2)
    replicas = [stack.url("gateway", 8080, index=i) for i in (1, 2)]
    for url in replicas:
        eventually(lambda url=url: routable(url) == 2, within=60, what=f"{url} routing")
    headers = {"Authorization": f"Bearer {KEY}"}
    before = [sum(per_backend(url, REQUESTS).values()) for url in replicas]
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(stream(s, replicas[i % 2], 4, headers) for i in range(30)))
    statuses = Counter(r[0] for r in results)
    # 10 a minute for the key across both replicas (one more may refill during the burst),
    # never the 20 two separate limits would admit.
    assert 10 <= statuses[200] <= 11, statuses
    assert statuses[200] + statuses[429] == 30, statuses
    answered = [
        sum(per_backend(url, REQUESTS).values()) - b
        for url, b in zip(replicas, before, strict=True)
    ]
    assert answered == [15, 15], answered  # each replica answered its half (200 or 429)


def test_an_admin_change_reaches_both_replicas_and_outlives_a_redis_restart(
    stack: Stack,
) -> None:
    """A drain through one replica's admin port is applied by the other (one fleet, one change
    log in Redis); after `docker compose restart redis` the log still lists it (the
    append-only file on the redis-data volume)."""
    stack.up(gateway=2)  # as the test before left it; also when run alone (-k)
    admins = [stack.url("gateway", 8081, index=i) for i in (1, 2)]
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def draining(admin: str) -> dict[str, bool]:
        doc = httpx.get(admin + "/admin/backends", headers=auth, timeout=5).json()
        return {b["id"]: b["draining"] for b in doc["backends"]}

    def logged(admin: str) -> list[tuple[str, str]]:
        r = httpx.get(admin + "/admin/changes", headers=auth, timeout=5)
        if r.status_code != 200:
            return []
        return [(c["position"], c["path"]) for c in r.json()["changes"]]

    eventually(
        lambda: set(draining(admins[0])) == set(draining(admins[1])) != set(),
        within=60,
        what="both replicas' admin APIs, with the same backends",
    )
    backend = sorted(draining(admins[0]))[0]
    for admin, verb, state in ((admins[0], "drain", True), (admins[1], "undrain", False)):
        r = httpx.post(f"{admin}/admin/backends/{backend}/{verb}", headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        other = admins[1] if admin == admins[0] else admins[0]
        eventually(
            lambda other=other, state=state: draining(other).get(backend) is state,
            within=10,
            what=f"the {verb} applied by the other replica",
        )
    before = logged(admins[0])
    paths = [path for _, path in before[:2]]
    assert paths == [f"/admin/backends/{backend}/undrain", f"/admin/backends/{backend}/drain"]
    stack.compose("restart", "redis", timeout=60)
    eventually(lambda: logged(admins[1])[:2] == before[:2], within=30, what="the log after")


async def test_sigterm_lets_streams_in_flight_finish_within_the_grace_period(
    stack: Stack,
) -> None:
    stack.up(gateway=1)
    gateway = stack.url("gateway", 8080)
    [container] = stack.containers("gateway")
    async with aiohttp.ClientSession() as s:
        streams = [asyncio.create_task(stream(s, gateway, 150)) for _ in range(10)]
        await asyncio.sleep(1.0)  # sleep-ok: every stream under way before the stop
        stopping = asyncio.create_task(asyncio.to_thread(stack.compose, "stop", "gateway"))
        results = await asyncio.gather(*streams)
        await stopping
    assert all(r == (200, 150, "length") for r in results), results
    state = await asyncio.to_thread(docker, "inspect", "-f", "{{.State.ExitCode}}", container)
    state = state.strip()
    assert state == "0", f"the gateway exited {state} (137: killed at the end of the grace)"
    logs = stack.compose("logs", "--no-log-prefix", "gateway")
    assert re.search(r'"event": ?"gateway_stopped"', logs)

"""precise_prefix on two real vLLM CPU servers publishing KV-cache events.

The servers run with prefix caching (vLLM's default) and ``--kv-events-config``, and a cache
of 16 blocks (of 128 tokens: vLLM's CPU block size) so that a few prompts force evictions.
The gateway's prediction of the cached prefix of a probe prompt is checked against what vLLM
itself counts for that request (``vllm:prefix_cache_hits_total``), before and after
evictions caused by traffic the gateway never saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from gateway.request.messages import chat_view
from policies import PrecisePrefix
from tests.e2e.servers import (
    MODEL_DIR,
    SERVED_MODEL,
    START_DEADLINE,
    VllmServer,
    free_port,
    gateway_for,
    running_vllm_servers,
    vllm_python,
)
from tests.helpers import RunningGateway, wait_for

BLOCKS = 16  # 16 x 128 = 2,048 tokens of KV cache per server
WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "gecko", "harbor", "iris", "jade")
pytestmark = pytest.mark.timeout(START_DEADLINE + 240)


def kv_args(_name: str) -> Sequence[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
    }
    return [
        "--kv-events-config",
        json.dumps(config),
        "--num-gpu-blocks-override",
        str(BLOCKS),
        "--max-model-len",
        "1024",
    ]


@pytest.fixture(scope="module")
def kv_vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    vllm_python()
    log_dir: Path = tmp_path_factory.mktemp("vllm-kv")
    with running_vllm_servers(2, log_dir, extra=kv_args) as servers:
        yield servers


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def hits(server: VllmServer) -> float:
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in body.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:prefix_cache_hits_total missing")


def policy_of(gw: RunningGateway) -> PrecisePrefix:
    policy = gw.svc.router.policy
    assert isinstance(policy, PrecisePrefix)
    return policy


async def quiet(gw: RunningGateway, for_s: float = 0.5) -> None:
    """Until no KV-event batch has arrived for ``for_s``: the index has what vLLM published."""
    feeds = gw.svc.kv_feeds
    assert feeds is not None

    def batches() -> int:
        return sum(st.batches for st in feeds.status.values())

    deadline = time.monotonic() + 15
    seen, since = batches(), time.monotonic()
    while time.monotonic() - since < for_s:
        assert time.monotonic() < deadline, "KV events kept arriving"
        await asyncio.sleep(0.05)  # sleep-ok: polling interval of a deadline-bounded wait
        if batches() != seen:
            seen, since = batches(), time.monotonic()


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> None:
    r = await client.post(
        f"{url}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1},
        timeout=120,
    )
    assert r.status_code == 200, r.text


async def through(
    client: httpx.AsyncClient, gw: RunningGateway, servers: list[VllmServer], prompt: str
) -> tuple[int, float]:
    """Send ``prompt`` through the gateway: which server served it, and vLLM's hits for it."""
    pool = gw.svc.pool
    ids = [b.id for b in pool.all()]
    sent = {b.id: b.sent_total for b in pool.all()}
    before = [hits(s) for s in servers]
    await complete(client, gw.url, prompt)
    chosen = next(i for i, b in enumerate(ids) if pool.get(b).sent_total > sent[b])  # type: ignore[union-attr]
    by_url = next(i for i, s in enumerate(servers) if s.url == pool.all()[chosen].spec.url)
    return by_url, hits(servers[by_url]) - before[by_url]


@asynccontextmanager
async def following(servers: list[VllmServer]) -> AsyncIterator[RunningGateway]:
    """The gateway under precise_prefix with the tiny model's tokenizer, once it follows
    every server's KV events."""
    settings = {"policy": "precise_prefix", "tokenizers": {SERVED_MODEL: str(MODEL_DIR)}}
    async with gateway_for(servers, **settings) as gw:
        index = gw.svc.kv_index
        await wait_for(
            lambda: all(index.exact(b.id) for b in gw.svc.pool.all()),
            within=30.0,
            what="every publisher followed",
        )
        yield gw


def backend_of(gw: RunningGateway, server: VllmServer) -> str:
    return next(b.id for b in gw.svc.pool.all() if b.spec.url == server.url)


async def test_the_predicted_prefix_is_what_vllm_reuses_before_and_after_evictions(
    kv_vllm_servers: list[VllmServer],
) -> None:
    servers = kv_vllm_servers
    rng = random.Random(19)
    async with following(servers) as gw, httpx.AsyncClient() as client:
        index = gw.svc.kv_index
        contexts = [text(rng, 100) for _ in range(3)]  # ~430 tokens: three 128-token blocks
        for ctx in contexts:
            await complete(client, gw.url, ctx + " " + text(rng, 20))
        await quiet(gw)
        tok = gw.svc.tokenizers.get(SERVED_MODEL)
        assert tok is not None
        policy = policy_of(gw)
        checked = 0
        for ctx in contexts:
            probe = ctx + " " + text(rng, 20)
            tokens = tok.prompt_tokens("completions", {"prompt": probe})
            assert tokens is not None
            predicted = {b.id: policy.predicted(tokens, b.id) for b in gw.svc.pool.all()}
            served_by, reused = await through(client, gw, servers, probe)
            assert reused == predicted[backend_of(gw, servers[served_by])], (predicted, reused)
            assert reused == max(predicted.values())  # it went where the most was cached
            checked += reused > 0
            await quiet(gw)
        assert checked >= 2  # most probes found their context cached

        # Evictions the gateway never saw: fill one server's 16 blocks straight.
        target = servers[0]
        bid = backend_of(gw, target)
        held_before = index.blocks(bid)
        for _ in range(4):
            await complete(client, target.url, text(rng, 200))
        await quiet(gw)
        assert index.stats()[bid].removed > 0  # vLLM told us what it evicted
        assert index.blocks(bid) <= BLOCKS
        for ctx in contexts:
            probe = ctx + " " + text(rng, 20)
            tokens = tok.prompt_tokens("completions", {"prompt": probe})
            assert tokens is not None
            predicted_there = policy.predicted(tokens, bid)
            before = hits(target)
            await complete(client, target.url, probe)  # straight there: its own count
            assert hits(target) - before == predicted_there
            await quiet(gw)
        assert held_before > 0


async def test_chat_prompts_are_keyed_as_vllm_keys_them(
    kv_vllm_servers: list[VllmServer],
) -> None:
    """The chat template rendered by the gateway gives the blocks vLLM caches for a chat."""
    servers = kv_vllm_servers
    rng = random.Random(23)
    async with following(servers) as gw, httpx.AsyncClient() as client:
        system = text(rng, 100)
        body = {
            "model": SERVED_MODEL,
            "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        }
        r = await client.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        await quiet(gw)
        again = {**body, "messages": [*body["messages"][:1], {"role": "user", "content": "yo"}]}
        tok = gw.svc.tokenizers.get(SERVED_MODEL)
        assert tok is not None
        tokens = tok.prompt_tokens("chat", again)
        assert tokens is not None
        policy = policy_of(gw)
        predicted = max(policy.predicted(tokens, b.id) for b in gw.svc.pool.all())
        assert predicted >= 128
        before = sum(hits(s) for s in servers)
        r = await client.post(f"{gw.url}/v1/chat/completions", json=again, timeout=120)
        assert r.status_code == 200, r.text
        assert sum(hits(s) for s in servers) - before == predicted
        assert policy.decisions["prefix"] >= 1


async def test_messages_prompts_are_keyed_as_vllm_keys_them(
    kv_vllm_servers: list[VllmServer],
) -> None:
    """A Messages body, read as the chat vLLM renders it, gives the blocks vLLM caches for it:
    what the gateway predicts for a second request sharing the system prompt is what vLLM
    then counts as hits."""
    servers = kv_vllm_servers
    rng = random.Random(29)
    async with following(servers) as gw, httpx.AsyncClient() as client:
        body = {
            "model": SERVED_MODEL,
            "max_tokens": 1,
            "system": [{"type": "text", "text": text(rng, 100)}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        }
        r = await client.post(f"{gw.url}/v1/messages", json=body, timeout=120)
        assert r.status_code == 200, r.text
        await quiet(gw)
        again = {**body, "messages": [{"role": "user", "content": "yo"}]}
        tok = gw.svc.tokenizers.get(SERVED_MODEL)
        assert tok is not None
        tokens = tok.prompt_tokens("chat", chat_view(again))
        assert tokens is not None
        policy = policy_of(gw)
        predicted = max(policy.predicted(tokens, b.id) for b in gw.svc.pool.all())
        assert predicted >= 128
        decided = policy.decisions["prefix"]
        before = sum(hits(s) for s in servers)
        r = await client.post(f"{gw.url}/v1/messages", json=again, timeout=120)
        assert r.status_code == 200, r.text
        assert sum(hits(s) for s in servers) - before == predicted
        assert policy.decisions["prefix"] == decided + 1  # routed on it

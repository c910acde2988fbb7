"""prefix_affinity against real vLLM: requests sharing a prefix go where vLLM has it cached."""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx

from tests.e2e.observe import server_metrics
from tests.e2e.servers import SERVED_MODEL, VllmServer, gateway_for

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
DONE = "vllm:request_success_total"
WORDS = ("river", "stone", "light", "paper", "cloud", "garden", "window", "music")


def context(run: str, group: int) -> str:
    """A long system prompt of its own per group (a document, an agent's instructions), new to
    the servers: it starts with this run's id, so no earlier test left it in their caches."""
    rng = random.Random(group)
    return f"Document {run}-{group}. " + " ".join(rng.choice(WORDS) for _ in range(400))


async def test_requests_sharing_a_prefix_are_sent_where_vllm_cached_it(
    servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    """Two groups of three requests: every group stays on one server, so vLLM computes each
    context once. Round robin would compute each on both servers (A B A, then B A B)."""
    run = uuid.uuid4().hex
    before = await asyncio.gather(*(server_metrics(http, s) for s in servers))
    prompt_tokens: list[int] = []
    async with gateway_for(servers, policy="prefix_affinity") as gw:
        for group in (0, 1):
            for turn in range(3):
                body = {
                    "model": SERVED_MODEL,
                    "messages": [
                        {"role": "system", "content": context(run, group)},
                        {"role": "user", "content": f"Question {turn}?"},
                    ],
                    "max_tokens": 1,
                }
                resp = await http.post(f"{gw.url}/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                prompt_tokens.append(resp.json()["usage"]["prompt_tokens"])
    after = await asyncio.gather(*(server_metrics(http, s) for s in servers))

    def delta(name: str) -> list[float]:
        return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]

    # The second group's first request went to the server with room, then each stayed put.
    assert sorted(delta(DONE)) == [3, 3]
    queries, hits = sum(delta(QUERIES)), sum(delta(HITS))
    assert queries == sum(prompt_tokens)
    # Each context computed once: the misses are two whole prompts plus, for the four repeats,
    # no more than their last, partly filled block and question. Computed on both servers (as
    # round robin would), the misses would be at least four whole prompts.
    one_prompt = min(prompt_tokens)
    assert queries - hits < 3 * one_prompt, (queries, hits, prompt_tokens)

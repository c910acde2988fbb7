"""The probe gate's question, asked of the engines: do both pools answer the plan's prompts
alike? Each prompt goes to one routable backend of each pool as a greedy completion of
``probe_tokens`` tokens (``temperature`` 0, ``ignore_eos``); the answers are compared word by
word (``gateway.rollouts.gates.agreement``: the share of identical tokens, a word standing for
a token), and the mean over the prompts is the agreement a step is judged on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from backends.errors import NoBackendAvailable, UpstreamError
from backends.pool import BackendPool
from backends.upstream.client import Transport
from gateway.request.rollout import Pool
from gateway.rollouts.gates import agreement
from gateway.rollouts.plan import Plan

_HEADERS: Mapping[str, str] = {"Content-Type": "application/json"}


async def probe_pools(
    plan: Plan, pools: Mapping[str, Pool], backends: BackendPool, upstream: Transport
) -> float:
    """The mean share of identical tokens in the two pools' answers to the plan's probes.
    Raises ``UpstreamError`` (or ``NoBackendAvailable``) if a pool cannot answer."""
    shares = []
    for prompt in plan.probes:
        stable = await _answer(prompt, plan, pools[plan.stable], backends, upstream)
        canary = await _answer(prompt, plan, pools[plan.canary], backends, upstream)
        shares.append(agreement(stable, canary))
    return sum(shares) / len(shares)


async def _answer(
    prompt: str, plan: Plan, pool: Pool, backends: BackendPool, upstream: Transport
) -> list[str]:
    now = backends.now()
    up = [
        b
        for b in (backends.get(i) for i in sorted(pool.backends))
        if b is not None and backends.routable(b, now)
    ]
    if not up:
        raise NoBackendAvailable(
            f"No backend of pool {pool.name!r} can answer a probe.", retry_after=1
        )
    body = {
        "model": pool.model,
        "prompt": prompt,
        "max_tokens": plan.probe_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    answer = await upstream.open(up[0].spec, "/v1/completions", json.dumps(body).encode(), _HEADERS)
    complete = False
    try:
        raw = await upstream.read_body(answer)
        complete = True
    finally:
        upstream.finish(answer, complete=complete)
    if answer.status != 200:
        raise UpstreamError(f"pool {pool.name!r} answered a probe {answer.status}")
    try:
        text = json.loads(raw)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise UpstreamError(f"pool {pool.name!r} answered a probe with no text") from None
    return str(text).split()

"""A key's daily token budget through three replicas (real processes, a real Redis): set once
through one replica, enforced by all; 50 requests at once spend it and no more than the
reservations allow; the refusals are ``budget_exceeded`` with when the day's count resets; the
usage by day and model is one count for the fleet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from gateway.limits.keys import hash_key
from gateway.limits.tokens import reservation
from tests.gateway.fleet.replicas import chat, running_fleet
from tools.fake_vllm import FakeBackend, Seen

BUDGET = 10_000
MAX_TOKENS = 300
PROMPT_TOKENS = 40  # what the backends report: more than the gateway's estimate of the prompt


async def all_of_max_tokens(request: web.Request, fake: FakeBackend, seen: Seen) -> web.Response:
    """An answer that used its whole ``max_tokens``, after a moment (so requests overlap)."""
    doc = json.loads(seen.body)
    await asyncio.sleep(
        0.05
    )  # sleep-ok: an engine's time, so the 50 requests are in flight at once
    used = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": doc["max_tokens"]}
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": doc["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
            "usage": {**used, "total_tokens": sum(used.values())},
        }
    )


async def test_a_budget_hit_by_50_requests_through_3_replicas_is_not_overspent(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, auth=True) as fleet:
        for fake in fleet.fakes.values():
            fake.behaviour = all_of_max_tokens
        key = "sk-team-budget"
        status, _, _ = await fleet.change(
            fleet[0], "POST", "/admin/keys", {"name": "team", "hash": hash_key(key)}
        )
        assert status == 200
        status, headers, _ = await fleet.change(
            fleet[1], "PUT", "/admin/keys/team/budget", {"tokens_per_day": BUDGET}
        )
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")

        async def one(i: int) -> tuple[int, dict[str, object]]:
            body = {**chat(), "max_tokens": MAX_TOKENS}
            url = fleet[i % 3].url + "/v1/chat/completions"
            headers = {"Authorization": f"Bearer {key}"}
            async with fleet.session.post(url, json=body, headers=headers) as r:
                return r.status, await r.json()

        answers = await asyncio.gather(*(one(i) for i in range(50)))
        admitted = sum(1 for status, _ in answers if status == 200)
        refused = [doc for status, doc in answers if status == 429]
        assert admitted + len(refused) == 50
        assert refused, "the budget stopped nobody"
        assert {d["error"]["code"] for d in refused} == {"budget_exceeded"}  # type: ignore[index]
        assert all("resets at" in d["error"]["message"] for d in refused)  # type: ignore[index]
        reserved = reservation({**chat(), "max_tokens": MAX_TOKENS})
        used = PROMPT_TOKENS + MAX_TOKENS
        # Every replica sees one count: what was spent is what the admitted requests used.
        spent = {}
        for r in fleet:
            listed = {k["name"]: k for k in (await fleet.read(r, "/admin/keys"))["keys"]}
            spent[r.name] = listed["team"]["budget"]["periods"]["day"]["spent"]
        assert set(spent.values()) == {admitted * used}
        # Reserved before it runs: at most the excess of usage over reservation is overspent.
        overspent = admitted * used - BUDGET
        assert overspent <= admitted * max(0, used - reserved)
        assert admitted >= BUDGET // max(used, reserved) - 1
        print(
            f"budget {BUDGET}: {admitted} admitted, {len(refused)} refused, spent "
            f"{admitted * used} ({overspent:+d}); reservation {reserved}, usage {used} a request"
        )
        # The usage by day and model, read through any replica, is the fleet's.
        usage = await fleet.read(fleet[2], "/admin/keys/team/usage?days=2")
        [today] = usage["days"]
        assert today["models"] == {"m": admitted * used}
        # Raised, the key may go on (the day's count kept); its tier's budget (none) once unset.
        status, _, _ = await fleet.change(
            fleet[2], "PUT", "/admin/keys/team/budget", {"tokens_per_day": BUDGET * 2}
        )
        assert status == 200
        assert (await one(2))[0] == 200
        status, _, _ = await fleet.change(
            fleet[2], "PUT", "/admin/keys/team/budget", {"tokens_per_day": 1}
        )
        assert status == 200
        assert (await one(0))[0] == 429  # a budget of one token admits nothing
        await fleet.change(fleet[0], "PUT", "/admin/keys/team/budget", {"tokens_per_day": None})
        assert (await one(1))[0] == 200

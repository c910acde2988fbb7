"""A gateway that has taken retries from its budget and been refused some, and whose admission
queue has shed a request: the figures the console and ``top`` show, made for real.

Two fake backends, ``a`` refusing every request (503, its circuit kept closed) and ``b``
answering, in round robin: every other request is first sent to ``a`` and asks the budget
(``budget_ratio`` 0.25, no floor) for a retry on ``b``; six of them, whichever backend the
rotation starts with, get at least one retry taken and one refused. Then both backends hold
the requests they get: one each fills them (``max_in_flight`` 1), a third waits in the
admission queue (room for one), and a fourth of a higher priority takes its place: the third
is shed (429 ``shed_by_priority``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any, Final

import aiohttp

from gateway.request.services import Services
from tests.waiting import wait_for
from tools.fake_vllm import FakeBackend, answer, echo_json, hang_before_headers

NAMES: Final = ["a", "b"]
REFUSAL: Final = "refused by the test"
SETTINGS: Final[dict[str, Any]] = {
    "policy": "round_robin",
    "retry": {"budget_ratio": 0.25, "budget_min_per_second": 0, "backoff_base": 0},
    "health": {"circuit_threshold": 1_000_000},
    "limits": {
        "admission": {"enabled": True, "max_size": 1, "max_in_flight": 1},
        "tiers": {"default": {"max_priority": 5}},
    },
}
CHAT: Final = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def backends() -> tuple[FakeBackend, FakeBackend]:
    """``a``, refusing; ``b``, answering."""
    return FakeBackend(behaviour=answer(503, REFUSAL)), FakeBackend(behaviour=echo_json)


async def _post(
    session: aiohttp.ClientSession, url: str, priority: int | None = None
) -> tuple[int, Any]:
    headers = {} if priority is None else {"x-priority": str(priority)}
    async with session.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
        return r.status, json.loads(await r.read())


async def retried(session: aiohttp.ClientSession, url: str, n: int = 6) -> Counter[int]:
    """``n`` requests one after the other: their statuses (200, or ``a``'s 503 passed on when
    the budget refused the retry)."""
    statuses: Counter[int] = Counter()
    for _ in range(n):
        status, doc = await _post(session, url)
        assert status == 200 or REFUSAL in json.dumps(doc), (status, doc)
        statuses[status] += 1
    return statuses


async def shed_one(
    session: aiohttp.ClientSession, url: str, svc: Services, a: FakeBackend, b: FakeBackend
) -> None:
    """One request shed by priority, the others served once the backends let them go."""
    queue = svc.admission
    assert queue is not None
    behaviours = a.behaviour, b.behaviour
    for fake in (a, b):
        fake.behaviour = hang_before_headers
        fake.release.clear()
    try:
        filling = [asyncio.create_task(_post(session, url)) for _ in range(2)]
        await wait_for(lambda: a.running == b.running == 1, what="both backends full")
        low = asyncio.create_task(_post(session, url))
        await wait_for(lambda: queue.waiting == 1, what="one request waiting")
        high = asyncio.create_task(_post(session, url, priority=3))
        status, doc = await low
        assert (status, doc["error"]["code"]) == (429, "shed_by_priority"), doc
    finally:
        for fake in (a, b):
            fake.release.set()
    served = await asyncio.gather(*filling, high)
    assert [status for status, _ in served] == [200, 200, 200], served
    a.behaviour, b.behaviour = behaviours

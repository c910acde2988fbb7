"""A client that goes away stops the real server's generation, streaming or not.

vLLM 0.32 does not count a client abort in ``vllm:request_success_total``. The proof here is
what the server shows from outside: its running count falls to zero within a second of the
gateway closing its upstream request, its ``vllm:generation_tokens_total`` stops short of
``max_tokens``, and its log says ``Aborted request(s)`` for the request id the gateway sent.

The second is counted from the gateway's abort, not from the client's leaving: the gateway
runs in this test's process, and on a busy two-core machine (two servers, one generating as
fast as it can) that process can be starved for a few seconds; a gateway that never aborts
still fails (its abort never comes, and the answer runs to ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.observe import GENERATED, RUNNING, fleet_total, log_lines, poll_until
from tests.e2e.servers import SERVED_MODEL, VllmServer
from tests.helpers import RunningGateway, wait_for

MAX_TOKENS = 16000  # ~30 s of generation for the tiny model on one core
ABORT_WITHIN = 1.0  # seconds from the client's disconnect to the server running nothing
CHUNKS_BEFORE_DISCONNECT = 5
GENERATE_FOR = 1.0  # seconds a non-streaming request generates before its client leaves


def upstream_aborts(gateway: RunningGateway) -> float:
    """Upstream requests the gateway has cut short, summed over backends and reasons."""
    family = "llm_gateway_upstream_aborts"
    return sum(
        s.value
        for m in gateway.svc.metrics.registry.collect()
        if m.name == family
        for s in m.samples
        if s.name == f"{family}_total"
    )


async def left(gateway: RunningGateway, aborts_before: float) -> float:
    """When the gateway closed its upstream request after its client left."""
    await wait_for(
        lambda: upstream_aborts(gateway) > aborts_before,
        within=10.0,
        what="the gateway to abort its upstream request",
    )
    return time.monotonic()


async def prove_aborted(
    *,
    http: httpx.AsyncClient,
    servers: list[VllmServer],
    gateway: RunningGateway,
    request_id: str,
    tokens_before: float,
    disconnected_at: float,
) -> None:
    async def running() -> float:
        return await fleet_total(http, servers, RUNNING)

    _, stopped_at = await poll_until(
        running, lambda n: n == 0, within=ABORT_WITHIN, what="the servers to run nothing"
    )
    print(
        f"{request_id}: server idle {stopped_at - disconnected_at:.3f}s after the disconnect",
        file=sys.stderr,
    )
    generated = await fleet_total(http, servers, GENERATED) - tokens_before
    # Short of max_tokens (~30 s of generation): cut, not finished. How much was made before
    # the client left varies with how busy the machine is (this process, gateway and client,
    # can be starved for seconds), so the bound is only that.
    assert generated < MAX_TOKENS, f"{generated} tokens generated: the answer was not cut"

    async def aborted_lines() -> list[str]:
        return log_lines(servers, "Aborted request", request_id)

    await poll_until(
        aborted_lines,
        bool,
        within=15.0,
        what=f"vLLM to log 'Aborted request' for {request_id}",
    )
    # It stays stopped: nothing more was generated while the log line was awaited.
    assert await fleet_total(http, servers, GENERATED) - tokens_before == generated
    await wait_for(lambda: set(gateway.in_flight().values()) == {0}, what="in-flight released")


async def test_disconnect_mid_stream_stops_generation(
    gateway: RunningGateway,
    servers: list[VllmServer],
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
) -> None:
    rid = f"e2e-abort-stream-{uuid.uuid4().hex[:12]}"
    tokens_before = await fleet_total(http, servers, GENERATED)
    stream = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Talk for a long time."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": rid},
    )
    aborts = upstream_aborts(gateway)
    received = 0
    async for chunk in stream:
        assert chunk.id == f"chatcmpl-{rid}"
        received += 1
        if received == CHUNKS_BEFORE_DISCONNECT:
            break
    await stream.close()  # closes the client's connection to the gateway mid-stream
    disconnected_at = await left(gateway, aborts)

    await prove_aborted(
        http=http,
        servers=servers,
        gateway=gateway,
        request_id=f"chatcmpl-{rid}",
        tokens_before=tokens_before,
        disconnected_at=disconnected_at,
    )


async def test_disconnect_during_non_streaming_request_stops_generation(
    gateway: RunningGateway,
    servers: list[VllmServer],
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
) -> None:
    rid = f"e2e-abort-whole-{uuid.uuid4().hex[:12]}"
    tokens_before = await fleet_total(http, servers, GENERATED)
    aborts = upstream_aborts(gateway)
    call = asyncio.ensure_future(
        client.completions.create(
            model=SERVED_MODEL,
            prompt="Talk for a long time.",
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": rid},
        )
    )

    # On its way to a server, then a moment to be generating. Not watched on the server's own
    # /metrics: on a busy two-core machine the API server of a server generating a long
    # non-streaming answer falls behind its engine and answers /metrics only once it has
    # caught up, which was after the whole answer in one run.
    await wait_for(lambda: sum(gateway.in_flight().values()) == 1, what="the request sent")
    await asyncio.sleep(GENERATE_FOR)  # sleep-ok: let it generate (about 30 s in all) a while
    call.cancel()  # the client gives up: httpx closes its connection to the gateway
    with pytest.raises(asyncio.CancelledError):
        await call
    disconnected_at = await left(gateway, aborts)

    await prove_aborted(
        http=http,
        servers=servers,
        gateway=gateway,
        request_id=f"cmpl-{rid}",
        tokens_before=tokens_before,
        disconnected_at=disconnected_at,
    )

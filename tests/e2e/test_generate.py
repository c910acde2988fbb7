"""``/inference/v1/generate`` (token ids in and out) through the gateway in front of the two
real servers, only one of which runs with ``--enable-scale-out``: the same greedy token ids
as that server gives directly, streamed or not (the other server's 403 passes it over); a
client that leaves stops the generation (vLLM's own counters and log); an abort by the id the
client chose reaches the engine running it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx

from tests.e2e.conftest import SCALE_OUT
from tests.e2e.observe import GENERATED, fleet_total, log_lines, poll_until
from tests.e2e.servers import SERVED_MODEL, VllmServer
from tests.e2e.test_disconnect import MAX_TOKENS, left, prove_aborted, upstream_aborts
from tests.helpers import RunningGateway

PROMPT = "The gateway passes token ids through:"


def flagged(servers: list[VllmServer]) -> VllmServer:
    return next(s for s in servers if s.name == SCALE_OUT)


async def prompt_ids(http: httpx.AsyncClient, server: VllmServer) -> list[int]:
    r = await http.post(f"{server.url}/tokenize", json={"model": SERVED_MODEL, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["tokens"]
    return ids


def body(ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"model": SERVED_MODEL, "token_ids": ids, "sampling_params": sampling, **extra}


def streamed_ids(raw: bytes) -> list[int]:
    out: list[int] = []
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if data and data != b"[DONE]":
            doc = json.loads(data)
            assert "error" not in doc, doc
            for c in doc["choices"]:
                out += c.get("token_ids") or []
    return out


async def test_generate_gives_the_servers_own_ids_stream_or_not(
    gateway: RunningGateway, servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    server = flagged(servers)
    ids = await prompt_ids(http, server)
    direct = await http.post(f"{server.url}/inference/v1/generate", json=body(ids, 24))
    assert direct.status_code == 200, direct.text
    expected = direct.json()["choices"][0]["token_ids"]
    assert len(expected) == 24
    for _ in range(3):  # whichever server the policy picks, the answer comes from the flagged one
        r = await http.post(f"{gateway.url}/inference/v1/generate", json=body(ids, 24))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
    r = await http.post(
        f"{gateway.url}/inference/v1/generate", json=body(ids, 24, stream=True), timeout=60
    )
    assert r.status_code == 200
    assert streamed_ids(r.content) == expected


async def test_a_client_that_leaves_stops_the_generation(
    gateway: RunningGateway, servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    rid = f"e2e-generate-{uuid.uuid4().hex[:12]}"
    ids = await prompt_ids(http, flagged(servers))
    tokens_before = await fleet_total(http, servers, GENERATED)
    aborts = upstream_aborts(gateway)
    doc = body(ids, MAX_TOKENS, stream=True, request_id=rid)  # no header: the body's id
    async with http.stream("POST", f"{gateway.url}/inference/v1/generate", json=doc) as r:
        assert r.status_code == 200
        events = 0
        async for chunk in r.aiter_bytes():
            events += chunk.count(b"\n\n")
            if events >= 5:
                break
    disconnected_at = await left(gateway, aborts)
    await prove_aborted(
        http=http,
        servers=servers,
        gateway=gateway,
        request_id=f"generate-tokens-{rid}",
        tokens_before=tokens_before,
        disconnected_at=disconnected_at,
    )


async def test_an_abort_by_the_clients_id_stops_the_engine(
    gateway: RunningGateway, servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    rid = f"e2e-generate-abort-{uuid.uuid4().hex[:12]}"
    ids = await prompt_ids(http, flagged(servers))
    doc = body(ids, MAX_TOKENS, stream=True, request_id=rid)
    async with http.stream("POST", f"{gateway.url}/inference/v1/generate", json=doc) as r:
        seen = b""
        chunks = r.aiter_bytes()
        async for chunk in chunks:
            seen += chunk
            if seen.count(b"\n\n") >= 5:
                break
        a = await http.post(
            f"{gateway.url}/inference/v1/abort_requests",
            json={"request_ids": [f"generate-tokens-{rid}"]},
        )
        assert a.status_code == 200, a.text
        assert a.json()["unknown"] == []
        async for chunk in chunks:  # the stream ends: vLLM finished it as aborted
            seen += chunk
    finishes = [
        c.get("finish_reason")
        for e in seen.split(b"\n\n")
        if (d := e.removeprefix(b"data: ").strip()) and d != b"[DONE]"
        for c in json.loads(d)["choices"]
    ]
    assert "abort" in finishes
    await poll_until(
        lambda: _aborted(servers, rid), bool, within=15.0, what="vLLM's log of the abort"
    )


async def _aborted(servers: list[VllmServer], rid: str) -> list[str]:
    return log_lines(servers, "Aborted request", f"generate-tokens-{rid}")

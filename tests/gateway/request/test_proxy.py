"""The request path against real HTTP servers on loopback: forwarding, streaming, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest

from tests.helpers import (
    FakeBackend,
    chat_chunk,
    fronting,
    gateway_for,
    running_fake,
    running_gateway,
    stopped,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, **kw: Any
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    async with session.post(url, data=data, **kw) as resp:
        raw = await resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {"_raw": raw.decode()}
        return resp.status, doc, resp


def assert_envelope(doc: dict[str, Any], type_: str | None = None) -> dict[str, Any]:
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str)
    assert err["message"]
    if type_:
        assert err["type"] == type_
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_non_streaming_request_is_forwarded_byte_for_byte(path: str) -> None:
    fake = FakeBackend()
    async with fronting(fake) as gw:
        body = b'{"model": "m",  "prompt": "x", "extra": [1, 2]}'
        async with aiohttp.ClientSession() as s:
            status, doc, resp = await post(
                s, gw.url + path, body, headers={"Content-Type": "application/json"}
            )
        assert status == 200
        assert doc["choices"][0]["text"] == "hello"
        assert resp.headers["Content-Type"].startswith("application/json")
        assert fake.seen[0].path == path
        assert fake.seen[0].body == body  # not re-serialised
        assert gw.in_flight() == {fake.url.split("://")[1]: 0}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_is_relayed_whole_and_in_order(path: str) -> None:
    fake = FakeBackend(behaviour=stream_chat(20))
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + path, json=CHAT | {"stream": True}) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "text/event-stream"
                body = await resp.read()
        expected = chat_chunk(role=True) + b"".join(chat_chunk(f"t{i} ") for i in range(20))
        expected += chat_chunk(finish="stop") + b"data: [DONE]\n\n"
        assert body == expected


async def test_first_event_reaches_client_before_backend_produces_the_last() -> None:
    fake = FakeBackend(behaviour=stream_chat(5, hold_after=1))
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
                got = b""
                while b"t0 " not in got:
                    got += await asyncio.wait_for(r.content.readany(), 5)
                # The backend is still holding the rest: the gateway buffered nothing.
                assert not fake.release.is_set()
                assert fake.seen[0].ended_at is None
                fake.release.set()
                rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n")


async def test_models_is_union_and_requests_go_only_to_a_backend_serving_the_model() -> None:
    a = FakeBackend(models=["alpha", "shared"])
    b = FakeBackend(models=["beta", "shared"])
    async with fronting(a, b) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/models") as resp:
                doc = await resp.json()
            assert resp.status == 200
            assert doc["object"] == "list"
            assert sorted(m["id"] for m in doc["data"]) == ["alpha", "beta", "shared"]
            for _ in range(10):
                status, _, _ = await post(s, gw.url + "/v1/completions", {"model": "beta"})
                assert status == 200
        assert len(a.seen) == 0
        assert len(b.seen) == 10


async def test_request_id_is_kept_forwarded_and_returned() -> None:
    fake = FakeBackend()
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            _, _, resp = await post(
                s, gw.url + "/v1/completions", CHAT, headers={"X-Request-Id": "abc-123"}
            )
            assert resp.headers["X-Request-Id"] == "abc-123"
            _, _, resp2 = await post(s, gw.url + "/v1/completions", CHAT)
            generated = resp2.headers["X-Request-Id"]
            # An id with odd characters is replaced, not passed on.
            _, _, resp3 = await post(
                s, gw.url + "/v1/completions", CHAT, headers={"X-Request-Id": "a b\tc"}
            )
        assert fake.seen[0].headers["X-Request-Id"] == "abc-123"
        assert len(generated) >= 16
        assert fake.seen[1].headers["X-Request-Id"] == generated
        assert resp3.headers["X-Request-Id"] != "a b\tc"
        assert fake.seen[2].headers["X-Request-Id"] == resp3.headers["X-Request-Id"]


async def test_hop_by_hop_and_client_credentials_are_not_forwarded() -> None:
    fake = FakeBackend()
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            await post(
                s,
                gw.url + "/v1/completions",
                CHAT,
                headers={
                    "Authorization": "Bearer sk-client-secret",
                    "Connection": "keep-alive, X-Private",
                    "X-Private": "drop-me",
                    "Proxy-Authorization": "Basic x",
                    "TE": "trailers",
                    "X-Custom": "kept",
                    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                },
            )
        h = {k.lower(): v for k, v in fake.seen[0].headers.items()}
        assert "authorization" not in h
        assert "x-private" not in h
        assert "proxy-authorization" not in h
        assert "te" not in h
        assert h["x-custom"] == "kept"
        assert h["traceparent"].startswith("00-0af7651916cd43dd")


async def test_a_backends_cookie_is_not_kept_nor_sent_with_other_clients_requests() -> None:
    async def sets_cookie(request: Any, fake: FakeBackend, seen: Any) -> Any:
        from aiohttp import web

        resp = web.json_response({"ok": True})
        resp.set_cookie("session", "of-the-first-client")
        return resp

    async with running_fake(FakeBackend(behaviour=sets_cookie)) as fake:
        # By name: aiohttp's default jar would ignore a cookie from a bare IP address.
        named = fake.url.replace("127.0.0.1", "localhost")
        async with running_gateway([named]) as gw:
            # Each client its own session (no cookie of its own), the gateway's upstream shared.
            for _ in range(3):
                async with aiohttp.ClientSession() as s:
                    await post(s, gw.url + "/v1/completions", CHAT)
    assert len(fake.seen) == 3
    assert all("Cookie" not in seen.headers for seen in fake.seen), [
        seen.headers.get("Cookie") for seen in fake.seen
    ]


async def test_backend_api_key_is_sent_upstream() -> None:
    async with running_fake(FakeBackend()) as fake:
        backend = {"url": fake.url, "api_key": "sk-backend"}
        async with running_gateway([backend]) as gw:  # type: ignore[list-item]
            async with aiohttp.ClientSession() as s:
                await post(
                    s, gw.url + "/v1/completions", CHAT, headers={"Authorization": "Bearer c"}
                )
        assert fake.seen[0].headers["Authorization"] == "Bearer sk-backend"


async def test_backend_4xx_passes_through_unchanged() -> None:
    async def reject(request: Any, fake: Any, seen: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "error": {
                    "message": "too long",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            status=400,
            headers={"X-Backend": "yes"},
        )

    fake = FakeBackend(behaviour=reject)
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            status, doc, resp = await post(s, gw.url + "/v1/completions", CHAT)
        assert status == 400
        assert doc["error"]["message"] == "too long"
        assert doc["error"]["type"] == "BadRequestError"
        assert resp.headers["X-Backend"] == "yes"
        assert gw.in_flight() == {fake.url.split("://")[1]: 0}


# -- errors produced by the gateway ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'"model"', 400, None),
        (b"", 400, None),
        (b"\xff\xfe", 400, None),
        (b'{"prompt": "x"}', 400, "model"),
        (b'{"model": 7}', 400, "model"),
        (b'{"model": ""}', 400, "model"),
        (b'{"model": "nope"}', 404, "model"),
    ],
)
async def test_bad_requests_get_openai_errors_and_reach_no_backend(
    body: bytes, status: int, param: str | None
) -> None:
    fake = FakeBackend()
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            got, doc, resp = await post(s, gw.url + "/v1/chat/completions", body)
        assert got == status
        err = assert_envelope(doc)
        assert err["param"] == param
        assert resp.headers["X-Request-Id"]
        assert fake.seen == []
        if status == 404:
            assert err["code"] == "model_not_found"
            assert "nope" in err["message"]


async def test_body_over_limit_is_413_whether_length_is_declared_or_chunked() -> None:
    fake = FakeBackend()
    async with fronting(fake, max_body_bytes=1000) as gw:
        big = json.dumps({"model": "m", "prompt": "x" * 5000}).encode()

        async def chunked() -> Any:
            for i in range(0, len(big), 500):
                yield big[i : i + 500]

        async with aiohttp.ClientSession() as s:
            status, doc, _ = await post(s, gw.url + "/v1/completions", big)
            assert status == 413
            assert_envelope(doc, "invalid_request_error")
            async with s.post(gw.url + "/v1/completions", data=chunked()) as resp:
                assert resp.status == 413
                assert_envelope(await resp.json())
            status, _, _ = await post(s, gw.url + "/v1/completions", CHAT)
            assert status == 200
        assert len(fake.seen) == 1


async def test_no_routable_backend_is_503_with_retry_after() -> None:
    fake = FakeBackend()
    async with fronting(fake, health={"fall": 1}) as gw:
        async with aiohttp.ClientSession() as s:
            assert (await post(s, gw.url + "/v1/completions", CHAT))[0] == 200
            fake.health_status = 503  # the next probe fails: backend down
            await wait_for(lambda: not gw.ready(), what="backend marked down")
            status, doc, resp = await post(s, gw.url + "/v1/completions", CHAT)
            async with s.get(gw.url + "/ready") as ready:
                ready_status = ready.status
        assert status == 503
        assert resp.headers["Retry-After"] == "1"
        assert assert_envelope(doc)["code"] == "no_backend_available"
        assert ready_status == 503


async def test_backend_unreachable_is_502() -> None:
    fake = FakeBackend()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running_fake(fake))
        # Probes are rare here, so the gateway still believes in the backend; one attempt.
        gw = await stack.enter_async_context(
            running_gateway([fake.url], health={"interval": 60}, retry={"max_attempts": 1})
        )
        async with aiohttp.ClientSession() as s:
            assert (await post(s, gw.url + "/v1/completions", CHAT))[0] == 200
            await stack.enter_async_context(stopped(fake))
            status, doc, _ = await post(s, gw.url + "/v1/completions", CHAT)
        assert status == 502
        assert assert_envelope(doc, "bad_gateway")["code"] == "backend_unreachable"
        assert set(gw.in_flight().values()) == {0}


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_idle_timeout_is_504_before_first_byte(stream: bool) -> None:
    async def silent(request: Any, fake: FakeBackend, seen: Any) -> Any:
        await fake.release.wait()

    fake = FakeBackend(behaviour=silent)
    async with fronting(fake, upstream={"idle_timeout": 0.2}) as gw:
        async with aiohttp.ClientSession() as s:
            status, doc, _ = await post(s, gw.url + "/v1/completions", CHAT | {"stream": stream})
        assert status == 504
        assert assert_envelope(doc, "gateway_timeout")["code"] == "backend_timeout"
        await wait_for(lambda: fake.seen[0].ending == "cancelled", what="upstream closed")
        assert gw.in_flight() == {fake.url.split("://")[1]: 0}


async def test_idle_timeout_does_not_cut_a_long_stream_that_keeps_talking() -> None:
    fake = FakeBackend(behaviour=stream_chat(30, delay=0.05))
    async with fronting(fake, upstream={"idle_timeout": 1.0}) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
                body = await r.read()
        # 30 x 50 ms = 1.5 s in all, longer than the idle timeout, and nothing was cut. (The
        # timeout is 20 gaps long: a busy machine can stall this process for a few hundred ms.)
        assert body.endswith(b"data: [DONE]\n\n")
        assert b"error" not in body


async def test_backend_dying_mid_stream_ends_with_an_error_event() -> None:
    async def die(request: Any, fake: FakeBackend, seen: Any) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True) + chat_chunk("a"))
        assert request.transport is not None
        request.transport.abort()  # a crash: the connection is reset mid-stream
        return resp

    fake = FakeBackend(behaviour=die)
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
                assert r.status == 200
                body = await asyncio.wait_for(r.read(), 5)
        assert body.startswith(chat_chunk(role=True) + chat_chunk("a"))
        tail = body.split(b"\n\n")[-3]
        assert tail.startswith(b"data: {")
        assert json.loads(tail[6:])["error"]["type"] == "bad_gateway"
        assert body.endswith(b"data: [DONE]\n\n")
        assert gw.in_flight() == {fake.url.split("://")[1]: 0}


async def test_unknown_route_and_method_use_the_envelope() -> None:
    async with gateway_for(FakeBackend()) as (gw, s):
        async with s.get(gw.url + "/v1/nothing") as r:
            assert r.status == 404
            assert_envelope(await r.json())
        async with s.get(gw.url + "/v1/completions") as r:
            assert r.status == 405
            assert_envelope(await r.json())
            assert "POST" in r.headers["Allow"]


async def test_health_and_ready() -> None:
    async with gateway_for(FakeBackend()) as (gw, s):
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 200

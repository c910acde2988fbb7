"""The gateway as the edge: TLS, and clients that are slow, idle or send too much."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.helpers import (
    FakeBackend,
    fronting,
    gateway_for,
    stream_chat,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_tls_is_terminated_for_a_real_tls_client(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    fake = FakeBackend()
    trust = ssl.create_default_context(cafile=str(cert))
    async with gateway_for(fake, tls={"cert_file": cert, "key_file": key}) as (gw, s):
        assert gw.url.startswith("https://")
        async with s.post(gw.url + "/v1/completions", json=CHAT, ssl=trust) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await s.post(gw.url + "/v1/completions", json=CHAT)  # untrusted: refused
        plain = gw.url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):
            await s.post(plain + "/v1/completions", json=CHAT)
    assert len(fake.seen) == 1


async def test_a_body_that_trickles_in_gets_408_and_reaches_no_backend() -> None:
    fake = FakeBackend()
    async with fronting(fake, client={"body_timeout": 0.2}) as gw:
        host, port = gw.url[7:].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "m"'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    assert fake.seen == []


async def test_an_idle_connection_is_closed_after_the_keepalive_timeout() -> None:
    async with fronting(FakeBackend(), client={"keepalive_timeout": 0.2}) as gw:
        host, port = gw.url[7:].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # Says nothing at all: the gateway hangs up rather than hold the connection forever.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_oversized_headers_are_refused() -> None:
    fake = FakeBackend()
    async with (
        gateway_for(fake, client={"max_header_bytes": 2048}) as (gw, s),
        s.post(gw.url + "/v1/completions", json=CHAT, headers={"X-Big": "a" * 4096}) as r,
    ):
        assert r.status in (400, 431)
    assert fake.seen == []


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400,
         "malformed_http_request"),
        (b"GET /v1/" + b"a" * 2048 + b" HTTP/1.1\r\n\r\n", 414, "uri_too_long"),
        (b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 2048 + b"\r\n\r\n", 431,
         "request_header_fields_too_large"),
    ],
    ids=["malformed", "target_too_long", "header_too_large"],
)  # fmt: skip
async def test_http_the_gateway_refuses_itself_has_a_code_like_its_other_errors(
    head: bytes, status: int, code: str
) -> None:
    fake = FakeBackend()
    async with fronting(fake, client={"max_header_bytes": 1024}) as gw:
        host, port = gw.url[7:].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # the refusal, then closed
        writer.close()
    first, _, body = answer.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 %d " % status)
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    assert fake.seen == []


async def test_no_answer_announces_the_python_and_aiohttp_versions() -> None:
    """The Server header said `Python/3.11 aiohttp/3.14` (issue 23): on every listener, for
    answers, streams, errors and the admin API, it is the gateway's name alone."""
    fake = FakeBackend(behaviour=stream_chat(3))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with gateway_for(fake, admin={"token": "t"}) as (gw, s):
        assert gw.admin_url is not None
        calls = [
            s.get(gw.url + "/health"),
            s.post(gw.url + "/v1/chat/completions", json=chat),
            s.post(gw.url + "/v1/chat/completions", data=b"{"),
            s.get(gw.url + "/nowhere"),
            s.get(gw.admin_url + "/admin/backends", headers={"Authorization": "Bearer t"}),
            s.get(gw.admin_url + "/admin/backends"),
        ]
        for call in calls:
            async with call as r:
                await r.read()
                assert r.headers["Server"] == "llm-gateway", (r.url, r.headers["Server"])

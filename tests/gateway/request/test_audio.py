"""vLLM's speech-to-text endpoints through the gateway: multipart bodies, spooled (not held
whole in memory), routed by their ``model`` form field, sent again on failover, limited and
counted like chat; bad bodies are 4xx in OpenAI's envelope. Simulators with ``--audio`` stand
in for a Whisper server (the tiny test models have no audio encoder)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import struct
import tempfile
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from openai import AsyncOpenAI

from gateway.request import form
from gateway.request.headers import upstream_headers
from tests.helpers import RunningGateway, fronting, gateway_for, wait_for
from tools.sim import Faults, RunningSim, SimConfig

AUDIO = SimConfig(step_base_ms=1.0, audio=True)
TEXT = SimConfig(step_base_ms=1.0)
MODEL = "sim-model"


def requests(gw: RunningGateway, **labels: str) -> float:
    """``llm_gateway_requests_total`` summed over the series that have ``labels``."""
    return sum(
        s.value
        for f in gw.svc.metrics.registry.collect()
        for s in f.samples
        if s.name == "llm_gateway_requests_total"
        and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wav(seconds: float, tone: int = 0) -> bytes:
    """A 16 kHz 16-bit mono WAV of ``seconds`` (its samples vary with ``tone``)."""
    frames = int(16_000 * seconds)
    data = bytes((i * (tone + 1)) % 251 for i in range(frames * 2))
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt "
    header += struct.pack("<IHHIIHH", 16, 1, 1, 16_000, 32_000, 2, 16)
    return header + b"data" + struct.pack("<I", len(data)) + data


def client(url: str, **kw: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0)


def form_data(audio: bytes | None, **fields: str) -> aiohttp.FormData:
    data = aiohttp.FormData(default_to_multipart=True)
    for name, value in fields.items():
        data.add_field(name, value)
    if audio is not None:
        data.add_field("file", io.BytesIO(audio), filename="speech.wav", content_type="audio/wav")
    return data


async def test_transcription_and_translation_with_the_openai_sdk_go_only_where_served() -> None:
    text_sim = RunningSim(TEXT)
    audio_sim = RunningSim(AUDIO)
    async with (
        AsyncExitStack() as stack,
        fronting(text_sim, audio_sim, policy="round_robin") as gw,
    ):
        oa = await stack.enter_async_context(client(gw.url))
        speech = wav(2.0)
        for _ in range(3):  # whichever backend round robin offers first, the answer is right
            got = await oa.audio.transcriptions.create(
                model=MODEL, file=("speech.wav", speech, "audio/wav")
            )
            assert got.text.strip()
            assert got.usage is not None
            assert got.usage.seconds == 3  # ceil of 2.0 s and the header
        again = await oa.audio.transcriptions.create(
            model=MODEL, file=("speech.wav", speech, "audio/wav")
        )
        assert again.text == got.text  # the same audio, the same words (the whole file arrived)
        other = await oa.audio.transcriptions.create(
            model=MODEL, file=("other.wav", wav(2.0, tone=7), "audio/wav")
        )
        assert other.text != got.text
        async with aiohttp.ClientSession() as s:  # the SDK's translations call is deprecated
            data = form_data(speech, model=MODEL)
            async with s.post(gw.url + "/v1/audio/translations", data=data) as r:
                assert r.status == 200, await r.text()
                translated = await r.json()
        assert set(translated) == {"text"}  # no usage for translations
        assert translated["text"].strip()
        # The text server answered "no such route" once at most, and was then left alone.
        assert gw.svc.pool.get(text_sim.url[7:]).lacks <= {"transcriptions", "translations"}  # type: ignore[union-attr]
        assert audio_sim.state.audio_bytes >= 6 * len(speech)
        assert requests(gw, endpoint="transcriptions", status="200") == 5
        assert requests(gw, endpoint="translations", status="200") == 1


async def test_a_streamed_transcription_relays_chunks_and_settles_its_usage() -> None:
    # Each request reserves its completion budget (1,024 by default) against 1,500 tokens a
    # minute: three in a row pass only if each gives back what its usage says it did not use.
    limits = {"tiers": {"default": {"tokens_per_minute": 1500}}}
    sim = RunningSim(AUDIO)
    async with (
        AsyncExitStack() as stack,
        fronting(sim, limits=limits) as gw,
    ):
        oa = await stack.enter_async_context(client(gw.url))
        for _ in range(3):
            stream = await oa.audio.transcriptions.create(
                model=MODEL,
                file=("speech.wav", wav(3.0), "audio/wav"),
                stream=True,
                extra_body={"stream_include_usage": True},
            )
            deltas, usage = [], None
            async for event in stream:
                doc = event.model_dump()
                assert doc["object"] == "transcription.chunk"
                deltas += [c["delta"]["content"] for c in doc.get("choices") or []]
                usage = doc.get("usage") or usage
            assert len(deltas) == 10  # ceil(3.0 s and the header, at 3 tokens a second)
            assert usage is not None
            assert usage["completion_tokens"] == 10
        await wait_for(lambda: requests(gw, endpoint="transcriptions", status="200") == 3)
        assert sum(sim.engine.stats.request_success.values()) == 3


async def test_an_upload_is_sent_again_whole_when_the_first_backend_refuses() -> None:
    busy = RunningSim(AUDIO, faults=Faults(error_rate=1.0, error_status=503))
    ok = RunningSim(AUDIO)
    async with gateway_for(busy, ok, policy="round_robin") as (gw, s):
        speech = wav(40.0)  # 1.28 MB: past the in-memory part of the spool, on disk
        assert len(speech) > form.SPOOL_MEMORY
        for _ in range(2):  # one of the two goes to the refusing backend first
            data = form_data(speech, model=MODEL)
            async with s.post(gw.url + "/v1/audio/transcriptions", data=data) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["seconds"] == 41
        assert busy.state.injected_errors >= 1
        assert ok.state.audio_bytes == 2 * len(speech)
        assert requests(gw, endpoint="transcriptions") == 2


async def test_bad_audio_requests_are_4xx_in_openais_envelope_and_reach_no_backend() -> None:
    sim = RunningSim(AUDIO)
    async with gateway_for(sim, max_upload_bytes=200_000) as (gw, s):
        url = gw.url + "/v1/audio/transcriptions"
        small = wav(1.0)
        cases: list[tuple[Any, dict[str, str], int, str | None]] = [
            (form_data(small), {}, 400, "model"),  # no model field
            (form_data(None, model=MODEL), {}, 400, "file"),  # no file
            (form_data(wav(8.0), model=MODEL), {}, 413, None),  # over max_upload_bytes
            (b'{"model": "sim-model"}', {"Content-Type": "application/json"}, 400, None),
            (  # the closing boundary never comes
                b'--xx\r\nContent-Disposition: form-data; name="model"\r\n\r\nsim-model\r\n',
                {"Content-Type": "multipart/form-data; boundary=xx"},
                400,
                None,
            ),
            (form_data(small, model="whisper-nobody-serves"), {}, 404, "model"),
        ]
        for body, headers, status, param in cases:
            async with s.post(url, data=body, headers=headers) as r:
                doc = await r.json()
                assert r.status == status, doc
                err = doc["error"]
                assert err["type"] in ("invalid_request_error", "not_found_error"), err
                assert err["message"]
                if param is not None:
                    assert err["param"] == param
        assert sim.state.audio_bytes == 0
        # an unknown model is counted as such; nothing else reached the backend
        assert sum(sim.engine.stats.request_success.values()) == 0


async def test_a_renaming_alias_rewrites_the_model_field_in_flight() -> None:
    sim = RunningSim(AUDIO)
    async with fronting(
        sim,
        names=("a",),
        pools=[{"name": "stable", "model": MODEL, "backends": ["a"]}],
        aliases={"whisper": {"stable": 1}},
    ) as gw:
        async with client(gw.url) as oa:
            got = await oa.audio.transcriptions.create(
                model="whisper", file=("speech.wav", wav(1.0), "audio/wav")
            )
        assert got.text.strip()  # the simulator serves only sim-model: it saw the new name


def test_the_scan_finds_fields_and_files_from_bytes_in_any_split() -> None:
    body = (
        b"--b0\r\n"
        b'Content-Disposition: form-data; name="model"\r\n\r\n'
        b"whisper\r\n"
        b"--b0\r\n"
        b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n" + b"\x00\x01" * 500 + b"\r\n"
        b"--b0\r\n"
        b'Content-Disposition: form-data; name="prompt"\r\n\r\n'
        b"\r\n"
        b"--b0--\r\n"
    )
    for step in (1, 7, len(body)):
        scan = form.FormScan(b"b0")
        for i in range(0, len(body), step):
            scan.feed(body[i : i + step])
        scan.finish()
        assert scan.fields == {"model": "whisper", "prompt": ""}
        assert scan.files == {"file": 1000}
        start, end = scan.spans["model"]
        assert body[start:end] == b"whisper"


async def test_an_edited_upload_sends_the_new_value_and_the_rest_unchanged() -> None:
    body = (
        b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
        b'--b0\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        + os.urandom(3000)
        + b"\r\n--b0--\r\n"
    )
    scan = form.FormScan(b"b0")
    scan.feed(body)
    spool = tempfile.SpooledTemporaryFile(max_size=1000)  # noqa: SIM115 (the Upload's)
    spool.write(body)
    upload = form.Upload(spool, len(body), scan)
    renamed = upload.replaced("model", "sim-model")
    for u, want in ((upload, body), (renamed, body.replace(b"whisper", b"sim-model", 1))):
        for _ in range(2):  # every pass from the start
            sent = b"".join([c async for c in u.chunks()])
            assert sent == want
            assert u.size == len(want)
    assert renamed.fields["model"] == "sim-model"
    assert upload.fields["model"] == "whisper"
    upload.close()


@pytest.mark.parametrize("value", [b"x" * (form.MAX_FIELD_BYTES + 1)])
def test_a_text_field_longer_than_the_cap_is_refused(value: bytes) -> None:
    scan = form.FormScan(b"b0")
    body = b'--b0\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n' + value
    with pytest.raises(Exception, match="longer than"):
        scan.feed(body)


def test_form_doc_reads_the_fields_as_the_limits_count_them() -> None:
    doc = form.form_doc(
        {"model": "m", "stream": "true", "max_completion_tokens": "12", "seed": "x"}
    )
    assert doc == {"model": "m", "stream": True, "max_completion_tokens": 12, "seed": None}
    assert form.form_doc({"stream": "False"})["stream"] is False


async def test_curl_with_expect_100_continue_uploads_through_the_gateway(tmp_path: Any) -> None:
    """curl asks ``Expect: 100-continue`` for bodies over 1 MB; the gateway answers it and
    does not pass it on (it has the body already)."""
    path = tmp_path / "speech.wav"
    path.write_bytes(wav(40.0))
    sim = RunningSim(AUDIO)
    async with fronting(sim) as gw:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "-v", "--fail-with-body",
            "-F", f"model={MODEL}", "-F", f"file=@{path};type=audio/wav",
            gw.url + "/v1/audio/transcriptions",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert b"Expect: 100-continue" in err
        assert b"HTTP/1.1 100 Continue" in err
        assert json.loads(out)["usage"]["seconds"] == 41
        assert sim.state.audio_bytes == path.stat().st_size
    assert "Expect" not in upstream_headers(
        CIMultiDictProxy(CIMultiDict(Expect="100-continue")), "r"
    )


async def test_a_client_that_leaves_mid_upload_leaves_nothing_behind() -> None:
    def spooled_files() -> int:
        """Open files of this process in the temporary folder (the uploads' spools)."""
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile (listdir's own)
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(tempfile.gettempdir())
        return n

    sim = RunningSim(AUDIO)
    async with fronting(sim) as gw:
        head = (
            "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: multipart/form-data; boundary=b0\r\n"
            f"Content-Length: {4 * form.SPOOL_MEMORY}\r\n\r\n"
        ).encode()
        part = b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\nsim-model\r\n'
        part += b'--b0\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        before = spooled_files()
        port = int(gw.url.rsplit(":", 1)[1])
        for n in range(1, 4):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + part + b"\x00" * (2 * form.SPOOL_MEMORY))
            await writer.drain()
            await wait_for(lambda: spooled_files() == before + 1, what="the upload spooled to disk")
            writer.close()
            await writer.wait_closed()
            await wait_for(lambda: spooled_files() == before, what="its spool closed")
            await wait_for(lambda n=n: requests(gw, endpoint="transcriptions") == n, what="counted")
        assert sim.state.audio_bytes == 0

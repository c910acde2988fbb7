"""vLLM's speech-to-text endpoints on the simulator (``--audio``: a Whisper-like model).

``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` take a
``multipart/form-data`` body (vLLM's ``TranscriptionRequest`` as form fields, the audio in
``file``). The simulator does not decode audio: the upload's length stands for its duration
(16 kHz 16-bit mono, as a WAV is), its bytes seed the transcript (the same audio, the same
words), and the request runs on the engine as a generation of about three tokens a second of
audio, so load, queueing and metrics behave as for chat. Answers in vLLM 0.32's shapes:
``{"text", "usage": {"type": "duration", "seconds"}}`` (transcriptions), ``{"text"}``
(translations), ``verbose_json`` with one segment, or ``transcription.chunk`` /
``translation.chunk`` SSE events with the usage chunk on ``stream_include_usage``.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from tools.sim.driver import RequestHandle
from tools.sim.http import (
    SSE_HEADERS,
    STATE,
    Handler,
    check_model,
    json_response,
    refusal,
)
from tools.sim.protocol import ApiError, GenerateParams, parse_generate
from tools.sim.protocol import plan_output as plan
from tools.sim.responses import DONE, sse, usage
from tools.sim.state import SimState
from tools.sim.tokens import OutputText

BYTES_PER_SECOND: Final = 32_000  # 16 kHz, 16-bit, mono
TOKENS_PER_SECOND: Final = 3  # about what Whisper writes for speech
_FORMATS: Final = frozenset({"json", "text", "verbose_json"})
_TRUE: Final = frozenset({"true", "1", "yes", "on"})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/transcriptions", _speech_to_text("transcribe"))
    app.router.add_post("/v1/audio/translations", _speech_to_text("translate"))


def _flag(form: Any, name: str) -> bool:
    return str(form.get(name, "")).strip().lower() in _TRUE


def _int(form: Any, name: str) -> int | None:
    value = form.get(name)
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        msg = f"1 validation error: {name}: Input should be a valid integer"
        raise ApiError(400, msg, name) from None


@dataclass(frozen=True, slots=True)
class _Job:
    model: str | None
    fmt: str
    seconds: float
    language: str | None
    include_usage: bool
    params: GenerateParams


async def _job(request: web.Request, state: SimState) -> _Job:
    """The form as the engine's request, or the 400 vLLM (FastAPI) answers."""
    if request.content_type != "multipart/form-data":
        raise ApiError(400, "1 validation error: file: Field required", "file")
    form = await request.post()
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise ApiError(400, "1 validation error: file: Field required", "file")
    audio = upload.file.read()
    model = str(form["model"]) if form.get("model") else None
    check_model(model, state)
    fmt = str(form.get("response_format", "json"))
    if fmt not in _FORMATS:
        raise ApiError(
            400,
            "Currently only support response_format: `text`, `json`, `verbose_json` "
            "or `diarized_json`",
        )
    stream = _flag(form, "stream")
    if stream and fmt == "verbose_json":
        raise ApiError(400, f"{fmt} format doesn't support streaming case")
    seconds = max(1.0, len(audio) / BYTES_PER_SECOND)
    heard = hashlib.blake2b(audio, digest_size=8).hexdigest()
    wanted = _int(form, "max_completion_tokens")
    natural = math.ceil(seconds * TOKENS_PER_SECOND)
    body = {
        "prompt": f"<|startoftranscript|> {form.get('prompt', '')} {heard}",
        "max_tokens": min(wanted, natural) if wanted is not None else natural,
        "ignore_eos": True,  # as long as the speech is
        "stream": stream,
        "seed": _int(form, "seed"),
    }
    state.audio_bytes += len(audio)
    language = str(form["language"]) if form.get("language") else None
    include_usage = _flag(form, "stream_include_usage")
    return _Job(model, fmt, seconds, language, include_usage, parse_generate(body, chat=False))


def _speech_to_text(task: str) -> Handler:
    kind = "transcription" if task == "transcribe" else "translation"

    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        try:
            job = await _job(request, state)
            output_len, reason, output = plan(job.params, state.config)
        except ApiError as exc:
            return json_response(exc.envelope(), status=exc.status)
        refused = refusal(state)
        if refused is not None:
            return refused
        params = job.params
        handle = state.driver.submit(
            params.prompt_ids, output_len, reason, output, stream=params.stream
        )
        state.in_flight += 1
        try:
            if not params.stream:
                await handle.tokens()
                text = output.text(handle.num_tokens)
                return json_response(_whole(task, job, text))
            head = {
                "id": f"{task}-{uuid.uuid4().hex}",
                "object": f"{kind}.chunk",
                "created": int(time.time()),
                "model": job.model or state.config.model_name,
            }
            return await _stream(request, job, handle, output, head)
        except ConnectionError:
            return web.Response(status=499)  # the client went away mid-write
        finally:
            state.in_flight -= 1
            state.driver.release(handle)

    return handler


async def _stream(
    request: web.Request,
    job: _Job,
    handle: RequestHandle,
    output: OutputText,
    head: dict[str, Any],
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    sent = 0
    while True:
        events = []
        for ev in await handle.tokens():
            choice: dict[str, Any] = {"delta": {"content": output.piece(ev.index)}}
            if ev.finish_reason is not None:
                choice |= {"finish_reason": ev.finish_reason, "stop_reason": None}
            events.append({**head, "choices": [choice]})
            sent += 1
        done = handle.finished and sent == handle.num_tokens
        if done and job.include_usage:
            events.append({**head, "choices": [], "usage": usage(len(job.params.prompt_ids), sent)})
        chunk = b"".join(sse(e) for e in events)
        await resp.write(chunk + DONE if done else chunk)
        if done:
            await resp.write_eof()
            return resp


def _whole(task: str, job: _Job, text: str) -> dict[str, Any]:
    seconds = job.seconds
    if job.fmt == "verbose_json":
        segment = {
            "id": 0,
            "seek": 0,
            "start": 0.0,
            "end": seconds,
            "text": text,
            "tokens": [],
            "temperature": 0.0,
            "avg_logprob": -0.25,
            "compression_ratio": 1.0,
            "no_speech_prob": 0.0,
        }
        lang = job.language or "en"
        return {"duration": seconds, "language": lang, "text": text, "segments": [segment]}
    if task == "translate":  # vLLM reports no usage for translations
        return {"text": text}
    return {"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}

"""The HTTP surface of vLLM 0.32 that a gateway touches, served from the simulated engine.

Run it with ``handler_cancellation=True`` (``runner.py`` and ``testing.py`` do): a
client that goes away then cancels its handler, whose ``finally`` aborts the request
in the engine, queued or running, as vLLM does. The mid-stream faults (``faults.py``)
end their streams through the same ``finally``: a hung stream when the client gives up,
a reset or an error event at once.

``POST /tokenize`` answers with the simulator's own tokenizer (``tokens.py``), the
count a gateway reads to know how many tokens a broken stream had delivered.

With ``--kv-events-config`` the app publishes its KV-cache events (``kvevents.py``) from
start-up to clean-up; ``GET /kv_event_sources`` tells where, and ``POST
/reset_prefix_cache`` empties the prefix cache (vLLM serves it in dev mode only).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from tools.sim import admin, apis
from tools.sim.config import SimConfig
from tools.sim.driver import RequestHandle
from tools.sim.faults import Faults, StreamStop
from tools.sim.http import (
    SSE_HEADERS,
    STATE,
    Handler,
    check_model,
    error_response,
    json_body,
    json_response,
    refusal,
)
from tools.sim.kvevents import KvEvents
from tools.sim.metrics import ServerCounters, SimCollector, make_registry, render
from tools.sim.protocol import (
    ApiError,
    GenerateParams,
    error_envelope,
    parse_generate,
    parse_tokenize,
)
from tools.sim.protocol import plan_output as plan
from tools.sim.responses import DONE, ResponseFormat, error_event
from tools.sim.state import SimState
from tools.sim.tokens import OutputText, tokenize

VLLM_VERSION: Final = "0.32.0"
KV_EVENTS: Final = web.AppKey("sim_kv_events", KvEvents)
# What vLLM sends when the engine fails a request mid-stream (its GenerationError).
_ENGINE_ERROR: Final = error_event(error_envelope(500, "Internal server error"))


def create_app(
    config: SimConfig,
    faults: Faults | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The simulator's aiohttp app; its engine loop runs while the app does."""
    app = web.Application(middlewares=[_gate], client_max_size=64 * 1024 * 1024)
    state = SimState(config, faults, clock)
    app[STATE] = state
    app[KV_EVENTS] = KvEvents(config.kv_events, config.block_size)
    registry = make_registry(
        SimCollector(
            config.model_name,
            state.driver,
            lambda: ServerCounters(state.injected_errors, state.in_flight),
        )
    )
    app.cleanup_ctx.append(_kv_events)  # before the engine loop starts, after it stops
    app.cleanup_ctx.append(_engine_loop)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    if config.runner == "generate":
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat_completions)
    apis.add_routes(app, config)
    app.router.add_post("/tokenize", tokenize_text)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    admin.add_routes(app, state)
    return app


async def _engine_loop(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    loop = asyncio.get_running_loop()
    task = loop.create_task(state.driver.run(), name="sim-engine")
    task.add_done_callback(state.engine_stopped)
    delay = state.config.startup_delay_s
    timer = loop.call_later(delay, state.ready.set) if delay > 0 else None
    if timer is None:
        state.ready.set()
    yield
    if timer is not None:
        timer.cancel()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    """Publish KV-cache events while the app runs; nothing at all when they are off.

    A restart (the app started again) publishes from seq 0 with an empty prefix cache, as
    a new vLLM process does, so that its events describe the whole cache.
    """
    events = app[KV_EVENTS]
    driver = app[STATE].driver
    publisher = events.start()
    if publisher is not None:
        if events.starts > 1:
            driver.engine.reset_prefix_cache()
        driver.engine.pool.take_events()  # the last run's leftovers: not this process's
        driver.kv_event_sink = publisher.publish
    yield
    driver.kv_event_sink = None
    await events.close()


@web.middleware
async def _gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if not state.ready.is_set():
        await state.ready.wait()  # loading the model: the socket is bound, nobody answers
    if state.faults.refuse_connections and request.transport is not None:
        request.transport.abort()  # a keep-alive connection made before the fault
        return web.Response(status=503)  # never delivered: the connection is gone
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(status=503 if state.faults.unhealthy or state.engine_dead else 200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VLLM_VERSION})


async def load(request: web.Request) -> web.Response:
    state = request.app[STATE]
    n = state.in_flight if state.config.enable_server_load_tracking else 0
    return json_response({"server_load": n})


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    name = config.model_name
    created = int(time.time())
    card = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    adapters = [  # as vLLM lists them: the adapter's name, its path, the base model
        {**card, "id": lora, "root": path, "parent": name, "max_model_len": None}
        for lora, path in request.app[STATE].adapters.items()
    ]
    return json_response({"object": "list", "data": [card, *adapters]})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def tokenize_text(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    try:
        doc = await json_body(request)
        params = parse_tokenize(doc)
        check_model(params.model, state)
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    ids = tokenize(params.text)
    return json_response(
        {
            "count": len(ids),
            "max_model_len": config.max_model_len,
            "tokens": ids,
            "token_strs": params.text.split() if params.return_token_strs else None,
        }
    )


async def kv_event_sources(request: web.Request) -> web.Response:
    return json_response(request.app[KV_EVENTS].sources())


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's: ``{"success": false}`` while requests hold blocks, unless
    ``reset_running_requests=true`` preempts them. ``reset_external`` is accepted; there
    is no connector cache to reset."""
    try:
        running = _query_bool(request, "reset_running_requests")
        _query_bool(request, "reset_external")
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    ok = request.app[STATE].driver.reset_prefix_cache(reset_running_requests=running)
    return json_response({"success": ok})


def _query_bool(request: web.Request, name: str) -> bool:
    """A boolean query parameter, read as FastAPI reads one."""
    raw = request.query.get(name)
    if raw is None:
        return False
    value = raw.lower()
    if value in ("1", "true", "yes", "on", "t", "y"):
        return True
    if value in ("0", "false", "no", "off", "f", "n"):
        return False
    raise ApiError(400, f"{name} must be a boolean, got {raw!r}", name)


async def _hang() -> None:
    """Wait until the client goes away (which cancels the handler)."""
    await asyncio.get_running_loop().create_future()


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    try:
        body = await json_body(request)
        params = parse_generate(body, chat=chat)
        check_model(params.model, state)
        output_len, reason, output = plan(params, config)
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)

    refused = refusal(state)
    if refused is not None:
        return refused
    if state.faults.hang_before_first_byte:
        await _hang()
    limit = config.max_num_queued_reqs
    if limit is not None and len(state.engine.waiting) >= limit:
        return error_response(503, "The engine's request queue is full.")

    header_id = request.headers.get("X-Request-Id")
    base_id = header_id or uuid.uuid4().hex
    headers = {"X-Request-Id": base_id} if config.enable_request_id_headers else {}
    fmt = ResponseFormat(
        chat=chat,
        response_id=("chatcmpl-" if chat else "cmpl-") + base_id,
        created=int(time.time()),
        model=params.model or config.model_name,
        prompt_tokens=len(params.prompt_ids),
    )
    driver = state.driver
    remote_decode = config.kv_producer and params.remote_decode
    handle = driver.submit(
        params.prompt_ids,
        output_len,
        reason,
        output,
        stream=params.stream,
        remote_decode=remote_decode,
        remote_prefill=config.kv_consumer and not remote_decode and params.remote_prefill,
    )
    state.in_flight += 1
    try:
        if params.stream:
            return await _stream(
                request, state, handle, fmt=fmt, params=params, output=output, headers=headers
            )
        await handle.tokens()
        n = handle.num_tokens
        kv = None
        if remote_decode:
            kv = _handoff(request, state, handle, fmt, len(params.prompt_ids))
        full = fmt.full(output.text(n), handle.finish_reason or reason, n, kv)
        return json_response(full, headers=headers)
    finally:
        state.in_flight -= 1
        driver.release(handle)


def _handoff(
    request: web.Request,
    state: SimState,
    handle: RequestHandle,
    fmt: ResponseFormat,
    prompt_tokens: int,
) -> dict[str, Any]:
    """A prefill instance's ``kv_transfer_params``, in the NIXL connector's fields.

    ``remote_host``/``remote_port`` are the address the request came in on (a real
    instance names its NIXL side channel); ``sim_request`` is the simulator's own handle.
    """
    state.prefills_handed_off += 1
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    host, port = (sock[0], sock[1]) if sock else ("127.0.0.1", 0)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(handle.block_ids),
        "remote_engine_id": state.engine_id,
        "remote_request_id": fmt.id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "sim_request": f"{state.engine_id}/{handle.request_id}",
    }


async def _stream(
    request: web.Request,
    state: SimState,
    handle: RequestHandle,
    *,
    fmt: ResponseFormat,
    params: GenerateParams,
    output: OutputText,
    headers: dict[str, str],
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
    await resp.prepare(request)
    continuous = params.continuous_usage_stats
    sent = 0
    stop: StreamStop | None = None  # the mid-stream fault that stopped the stream
    try:
        while stop is None:
            events = await handle.tokens()
            parts: list[bytes] = []
            before = sent
            for ev in events:
                stop = state.faults.stream_stop(sent)
                if stop is not None:
                    break
                parts.append(
                    fmt.token_chunk(
                        output.piece(ev.index),
                        ev.finish_reason,
                        ev.index + 1 if continuous else None,
                    )
                )
                sent += 1
            if fmt.chat and before == 0 and sent > 0:
                # With the first token, as vLLM sends it: an engine that hangs (or fails)
                # before its first token sends no role chunk either.
                parts.insert(0, fmt.role_chunk())
            finished = stop is None and handle.finished and sent == handle.num_tokens
            if finished:
                if params.include_usage:
                    parts.append(fmt.usage_chunk(sent))
                parts.append(DONE)
            elif stop == "error":
                parts += (_ENGINE_ERROR, DONE)
            if parts:
                await resp.write(b"".join(parts))
            if finished or stop == "error":
                await resp.write_eof()
                return resp
        if stop == "break":
            if request.transport is not None:
                request.transport.abort()  # a reset, as the client of a killed server sees
            return resp
        await _hang()
    except ConnectionError:
        pass  # the client went away mid-write; the caller's finally aborts the request
    return resp

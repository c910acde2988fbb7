"""The HTTP surface of vLLM 0.32 that a gateway touches, served from the simulated engine.

Run it with ``handler_cancellation=True`` (``runner.py`` and ``testing.py`` do): a
client that goes away then cancels its handler, whose ``finally`` aborts the request
in the engine, queued or running, as vLLM does. The mid-stream faults (``faults.py``)
end their streams through the same ``finally``: a hung stream when the client gives up,
a reset or an error event at once.

``POST /tokenize`` answers with the word tokenizer (``gateway/tokenizer/words.py``), the
count a gateway reads to know how many tokens a broken stream had delivered.

With ``--kv-events-config`` the app publishes its KV-cache events (``kvevents.py``) from
start-up to clean-up; ``GET /kv_event_sources`` tells where, and ``POST
/reset_prefix_cache`` empties the prefix cache (vLLM serves it in dev mode only).

With ``--dev-mode`` the app serves vLLM's sleep mode (``sleep_api.py``): ``/sleep``,
``/wake_up``, ``/is_sleeping``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.tokenizer.words import tokenize
from tools.sim import admin, apis, serving, sleep_api
from tools.sim.config import SimConfig
from tools.sim.faults import Faults
from tools.sim.http import (
    STATE,
    Handler,
    check_model,
    json_body,
    json_response,
)
from tools.sim.kvevents import KvEvents
from tools.sim.metrics import ServerCounters, SimCollector, make_registry, render
from tools.sim.priority import PRIORITY_HEADER, request_priority
from tools.sim.protocol import ApiError, parse_generate, parse_tokenize
from tools.sim.protocol import plan_output as plan
from tools.sim.responses import ChunkStream, ResponseFormat
from tools.sim.state import SimState

VLLM_VERSION: Final = "0.32.0"
KV_EVENTS: Final = web.AppKey("sim_kv_events", KvEvents)


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
            state.sleep.report,
            dev_mode=config.dev_mode,
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
    if config.dev_mode:
        sleep_api.add_routes(app)
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
    await state.sleep.close()
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


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    try:
        body = await json_body(request)
        params = parse_generate(body, chat=chat)
        priority = request_priority(body, request.headers.get(PRIORITY_HEADER))
        check_model(params.model, state)
        output_len, reason, output = plan(params, config)
        refused = await serving.admit(state)
        if refused is not None:
            raise refused
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)

    base_id, headers = serving.request_ids(request, config)
    fmt = ResponseFormat(
        chat=chat,
        response_id=("chatcmpl-" if chat else "cmpl-") + base_id,
        created=int(time.time()),
        model=params.model or config.model_name,
        prompt_tokens=len(params.prompt_ids),
    )
    with serving.running(state, params, (output_len, reason, output), priority) as handle:
        if params.stream:
            events = ChunkStream(
                fmt,
                output,
                include_usage=params.include_usage,
                continuous=params.continuous_usage_stats,
                details=config.enable_prompt_tokens_details,
            )
            return await serving.stream(request, state, handle, events, headers)
        end = await serving.whole(handle)
        kv = None
        if serving.remote_decode(config, params):
            kv = serving.handoff(request, state, handle, fmt.id, len(params.prompt_ids))
        details = None
        if config.enable_prompt_tokens_details:
            details = end.prompt_details(created=chat, whole=True)
        full = fmt.full(
            output.text(end.tokens),
            end.finish_reason,
            end.tokens,
            kv,
            stop_reason=output.stop_reason,
            details=details,
        )
        return json_response(full, headers=headers)

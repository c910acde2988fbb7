"""vLLM's endpoints beyond completions, on the simulator: the Responses API, Anthropic's
Messages API (``messages_api.py``), the scale-out endpoints (render, token-in-token-out
generate and abort, with ``--enable-scale-out``: ``scale_out.py``), pooling (with ``--runner
pooling``), speech to text (with ``--audio``, ``tools.sim.audio``), LoRA adapters (with
``--enable-lora``) and ``/detokenize``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from tools.sim import audio, messages_api, pooling, responses_api, scale_out, serving
from tools.sim.config import SimConfig
from tools.sim.http import (
    SSE_HEADERS,
    STATE,
    Handler,
    check_model,
    error_response,
    json_body,
    json_response,
    model_body,
    validated_json,
)
from tools.sim.priority import PRIORITY_HEADER, body_priority, request_priority, with_header
from tools.sim.protocol import ApiError, GenerateParams, error_envelope, parse_generate
from tools.sim.protocol import plan_output as plan
from tools.sim.state import SimState
from tools.sim.tokens import OutputText, detokenize
from tools.sim.validation import BodyError


def add_routes(app: web.Application, config: SimConfig) -> None:
    """The routes vLLM registers for this server's runner and flags."""
    if config.runner == "generate":
        app.router.add_post("/v1/responses", responses_create)
        app.router.add_get("/v1/responses/{response_id}", responses_get)
        app.router.add_post("/v1/responses/{response_id}/cancel", responses_cancel)
        app.router.add_post("/v1/messages", messages_create)
        app.router.add_post("/v1/messages/count_tokens", messages_count_tokens)
    else:  # vLLM registers these for an embedding model, and not the generation routes
        for path, answer in _POOLING_ROUTES.items():
            app.router.add_post(path, _pooling(answer))
    _add_scale_out(app, config)
    if config.audio:
        audio.add_routes(app)
    if config.enable_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_post("/detokenize", detokenize_ids)


def _add_scale_out(app: web.Application, config: SimConfig) -> None:
    """vLLM's scale-out routes: all 403 unless enabled; then render, and (generating
    servers) generate and abort. /v1/responses/render and derender are not simulated."""
    if not config.enable_scale_out:
        for path in scale_out.ROUTES:
            app.router.add_post(path, scale_out_disabled)
        return
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/messages/render", render_messages)
    if config.runner == "generate":
        app.router.add_post("/inference/v1/generate", generate_tokens)
        app.router.add_post("/inference/v1/abort_requests", abort_requests)


def _responses_plan(
    body: Any, state: SimState
) -> tuple[list[dict[str, Any]], GenerateParams, tuple[int, str, OutputText]]:
    """A Responses body as the chat request the engine runs (its conversation, parameters
    and planned output); ``ApiError`` as vLLM answers a bad one."""
    body = model_body(body, state)
    previous: list[dict[str, Any]] = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        previous = state.responses.get(str(prev_id), "previous_response_id").messages
    messages = responses_api.chat_messages(body, previous)
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("seed", "seed")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    params = parse_generate(chat, chat=True)
    return messages, params, plan(params, state.config)


async def responses_create(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (``responses_api.py``), run on the engine as a chat request."""
    state = request.app[STATE]
    try:
        body = await json_body(request)
        messages, params, (output_len, reason, output) = _responses_plan(body, state)
        priority = request_priority(body, request.headers.get(PRIORITY_HEADER))
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    rid = body.get("request_id")
    fmt = responses_api.ResponseBody(
        rid if isinstance(rid, str) and rid else responses_api.new_id(),
        body.get("model") or state.config.model_name,
        len(params.prompt_ids),
        body,
    )
    handle = state.driver.submit(
        params.prompt_ids, output_len, reason, output, stream=params.stream, priority=priority
    )
    state.in_flight += 1

    def finished(text: str, n: int) -> dict[str, Any]:
        status = "incomplete" if (handle.finish_reason or reason) == "length" else "completed"
        full = fmt.response(text, n, status)
        if body.get("store", True) is not False:
            state.responses.put(full, [*messages, {"role": "assistant", "content": text}])
        return full

    try:
        if not params.stream:
            await handle.tokens()
            n = handle.num_tokens
            return json_response(finished(output.text(n), n))
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"".join(fmt.opening()))
        pieces: list[str] = []
        while True:
            parts = []
            for ev in await handle.tokens():
                pieces.append(output.piece(ev.index))
                parts.append(fmt.delta(pieces[-1]))
            done = handle.finished and len(pieces) == handle.num_tokens
            if done:
                text = "".join(pieces)
                parts.extend(fmt.closing(finished(text, len(pieces)), text))
            await resp.write(b"".join(parts))
            if done:
                await resp.write_eof()
                return resp
    except ConnectionError:
        return web.Response(status=499)  # the client went away mid-write
    finally:
        state.in_flight -= 1
        state.driver.release(handle)


async def responses_get(request: web.Request) -> web.Response:
    try:
        stored = request.app[STATE].responses.get(request.match_info["response_id"])
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    return json_response(stored.response)


async def responses_cancel(request: web.Request) -> web.Response:
    """Only a background response can be cancelled; the simulator runs none."""
    try:
        request.app[STATE].responses.get(request.match_info["response_id"])
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    return error_response(400, "Cannot cancel a synchronous response.")


# -- Anthropic's Messages API (messages_api.py)


def _anthropic(exc: ApiError) -> web.Response:
    """An error on a Messages route: vLLM's validation 400 as it is (it precedes the
    route), any other in Anthropic's shape."""
    if isinstance(exc, BodyError):
        return json_response(exc.envelope(), status=exc.status)
    return json_response(messages_api.anthropic_error(exc), status=exc.status)


async def _messages_request(
    request: web.Request, *, count_tokens: bool = False
) -> tuple[messages_api.MessagesRequest, GenerateParams]:
    """A Messages body, checked as vLLM checks it, and the chat request it runs as."""
    state = request.app[STATE]
    req = messages_api.parse_messages(await validated_json(request), count_tokens=count_tokens)
    check_model(req.model, state)
    return req, parse_generate(req.chat_body(), chat=True)


async def messages_create(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``: a chat completion on the engine, answered as a message."""
    state = request.app[STATE]
    config = state.config
    try:
        req, params = await _messages_request(request)
        tool = req.tool
        planned = messages_api.plan_tool(params, config, tool) if tool else plan(params, config)
        refused = await serving.admit(state)
        if refused is not None:
            raise refused
    except ApiError as exc:
        return _anthropic(exc)
    base_id, headers = serving.request_ids(request, config)
    fmt = messages_api.MessageFormat(
        "chatcmpl-" + base_id,
        req.model,
        len(params.prompt_ids),
        planned[2],
        tool,
        details=config.enable_prompt_tokens_details,
    )
    # The Messages body has no priority (vLLM's chat request made of it has 0): the header's.
    priority = with_header(0, request.headers.get(PRIORITY_HEADER))
    with serving.running(state, params, planned, priority) as handle:
        if params.stream:
            return await serving.stream(request, state, handle, fmt, headers)
        end = await serving.whole(handle)
        kv = None
        if serving.remote_decode(config, params):
            kv = serving.handoff(request, state, handle, fmt.id, len(params.prompt_ids))
        try:
            return json_response(fmt.full(end, kv), headers=headers)
        except ApiError as exc:
            return _anthropic(exc)


async def messages_count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the rendered prompt's length, nothing generated."""
    try:
        _, params = await _messages_request(request, count_tokens=True)
    except ApiError as exc:
        return _anthropic(exc)
    return json_response(messages_api.count_tokens_response(len(params.prompt_ids)))


# -- scale-out (scale_out.py)


async def scale_out_disabled(request: web.Request) -> web.Response:
    return json_response(scale_out.FORBIDDEN, status=403)


async def _render_openai(request: web.Request, *, chat: bool) -> dict[str, Any]:
    """A chat or completion body rendered as vLLM's GenerateRequest."""
    state = request.app[STATE]
    body = await json_body(request)
    params = parse_generate(body, chat=chat)
    priority = body_priority(body)  # vLLM renders the body's, not the header's
    check_model(params.model, state)
    base_id, _ = serving.request_ids(request, state.config)
    sampling = scale_out.sampling_params(
        max_tokens=scale_out.render_max_tokens(params, state.config),
        stream=params.stream,
        temperature=scale_out.number(body, "temperature"),
        top_p=scale_out.number(body, "top_p"),
        top_k=scale_out.number(body, "top_k"),
        seed=params.seed,
        stop=params.stop,
        ignore_eos=params.ignore_eos,
    )
    return scale_out.render_doc(
        ("chatcmpl-" if chat else "cmpl-") + base_id,
        params.prompt_ids,
        sampling,
        model=params.model,
        stream=params.stream,
        stream_options=scale_out.stream_options(body.get("stream_options")),
        cache_salt=body.get("cache_salt"),
        priority=priority,
    )


async def render_chat(request: web.Request) -> web.Response:
    try:
        return json_response(await _render_openai(request, chat=True))
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)


async def render_completion(request: web.Request) -> web.Response:
    try:
        return json_response([await _render_openai(request, chat=False)])
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)


async def render_messages(request: web.Request) -> web.Response:
    """A Messages body rendered as vLLM's GenerateRequest (errors in vLLM's envelope: the
    render route does not translate them)."""
    state = request.app[STATE]
    try:
        req, params = await _messages_request(request)
        base_id, _ = serving.request_ids(request, state.config)
        sampling = scale_out.sampling_params(
            max_tokens=scale_out.render_max_tokens(params, state.config),
            stream=req.stream,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop,
        )
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's for Messages
    doc = scale_out.render_doc(
        "chatcmpl-" + base_id,
        params.prompt_ids,
        sampling,
        model=req.model,
        stream=req.stream,
        stream_options=options,
        cache_salt=req.cache_salt,
    )
    return json_response(doc)


async def generate_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /inference/v1/generate``: token ids in, token ids out, on the engine."""
    state = request.app[STATE]
    config = state.config
    try:
        req = scale_out.parse_tokens_request(await validated_json(request))
        params = req.params
        check_model(params.model, state)
        planned = plan(params, config)
        refused = await serving.admit(state)
        if refused is not None:
            raise refused
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    base_id, headers = serving.request_ids(request, config, req.request_id)
    answer = scale_out.TokensAnswer(
        "generate-tokens-" + base_id, req, planned[2], details=config.enable_prompt_tokens_details
    )
    with serving.running(state, params, planned, req.priority) as handle:
        same_id = state.generate_requests.setdefault(answer.id, [])
        same_id.append(handle)
        try:
            if params.stream:
                return await serving.stream(request, state, handle, answer, headers)
            end = await serving.whole(handle)
            kv = None
            if serving.remote_decode(config, params):
                kv = serving.handoff(request, state, handle, answer.id, len(params.prompt_ids))
            model = params.model or config.model_name
            return json_response(answer.full(end, int(time.time()), model, kv), headers=headers)
        finally:
            same_id.remove(handle)
            if not same_id:
                del state.generate_requests[answer.id]


async def abort_requests(request: web.Request) -> web.Response:
    """``POST /inference/v1/abort_requests`` ``{"request_ids": [...]}``: abort those generate
    requests (their answers end with ``finish_reason: abort``); 200, empty."""
    state = request.app[STATE]

    def bad(status: int, message: str, kind: str) -> web.Response:
        return json_response(error_envelope(status, message, kind=kind), status=status)

    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        return bad(400, f"JSON decode error: {exc}", "Bad Request")
    if not isinstance(body, dict):  # vLLM fails on body.get
        name = type(body).__name__
        return bad(500, f"'{name}' object has no attribute 'get'", "InternalServerError")
    ids = body.get("request_ids")
    if ids is None:
        return bad(400, "Missing 'request_ids' in request body", "Bad Request")
    for rid in ids if isinstance(ids, list) else [ids]:
        for handle in list(state.generate_requests.get(str(rid), ())):
            state.driver.abort(handle)
    return web.Response(status=200)


def _lora_name(doc: Any) -> str:
    name = doc.get("lora_name") if isinstance(doc, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    return name


async def load_lora(request: web.Request) -> web.Response:
    """vLLM's runtime load: a plain-text 200, or its error envelope."""
    state = request.app[STATE]
    try:
        doc = await json_body(request)
        name = _lora_name(doc)
        path = doc.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == state.config.model_name:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.")
        if name in state.adapters:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if len(state.adapters) >= state.config.max_loras:
            raise ApiError(500, f"Loading lora {name} failed: no free adapter slot.")
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    state.adapters[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        name = _lora_name(await json_body(request))
        if state.adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.")
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def detokenize_ids(request: web.Request) -> web.Response:
    try:
        doc = model_body(await json_body(request), request.app[STATE])
        ids = doc.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ApiError(400, "1 validation error: tokens: Field required", "tokens")
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    return json_response({"prompt": detokenize(ids)})


_POOLING_ROUTES: Final[dict[str, Callable[[dict[str, Any], str], dict[str, Any]]]] = {
    "/v1/embeddings": pooling.embeddings,
    "/pooling": lambda body, model: pooling.embeddings(body, model, pooling=True),
    "/score": pooling.score,
    "/v1/score": pooling.score,
    "/rerank": pooling.rerank,
    "/v1/rerank": pooling.rerank,
    "/v2/rerank": pooling.rerank,
}


def _pooling(answer: Callable[[dict[str, Any], str], dict[str, Any]]) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        state = request.app[STATE]
        try:
            doc = model_body(await json_body(request), state)
            body_priority(doc)  # checked as vLLM checks it; pooling runs on no queue here
            return json_response(answer(doc, state.config.model_name))
        except ApiError as exc:
            return json_response(exc.envelope(), status=exc.status)

    return handler

"""vLLM's endpoints beyond completions, on the simulator: the Responses API, pooling (with
``--runner pooling``), speech to text (with ``--audio``, ``tools.sim.audio``), LoRA adapters
(with ``--enable-lora``) and ``/detokenize``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from tools.sim import audio, pooling, responses_api
from tools.sim.config import SimConfig
from tools.sim.http import (
    SSE_HEADERS,
    STATE,
    Handler,
    error_response,
    json_body,
    json_response,
    model_body,
)
from tools.sim.protocol import ApiError, GenerateParams, parse_generate
from tools.sim.protocol import plan_output as plan
from tools.sim.state import SimState
from tools.sim.tokens import OutputText, detokenize


def add_routes(app: web.Application, config: SimConfig) -> None:
    """The routes vLLM registers for this server's runner and flags."""
    if config.runner == "generate":
        app.router.add_post("/v1/responses", responses_create)
        app.router.add_get("/v1/responses/{response_id}", responses_get)
        app.router.add_post("/v1/responses/{response_id}/cancel", responses_cancel)
    else:  # vLLM registers these for an embedding model, and not the generation routes
        for path, answer in _POOLING_ROUTES.items():
            app.router.add_post(path, _pooling(answer))
    if config.audio:
        audio.add_routes(app)
    if config.enable_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_post("/detokenize", detokenize_ids)


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
        params.prompt_ids, output_len, reason, output, stream=params.stream
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
            return json_response(answer(doc, state.config.model_name))
        except ApiError as exc:
            return json_response(exc.envelope(), status=exc.status)

    return handler

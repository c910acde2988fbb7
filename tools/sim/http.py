"""The simulator's HTTP plumbing shared by its routes: the app's state key, vLLM's JSON body
and model checks, the injected error, and answers in its shapes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from tools.sim.protocol import ApiError, error_envelope
from tools.sim.responses import dumps
from tools.sim.state import SimState
from tools.sim.validation import parse_json, unsupported_media_type

STATE: Final = web.AppKey("sim_state", SimState)
SSE_HEADERS: Final = {"Content-Type": "text/event-stream; charset=utf-8"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def json_body(request: web.Request) -> Any:
    """The request's JSON, or the 400 vLLM answers for anything else."""
    if request.content_type != "application/json":
        raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
    try:
        return await request.json()
    except ValueError as exc:
        raise ApiError(400, f"JSON decode error: {exc}") from None


async def validated_json(request: web.Request) -> Any:
    """The request's JSON for a route whose body vLLM checks with its FastAPI model: a body
    that is not JSON fails as that validation does (``validation.BodyError``)."""
    if request.content_type != "application/json":
        raise unsupported_media_type()
    return parse_json(await request.read())


def check_model(model: str | None, state: SimState) -> None:
    """The base model's name, or a LoRA adapter's that this server has loaded."""
    if model is not None and model != state.config.model_name and model not in state.adapters:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")


def json_response(
    data: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=dumps)


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    return json_response(error_envelope(status, message, param), status=status)


def injected_error(state: SimState) -> ApiError | None:
    """The injected error a request gets (``Faults.error_rate``), if this one is unlucky."""
    faults = state.faults
    if faults.error_rate > 0 and state.rng.random() < faults.error_rate:
        state.injected_errors += 1
        return ApiError(faults.error_status, "Injected fault (simulator).")
    return None


def refusal(state: SimState) -> web.Response | None:
    """``injected_error`` as an answer in vLLM's envelope."""
    error = injected_error(state)
    return None if error is None else json_response(error.envelope(), status=error.status)


def model_body(doc: Any, state: SimState) -> dict[str, Any]:
    """A body that must be an object naming this server's model (or none), as vLLM checks."""
    if not isinstance(doc, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_model(doc.get("model"), state)
    return doc

"""vLLM's sleep-mode routes, served in dev mode only (``--dev-mode``, as vLLM serves them
with ``VLLM_SERVER_DEV_MODE=1``; otherwise they are a plain 404). Like vLLM's dev routes
they need no API key.

- ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` (default level 1, mode abort): 200 with
  no body once asleep; a bad level or mode is vLLM's validation 400.
- ``POST /wake_up`` (optional repeated ``tags``: ``weights``, ``kv_cache``, ``scheduling``):
  200 with no body once the tags asked for are awake.
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.

What they do: ``sleep.py`` (the state machine) and ``sleep_mode.py`` (on the engine).
"""

from __future__ import annotations

from aiohttp import web

from tools.sim.http import STATE, json_response
from tools.sim.protocol import ApiError
from tools.sim.sleep import parse_sleep, parse_tags


def add_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


async def sleep(request: web.Request) -> web.Response:
    try:
        asked = parse_sleep({name: request.query.getall(name)[-1] for name in request.query})
    except ApiError as exc:
        return json_response(exc.envelope(), status=exc.status)
    await request.app[STATE].sleep.sleep(asked)
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    await request.app[STATE].sleep.wake_up(parse_tags(request.query.getall("tags", [])))
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return json_response({"is_sleeping": request.app[STATE].sleep.state.is_sleeping})

"""The admin endpoint ``/sim/*``: change faults at run time, read the engine's state.

Closed unless the simulator runs with ``--admin-token``: without a token every admin
path is a plain 404, as if it did not exist; with one, a request must carry
``Authorization: Bearer <token>`` (else 401).

- ``GET /sim/faults``: the current faults.
- ``PUT /sim/faults``: a JSON object of faults to change (the others stay), plus an
  optional ``"revert_after": seconds`` to put the previous faults back later.
  ``{"reset": true}`` clears every fault first. The fields are ``Faults``' (``faults.py``),
  e.g. ``{"break_after_tokens": 20}`` resets every stream's connection after its 20th
  token, ``{"error_after_tokens": 20}`` ends it with vLLM's error event instead, and
  ``{"hang_after_tokens": 20}`` stalls it; a stream already past 20 is hit at its next.
- ``GET /sim/state``: running/waiting counts, KV usage, clock lag, faults.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from tools.sim.faults import Faults, FaultsError
from tools.sim.protocol import error_envelope
from tools.sim.state import SimState


def add_routes(app: web.Application, state: SimState) -> None:
    token = state.config.admin_token
    if not token:
        return  # admin functions are never open by default

    def authorised(request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def unauthorised() -> web.Response:
        return web.json_response(
            error_envelope(401, "Missing or wrong admin token."),
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def get_faults(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        return web.json_response(state.faults.to_json())

    async def put_faults(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        try:
            patch: Any = await request.json()
        except ValueError:
            patch = None
        if not isinstance(patch, dict):
            return _bad("The body must be a JSON object of faults.")
        patch = dict(patch)
        revert_after = patch.pop("revert_after", None)
        base = Faults() if patch.pop("reset", False) is True else state.faults
        try:
            new = base.updated(patch)
        except FaultsError as exc:
            return _bad(str(exc))
        if revert_after is None:
            state.faults = new
        elif isinstance(revert_after, int | float) and not isinstance(revert_after, bool):
            if revert_after <= 0:
                return _bad("revert_after must be positive")
            state.set_faults_for(new, float(revert_after))
        else:
            return _bad("revert_after must be a number of seconds")
        return web.json_response(new.to_json())

    async def get_state(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        return web.json_response(state.state_json())

    app.router.add_get("/sim/faults", get_faults)
    app.router.add_put("/sim/faults", put_faults)
    app.router.add_get("/sim/state", get_state)


def _bad(message: str) -> web.Response:
    return web.json_response(error_envelope(400, message), status=400)

"""The data plane's per-request keys (``gateway.http.Request``'s state, as aiohttp's)."""

from __future__ import annotations

from typing import Final

from aiohttp import web

REQUEST_ID_KEY: Final = web.RequestKey("request_id", str)

"""The operator's console: one page, served by the admin listener at ``/``.

Its HTML, script and style sheet ship in this package and are read once, when the admin app is
made; no build step, no asset from any other host. They hold no data: the page asks for the
admin token, keeps it in the page's memory only (never in a URL, a cookie or web storage) and
calls the admin API with it, so the assets themselves are served without the token. The
Content-Security-Policy lets the page load only its own assets and talk only to this listener.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Final

from aiohttp import web

# path -> (file in this package, content type)
ASSETS: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
    "/console/icon.svg": ("icon.svg", "image/svg+xml"),
}
PUBLIC_PATHS: Final = frozenset(ASSETS)

SECURITY_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(body: bytes, content_type: str) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": content_type, **SECURITY_HEADERS})


def add_console_routes(app: web.Application) -> None:
    """Serve the console's assets (read now, once) on ``app``."""
    here = files(__package__)
    for path, (name, content_type) in ASSETS.items():
        body = here.joinpath(name).read_bytes()

        async def handler(
            _request: web.Request, body: bytes = body, ct: str = content_type
        ) -> web.Response:
            return _asset(body, ct)

        app.router.add_get(path, handler)

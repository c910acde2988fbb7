"""The least a streaming proxy on the gateway's stack does: aiohttp's server,
``backends.upstream.h1``'s client, a ``readany``/``write`` loop; no limits, routing, metrics or
logs. Usage: ``bare_proxy.py LISTEN_PORT BACKEND_PORT [BACKEND_PORT ...]`` (all on 127.0.0.1; run
with the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import itertools
import sys

import uvloop
from aiohttp import web

from backends.upstream import h1

POOL = web.AppKey("pool", h1.ConnectionPool)
PORTS = web.AppKey("ports", itertools.cycle)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    ports = request.app[PORTS]
    url = f"http://127.0.0.1:{next(ports)}"
    pool = request.app[POOL]
    up = await pool.request(
        "POST", url, request.path, {"Content-Type": "application/json"}, body=body
    )
    resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
    await resp.prepare(request)
    complete = False
    try:
        while chunk := await up.readany():
            await resp.write(chunk)
        complete = True
    finally:
        pool.release(up, complete=complete)
    await resp.write_eof()
    return resp


def app(backends: list[int]) -> web.Application:
    application = web.Application()
    application[POOL] = h1.ConnectionPool(connect_timeout=5, keepalive_timeout=4)
    application[PORTS] = itertools.cycle(backends)
    application.router.add_post("/v1/chat/completions", relay)
    application.router.add_post("/v1/completions", relay)
    return application


if __name__ == "__main__":
    uvloop.install()
    web.run_app(
        app([int(p) for p in sys.argv[2:]]),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        access_log=None,
        print=None,
    )

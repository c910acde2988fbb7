"""``llm-gateway demo``: simulated backends and the gateway in one process, for a first look.

It also starts the admin API on 127.0.0.1 with a token made for the run and printed (to the
terminal, not to the logs), so that the console (the admin listener's ``/``) and
``llm-gateway top`` work from the quickstart.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from dataclasses import dataclass

import structlog
from aiohttp import web

from gateway.admin.api import create_admin_app
from gateway.config.settings import Settings
from gateway.observe.logs import configure_logging
from gateway.root import open_gateway
from gateway.server import data_plane, listen, make_runner, new_event_loop
from tools.sim import SimConfig, SimServer

log = structlog.get_logger("tools.demo")


@dataclass(frozen=True)
class Demo:
    host: str
    port: int
    n_backends: int
    model: str
    first_backend_port: int
    admin_port: int

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def _banner(d: Demo, token: str) -> str:
    """What the demo prints once it is ready: commands to paste as they are."""
    host, port, admin, model, n = d.host, d.port, d.admin, d.model, d.n_backends
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    base = f"http://{host}:{port}"
    return "\n".join(
        [
            f"llm-gateway demo: the gateway on {base}, in front of {n} simulated backends "
            f"serving {model!r}",
            "",
            "  try it:",
            f"    curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\",
            f"      -d '{body}'",
            f"  the admin API on {admin}, with a token made for this run:",
            f"    the console: open {admin}/ in a browser and sign in with {token}",
            f"    .venv/bin/llm-gateway top --admin {admin} --token {token}",
            f"    curl -H 'Authorization: Bearer {token}' {admin}/admin/backends",
            "",
            "Ctrl-C stops it.",
        ]
    )


async def _run(d: Demo) -> None:
    host, port, admin_port = d.host, d.port, d.admin_port
    sims = [
        SimServer(SimConfig(model=d.model, seed=i), port=d.first_backend_port + i)
        for i in range(d.n_backends)
    ]
    for sim in sims:
        await sim.start()
    token = secrets.token_urlsafe(18)
    settings = Settings(
        host=host,
        port=port,
        backends=[s.url for s in sims],
        admin={"host": "127.0.0.1", "port": admin_port, "token": token},
    )
    try:
        async with open_gateway(settings) as svc:
            server = data_plane(svc)
            admin_runner = make_runner(create_admin_app(svc, token), shutdown_timeout=1)
            runners: list[web.AppRunner] = []
            try:
                await listen(server.start(host=host, port=port), host, port, "--port")
                runners.append(admin_runner)
                await admin_runner.setup()
                await listen(
                    web.TCPSite(admin_runner, "127.0.0.1", admin_port).start(),
                    "127.0.0.1",
                    admin_port,
                    "--admin-port",
                )
                log.info(
                    "demo_ready", gateway=f"http://{host}:{port}", backends=[s.url for s in sims]
                )
                print(_banner(d, token), flush=True)
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                await stop.wait()
            finally:
                for r in runners:
                    await r.cleanup()
                await server.cleanup(5)
    finally:
        for sim in sims:
            await sim.stop()


def run_demo(
    *,
    host: str,
    port: int,
    n_backends: int,
    model: str,
    first_backend_port: int,
    admin_port: int,
) -> int:
    configure_logging("info")
    demo = Demo(host, port, n_backends, model, first_backend_port, admin_port)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(_run(demo))
    return 0

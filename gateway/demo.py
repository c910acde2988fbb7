"""``llm-gateway demo``: simulated backends and the gateway in one process, for a first look."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from backends.sim import SimConfig, SimServer
from gateway.app import create_app
from gateway.logs import configure_logging
from gateway.server import make_runner, new_event_loop
from gateway.settings import Settings

log = structlog.get_logger("gateway.demo")


async def _run(host: str, port: int, n_backends: int, model: str, first_port: int) -> None:
    sims = [
        SimServer(SimConfig(model=model, seed=i), port=first_port + i) for i in range(n_backends)
    ]
    for sim in sims:
        await sim.start()
    settings = Settings(host=host, port=port, backends=[s.url for s in sims])
    runner = make_runner(create_app(settings), shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info(
        "demo_ready",
        gateway=f"http://{host}:{port}",
        backends=[s.url for s in sims],
        model=model,
        try_it=(
            f"curl -N http://{host}:{port}/v1/chat/completions -H 'content-type: "
            f'application/json\' -d \'{{"model":"{model}","messages":[{{"role":"user",'
            f'"content":"hi"}}],"stream":true}}\''
        ),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        for sim in sims:
            await sim.stop()


def run_demo(*, host: str, port: int, n_backends: int, model: str, first_backend_port: int) -> int:
    configure_logging("info")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(_run(host, port, n_backends, model, first_backend_port))
    return 0

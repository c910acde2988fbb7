"""Runs the app on uvloop until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from gateway.app import create_app
from gateway.logs import configure_logging
from gateway.settings import Settings

log = structlog.get_logger("gateway.server")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def make_runner(app: web.Application, *, shutdown_timeout: float = 30.0) -> web.AppRunner:
    """The runner every gateway server uses, tests included.

    ``handler_cancellation`` makes aiohttp cancel a handler whose client has gone away: that
    is how a disconnect reaches the upstream request in every phase.
    """
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
    )


async def run_until_signalled(settings: Settings) -> None:
    runner = make_runner(create_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    await site.start()
    log.info(
        "gateway_listening",
        address=site.name,
        backends=[b.id for b in settings.backends],
        policy=settings.policy,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("gateway_stopping")
    finally:
        await runner.cleanup()


def serve(settings: Settings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run_until_signalled(settings))

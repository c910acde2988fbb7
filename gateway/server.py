"""Runs the gateway (and its admin API, when a token is set) on uvloop until SIGINT/SIGTERM.

Shutdown: ``/ready`` turns 503 at once, the listeners close, idle kept-alive connections are
closed, a request still arriving on a connection being closed gets 503, and in-flight streams
have ``shutdown_grace`` seconds to finish before they are cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence

import structlog
from aiohttp import web

from backends.errors import InvalidRequest
from gateway.admin.api import SERVER_HEADER, create_admin_app
from gateway.admin.fleet import reload_through_log
from gateway.admin.reload import reload_settings
from gateway.config.settings import Settings, TlsSettings
from gateway.config.source import SettingsLoader
from gateway.http import Server, ServerConfig
from gateway.observe.logs import configure_logging
from gateway.request.endpoints import ENDPOINTS, Endpoint
from gateway.request.middleware import entry, refusal_body
from gateway.request.routes import model_routes
from gateway.request.services import Services
from gateway.root import open_gateway
from gateway.workers.private import private_app
from gateway.workers.supervisor import Worker, WorkerSupervisor

log = structlog.get_logger("gateway.server")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


# The young generation's threshold once serving (CPython's default is 700 allocations).
YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """Once started: what is alive now (modules, settings, metrics, the pool) lives as long as
    the process, so the cyclic collector stops walking it (``gc.freeze``), and young objects
    are collected every ``YOUNG_THRESHOLD`` allocations instead of 700. A request allocates
    a few thousand objects; at the default thresholds the collector took ~8 % of the data
    plane's CPU in the peer bench (paced, c=256; ``py-spy --native``)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def data_plane(svc: Services, endpoints: Sequence[Endpoint] = ENDPOINTS) -> Server:
    """The model endpoints' server (the gateway's own, ``gateway.http``), tests included;
    ``endpoints``: the table it routes (``gateway.request.endpoints``).

    It cancels a handler whose client has gone away: that is how a disconnect reaches the
    upstream request in every phase.
    """
    settings = svc.settings
    client = settings.client
    config = ServerConfig(
        max_header_bytes=client.max_header_bytes,
        max_body_bytes=settings.max_body_bytes,
        header_timeout=client.header_timeout,
        keepalive_timeout=client.keepalive_timeout,
        send_timeout=client.send_timeout,
        error_body=refusal_body,
        server_name=SERVER_HEADER,
    )
    return Server(entry(model_routes(svc, endpoints), svc.lifecycle), config)


def make_runner(app: web.Application, *, shutdown_timeout: float = 30.0) -> web.AppRunner:
    """The runner of the aiohttp apps (the admin API and console, a worker's private socket),
    tests included; ``handler_cancellation``: a handler whose client has gone is cancelled."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        handle_signals=False,
    )


async def stop_gracefully(svc: Services, server: Server, runners: list[web.AppRunner]) -> None:
    """Refuse new requests, stop the admin side (``runners``), then drain the data plane:
    in-flight requests have ``shutdown_grace`` seconds (the services close after, as the
    composition root's block ends)."""
    svc.lifecycle.stopping = True
    log.info("gateway_stopping")
    for runner in runners:
        await runner.cleanup()
    await server.cleanup(svc.settings.shutdown_grace)
    log.info("gateway_stopped")


def _on_sighup(svc: Services) -> Callable[[], None]:
    """What SIGHUP does: in a fleet (Redis, or the workers of this host), a reload appended to
    the change log, so every replica and worker re-reads its configuration in the log's order
    (with ``serve --workers`` the supervisor sends SIGHUP to worker 0 alone); else re-read it
    here."""
    tasks: set[asyncio.Task[None]] = set()
    member = svc.fleet
    if member is not None:

        def reload_fleet() -> None:
            task = asyncio.create_task(reload_through_log(member))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        return reload_fleet

    def reload() -> None:
        # A refused reload has been logged with its reason; the running configuration stays.
        with contextlib.suppress(InvalidRequest):
            reload_settings(svc)

    return reload


def ssl_context(tls: TlsSettings) -> ssl.SSLContext | None:
    """A server TLS context from the configured certificate chain and key, if any."""
    if not tls.enabled:
        return None
    assert tls.cert_file is not None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


class ListenError(Exception):
    """A listener could not be opened (its port taken, say): one line for the operator."""


async def listen(start: Awaitable[None], host: str, port: int, setting: str) -> None:
    try:
        await start
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ListenError(
            f"cannot listen on {host}:{port}: {why.lower()} (set {setting})"
        ) from None


async def run_until_signalled(
    settings: Settings, loader: SettingsLoader | None = None, worker: Worker | None = None
) -> None:
    """One gateway process until SIGINT/SIGTERM; ``worker``: one of ``serve --workers``'
    (its port shared, its in-flight counts in the host's table, its admin API worker 0's on
    the admin port and the others' on their private sockets)."""
    async with open_gateway(settings, loader=loader, worker=worker) as svc:
        server = data_plane(svc)
        runners = await _open_listeners(svc, server)
        settle_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, _on_sighup(svc))
        try:
            await stop.wait()
        finally:
            await stop_gracefully(svc, server, runners)


async def _open_listeners(svc: Services, server: Server) -> list[web.AppRunner]:
    """A worker's private socket, the admin API (with a token), then the model endpoints'
    port; the aiohttp runners, to stop first. ``ListenError``: what was opened is closed."""
    settings, worker = svc.settings, svc.worker
    runners: list[web.AppRunner] = []
    admin_address = None
    try:
        if worker is not None:  # what the other workers ask it (its figures, response homes)
            own = make_runner(private_app(svc), shutdown_timeout=1)
            await own.setup()
            runners.insert(0, own)
            await web.UnixSite(own, str(worker.private_socket(worker.index))).start()
        if settings.admin.token is not None:
            admin = make_runner(
                create_admin_app(svc, settings.admin.token.get_secret_value()),
                shutdown_timeout=1,
            )
            await admin.setup()
            runners.insert(0, admin)
            if worker is not None:  # every worker's, for its own reads; changes go to the log
                path = worker.admin_socket(worker.index)
                await web.UnixSite(admin, str(path)).start()
                admin_address = str(path)
            if worker is None or worker.index == 0:
                admin_site = web.TCPSite(admin, settings.admin.host, settings.admin.port)
                await listen(
                    admin_site.start(),
                    settings.admin.host,
                    settings.admin.port,
                    "--admin-port, GATEWAY_ADMIN__PORT or `admin.port`",
                )
                admin_address = admin_site.name
        # Last: a worker takes traffic once it routes as the others do.
        opening = server.start(
            host=settings.host,
            port=settings.port,
            reuse_port=worker is not None,
            backlog=settings.backlog,
            ssl=ssl_context(settings.tls),
        )
        await listen(opening, settings.host, settings.port, "--port, GATEWAY_PORT or `port`")
    except ListenError:
        for r in runners:
            await r.cleanup()
        await server.cleanup(0)
        raise
    log.info(
        "gateway_listening",
        address=", ".join(
            f"{'https' if settings.tls.enabled else 'http'}://{a[0]}:{a[1]}"
            for a in server.addresses
        ),
        admin=admin_address,
        backends=[b.id for b in settings.backends],
        discovery=settings.discovery.dns or None,
        policy=settings.policy,
    )
    return runners


def serve(settings: Settings, loader: SettingsLoader | None = None) -> int:
    """Run the gateway: one process, or ``workers`` of them under a supervisor; the exit
    code (2: the configuration or a listener was refused)."""
    configure_logging(settings.log_level, settings.log_format)
    count = settings.worker_count
    if count == 1:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(run_until_signalled(settings, loader))
        return 0
    if settings.port == 0:  # every worker must take the same port: choose it once
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    reserve_port(settings.host, settings.port)  # taken: say so once, not once per worker

    def one(worker: Worker) -> int:
        structlog.contextvars.bind_contextvars(worker=worker.index)
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(run_until_signalled(settings, loader, worker))
        except ListenError as exc:
            log.error("worker_cannot_listen", error=str(exc))
            return 2
        return 0

    # In a fleet a reload is an admin change (in the log, replayed by a worker started again):
    # SIGHUP goes to worker 0, which appends it once.
    return WorkerSupervisor(count, one, hup_to_first=settings.fleet_store is not None).run()


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def reserve_port(host: str, port: int) -> None:
    """Fail early, with one line, if ``port`` cannot be shared by the workers."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = (exc.strerror or str(exc)).lower()
            raise ListenError(
                f"cannot listen on {host}:{port}: {why} (set --port, GATEWAY_PORT or `port`)"
            ) from None

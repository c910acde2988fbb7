"""The load driver: one event loop (uvloop from the CLI), one pooled aiohttp session.

``run_load`` sends a workload at a load shape to one base URL and returns every request's
record (``loadtest.stats.RequestRecord``). Times are ``time.perf_counter`` stamps taken when
a read returns, so anything that delays this loop is added to the figures: a probe task
measures the loop's own lag, and the summary warns when it is large enough to matter.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import resource
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest.arrivals import ClosedLoop, LoadShape
from loadtest.stats import Dist, RequestRecord, timings_from_timer
from loadtest.stream import StreamTimer
from loadtest.workload import RequestSpec, Workload


@dataclass(frozen=True, slots=True)
class ClientOptions:
    request_timeout: float = 300.0  # whole request
    stall_timeout: float = 30.0  # no byte for this long: the request is a "stall"
    grace: float = 60.0  # after the last send, wait this long for requests in flight
    api_key: str | None = None
    lag_interval: float = 0.01  # loop-lag probe period


@dataclass(slots=True)
class Live:
    """Counters the progress display reads while a run goes on."""

    sent: int = 0
    done: int = 0
    errors: int = 0
    elapsed: float = 0.0
    total_time: float | None = None
    total_requests: int | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    url: str
    workload: Workload
    load: LoadShape
    records: list[RequestRecord]
    started_at: float  # Unix time
    wall: float  # seconds from the first send to the last end
    loop_lag: Dist
    client_cpu: float  # seconds of this process's CPU during the run
    unfinished: int  # requests cancelled after the grace period

    @property
    def client_cpu_share(self) -> float:
        return self.client_cpu / self.wall if self.wall > 0 else 0.0


Timed = Sequence[tuple[float, Callable[[], Awaitable[None]]]]


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def error_kind(exc: BaseException) -> str:
    """A short name for what a request's client met (also the soak's)."""
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "stall"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "disconnect"
    if isinstance(exc, aiohttp.ClientOSError | OSError):
        return "disconnect"
    return type(exc).__name__


class _Run:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: Sequence[str],
        workload: Workload,
        load: LoadShape,
        *,
        options: ClientOptions,
        live: Live,
    ) -> None:
        self.session = session
        self.urls = [u.rstrip("/") for u in urls]
        self.workload = workload
        self.load = load
        self.live = live
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self.headers = {"Content-Type": "application/json"}
        if options.api_key:
            self.headers["Authorization"] = f"Bearer {options.api_key}"
        self.finished: dict[int, asyncio.Event] = {}
        self._specs: Iterator[RequestSpec] = workload.requests()
        if load.requests is not None:
            self._specs = itertools.islice(self._specs, load.requests)

    def next_spec(self) -> RequestSpec | None:
        until = self.load.issue_until
        if until is not None and time.perf_counter() - self.t0 >= until:
            return None
        return next(self._specs, None)

    async def send(self, spec: RequestSpec) -> None:
        if spec.after is not None:
            await self.finished.setdefault(spec.after, asyncio.Event()).wait()
            self.finished.pop(spec.after, None)
        try:
            record = await self._request(spec)
        finally:
            if self.workload.turns > 1:
                self.finished.setdefault(spec.index, asyncio.Event()).set()
        self.records.append(record)
        self.live.done += 1
        if not record.ok:
            self.live.errors += 1

    async def _request(self, spec: RequestSpec) -> RequestRecord:
        body = json.dumps(spec.body, separators=(",", ":")).encode()
        sent = time.perf_counter()
        self.live.sent += 1
        start = sent - self.t0
        warmup = self.load.is_warmup(start)
        timer = StreamTimer()
        status = 0
        error: str | None = None
        tokens = 0
        ttft: float | None = None
        try:
            url = self.urls[spec.index % len(self.urls)]
            async with self.session.post(url + spec.path, data=body, headers=self.headers) as resp:
                status = resp.status
                if status != 200:
                    await resp.read()
                    error = f"http_{status}"
                elif self.workload.stream:
                    content = resp.content
                    perf = time.perf_counter
                    while chunk := await content.readany():
                        timer.feed(perf(), chunk)
                else:
                    tokens = _usage_tokens(await resp.json(content_type=None))
        except asyncio.CancelledError:
            self.records.append(
                RequestRecord(start, status=status, error="unfinished", warmup=warmup)
            )
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            error = error_kind(exc)
        e2e = time.perf_counter() - sent
        itls: tuple[float, ...] = ()
        if not self.workload.stream and error is None:
            ttft = e2e  # as vLLM's benchmark: the whole answer is the first token
        if self.workload.stream and error is None:
            t = timings_from_timer(sent, timer)
            ttft, itls = t.ttft, t.itls
            tokens = t.usage_tokens if t.usage_tokens is not None else t.content_events
            if t.error is not None:
                error = "stream_error"
            elif not t.done:
                error = "incomplete"
            elif t.content_events == 0:
                error = "no_content"
        return RequestRecord(
            start=start,
            ttft=ttft,
            itls=itls,
            e2e=e2e,
            tokens_out=tokens,
            status=status,
            error=error,
            warmup=warmup,
            prompt_tokens=spec.prompt_tokens,
        )


def _usage_tokens(doc: Any) -> int:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return 0


async def _probe_lag(lags: list[float], interval: float) -> None:
    perf = time.perf_counter
    while True:
        t = perf()
        await asyncio.sleep(interval)  # sleep-ok: the probe measures how late this wakes
        lags.append(max(perf() - t - interval, 0.0))


async def _at(t0: float, at: float, action: Callable[[], Awaitable[None]]) -> None:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))  # sleep-ok: scheduled event
    await action()


async def _tick(run: _Run, on_tick: Callable[[Live], None], period: float = 0.2) -> None:
    while True:
        run.live.elapsed = time.perf_counter() - run.t0
        on_tick(run.live)
        await asyncio.sleep(period)  # sleep-ok: progress display refresh


async def run_load(
    url: str | Sequence[str],
    workload: Workload,
    load: LoadShape,
    options: ClientOptions | None = None,
    *,
    on_tick: Callable[[Live], None] | None = None,
    timed: Timed = (),
) -> RunResult:
    """Send ``workload`` to ``url`` at ``load``; ``timed`` actions run at their offsets (s).

    Given several URLs, request *i* goes to ``url[i % n]`` (the "direct" baseline of the
    overhead benchmark: backends without a gateway).
    """
    urls = [url] if isinstance(url, str) else list(url)
    options = options or ClientOptions()
    live = Live(total_time=load.issue_until, total_requests=load.requests)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout, sock_read=options.stall_timeout)
    lags: list[float] = []
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        run = _Run(session, urls, workload, load, options=options, live=live)
        helpers = [asyncio.create_task(_probe_lag(lags, options.lag_interval))]
        if on_tick is not None:
            helpers.append(asyncio.create_task(_tick(run, on_tick)))
        helpers += [asyncio.create_task(_at(run.t0, at, action)) for at, action in timed]
        started_at = time.time()
        cpu0 = _cpu_seconds()
        try:
            tasks = await _issue(run)
            unfinished = 0
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=options.grace)
                unfinished = len(pending)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if on_tick is not None:
                live.elapsed = time.perf_counter() - run.t0
                on_tick(live)
        cpu = _cpu_seconds() - cpu0
    records = sorted(run.records, key=lambda r: r.start)
    wall = max((r.start + (r.e2e or 0.0) for r in records), default=0.0)
    return RunResult(
        url=",".join(urls),
        workload=workload,
        load=load,
        records=records,
        started_at=started_at,
        wall=wall,
        loop_lag=Dist.of(lags),
        client_cpu=cpu,
        unfinished=unfinished,
    )


async def _issue(run: _Run) -> set[asyncio.Task[None]]:
    """Send until the load's end; return the tasks still to wait for."""
    arrivals = run.load.arrivals
    if isinstance(arrivals, ClosedLoop):

        async def worker() -> None:
            while (spec := run.next_spec()) is not None:
                await run.send(spec)

        return {asyncio.create_task(worker()) for _ in range(arrivals.concurrency)}
    schedule = run.load.schedule() or []
    tasks: set[asyncio.Task[None]] = set()
    specs = run.workload.requests()
    for at in schedule:
        delay = run.t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # sleep-ok: open-loop arrival schedule
        task = asyncio.create_task(run.send(next(specs)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    return set(tasks)


def run(coro: Awaitable[Any]) -> Any:
    """Run ``coro`` on uvloop (asyncio's loop if uvloop is missing)."""

    async def main() -> Any:
        return await coro

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main())
    return uvloop.run(main())

"""The soak's client: sends one ``Plan`` and records what it saw as an ``Observation``.

A client that leaves does what a real one does: it closes its connection (aiohttp drops a
connection whose response was not read to the end), before the response head, right after
it, after k tokens of a stream, or while waiting for a non-streamed answer. A slow reader
reads a little at a time, so the gateway meets back-pressure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import aiohttp

from loadtest.client import error_kind
from loadtest.soak.invariants import LimitsProbe
from loadtest.soak.mix import Plan, probe_plan
from loadtest.soak.outcomes import ErrorInfo, Left, Observation, parse_envelope, stream_error_event
from loadtest.stream import StreamTimer

Clock = Callable[[], float]
_TAIL: Final = 8192  # bytes of a stream's end kept to find an error event in
SLOW_READ_BYTES: Final = 512
SLOW_READ_PAUSE_S: Final = 0.05
CLIENT_TIMEOUT: Final = aiohttp.ClientTimeout(total=120.0, sock_read=30.0)


@dataclass(slots=True)
class _Seen:
    """What one request has shown so far (filled in as it goes)."""

    start: float
    status: int = 0
    head_at: float | None = None
    timer: StreamTimer = field(default_factory=StreamTimer)
    first_token_at: float | None = None
    tail: bytes = b""
    done: bool = False
    error: ErrorInfo | None = None
    exception: str | None = None
    left: Left | None = None
    left_at: float | None = None

    def feed(self, now: float, chunk: bytes) -> None:
        self.timer.feed(now, chunk)
        if self.first_token_at is None and self.timer.token_times:
            self.first_token_at = self.timer.token_times[0]
        self.tail = (self.tail + chunk)[-_TAIL:]


def _headers(plan: Plan) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {plan.api_key}",
        "X-Request-Id": f"soak-{plan.index}",
    }
    if plan.session is not None:
        headers["x-session-id"] = plan.session
    return headers


async def execute(
    session: aiohttp.ClientSession, base_url: str, plan: Plan, clock: Clock
) -> Observation:
    """Send ``plan`` to ``base_url`` and behave as it says; never raises but on cancellation."""
    seen = _Seen(start=clock())
    try:
        await _run(session, base_url + plan.path, plan, clock, seen)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        seen.exception = error_kind(exc)
    if seen.error is None and seen.timer.error is not None:
        seen.error = stream_error_event(seen.tail) or ErrorInfo(
            seen.timer.error, None, None, None, well_formed=False
        )
    return Observation(
        index=plan.index,
        replica=plan.replica,
        behaviour=plan.behaviour,
        key=plan.key,
        stream=plan.stream,
        start=seen.start,
        end=clock(),
        status=seen.status,
        head_at=seen.head_at,
        first_token_at=seen.first_token_at,
        tokens=len(seen.timer.token_times),
        done=seen.done,
        error=seen.error,
        exception=seen.exception,
        left=seen.left,
        left_at=seen.left_at,
    )


async def _run(
    session: aiohttp.ClientSession, url: str, plan: Plan, clock: Clock, seen: _Seen
) -> None:
    post = session.post(url, data=plan.body, headers=_headers(plan))
    if plan.behaviour in ("disconnect_before_head", "disconnect_nonstream_wait"):
        task = asyncio.ensure_future(post)
        done, _ = await asyncio.wait({task}, timeout=plan.wait_s)
        if not done:  # no head yet: leave, which closes the connection
            task.cancel()
            (late,) = await asyncio.gather(task, return_exceptions=True)
            if isinstance(late, aiohttp.ClientResponse):  # the head won the race with cancel
                late.close()
            seen.left = (
                "before_head" if plan.behaviour == "disconnect_before_head" else "nonstream_wait"
            )
            seen.left_at = clock()
            return
        resp = task.result()
    else:
        resp = await post
    try:
        seen.status, seen.head_at = resp.status, clock()
        if resp.status != 200:
            seen.error = parse_envelope(await resp.read())
            return
        if plan.behaviour in ("disconnect_before_head", "disconnect_after_head") and plan.stream:
            resp.close()  # the head came first: leave before reading a byte of the body
            seen.left, seen.left_at = "after_head", clock()
            return
        if not plan.stream:
            body = await resp.read()
            seen.done = _is_answer(body)
            if not seen.done:
                seen.error = parse_envelope(body)
            return
        await _read_stream(resp, plan, clock, seen)
    finally:
        resp.release()  # a body not read to its end: the connection is closed, not reused


async def _read_stream(resp: aiohttp.ClientResponse, plan: Plan, clock: Clock, seen: _Seen) -> None:
    slow = plan.behaviour == "slow_reader"
    content = resp.content
    while chunk := await (content.read(SLOW_READ_BYTES) if slow else content.readany()):
        seen.feed(clock(), chunk)
        if plan.leave_after_tokens and len(seen.timer.token_times) >= plan.leave_after_tokens:
            resp.close()
            seen.left, seen.left_at = "mid_stream", clock()
            return
        if slow:
            await asyncio.sleep(SLOW_READ_PAUSE_S)  # sleep-ok: a slow reader reads slowly
    seen.done = seen.timer.done


def _is_answer(body: bytes) -> bool:
    return body.startswith(b"{") and b'"choices"' in body and b'"error"' not in body[:20]


async def limits_probe(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    *,
    at: float,
    rpm: int,
    clock: Clock,
    total: int = 120,
    first_index: int = 10_000_000,
) -> tuple[LimitsProbe, list[Observation]]:
    """A burst of ``total`` requests on the probed key, one client per replica, back to back.

    One client per replica (two in all) stays under the key's max_concurrent of 4 even while
    the slot of the request just answered is still being released, so every refusal is the
    requests-per-minute budget's.
    """
    per = total // len(urls)
    observations: list[Observation] = []
    sends: list[float] = []

    async def client(r: int) -> None:
        for k in range(per):
            plan = probe_plan(first_index + r * per + k, r)
            sends.append(clock())
            observations.append(await execute(session, urls[r], plan, clock))

    await asyncio.gather(*(client(r) for r in range(len(urls))))
    answers = [o.head_at if o.head_at is not None else o.end for o in observations]
    admitted = rate = conc = 0
    other: dict[str, int] = {}
    for o in observations:
        message = o.error.message if o.error is not None and o.error.message else ""
        if o.status == 200 and o.done:
            admitted += 1
        elif o.status == 429 and "concurrent" in message:
            conc += 1
        elif o.status == 429:
            rate += 1
        else:
            key = str(o.status or o.exception)
            other[key] = other.get(key, 0) + 1
    probe = LimitsProbe(
        at=at,
        sent=len(observations),
        admitted=admitted,
        rate_limited=rate,
        concurrency_limited=conc,
        other=other,
        elapsed=max(sends) - min(sends) if sends else 0.0,
        rpm=rpm,
        window_min=max(0.0, max(sends) - min(answers)) if answers else None,
        window_max=max(answers) - min(sends) if answers else None,
    )
    return probe, observations


def now_since(t0: float) -> Clock:
    return lambda: time.monotonic() - t0

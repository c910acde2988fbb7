"""The asyncio side of the engine: one loop task that steps it in (scaled) real time.

Each step's simulated duration is slept against an absolute schedule, so the
simulated clock and the wall clock stay together unless the process cannot keep up;
how far it falls behind is measured (``lag``, ``busy_wall`` vs ``busy_sim``). Tokens
are handed to waiting HTTP handlers through one ``RequestHandle`` each: a list and a
future, no task or queue per token.

With KV-cache events on, what a step changed in the prefix cache goes to
``kv_event_sink`` as one batch when the step's tokens are delivered (vLLM publishes a
step's events after its forward pass); a step that changed nothing sends nothing.

``abort`` ends a request on demand (vLLM's ``/inference/v1/abort_requests``): it leaves the
engine at once and its handle finishes with reason ``abort`` and no further token.

Sleep mode (``sleep_mode.py``) pauses the engine through ``pause`` (aborting every request
in mode ``abort``), waits for the running requests to finish with ``drained`` (mode
``wait``), discards the KV cache with ``drop_kv_cache`` and lets it run again with
``resume``. A paused engine's loop idles, the requests still in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tools.sim.engine import Engine, PauseState, Request, TokenEvent, TokenSource
from tools.sim.kvcache import CacheEvent

KvEventSink = Callable[[list[CacheEvent]], object]


class RequestHandle:
    """A request's mailbox: tokens arrive here, the handler takes them in batches."""

    __slots__ = (
        "_pending",
        "_waiter",
        "block_ids",
        "cached_tokens",
        "created_tokens",
        "finish_reason",
        "num_tokens",
        "request_id",
        "stream",
    )

    def __init__(self, request_id: int, *, stream: bool) -> None:
        self.request_id = request_id
        self.stream = stream
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.block_ids: tuple[int, ...] = ()  # a prefill-only request's KV blocks, at its end
        self.cached_tokens = 0  # the prompt's prefix-cache figures, from its first token
        self.created_tokens = 0
        self._pending: list[TokenEvent] = []
        self._waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _push(self, event: TokenEvent) -> None:
        self._pending.append(event)
        self.num_tokens = event.index + 1
        if event.index == 0:
            self.cached_tokens = event.cached_tokens
            self.created_tokens = event.created_tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.block_ids = event.block_ids
        elif not self.stream:
            return  # a non-streaming handler only wants the end
        self._wake()

    def _aborted(self) -> None:
        self.finish_reason = "abort"
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def tokens(self) -> list[TokenEvent]:
        """The tokens produced since the last call: waits for at least one, or for the end
        (an aborted request's may bring none)."""
        while self.finish_reason is None and (not self._pending or not self.stream):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._pending
        self._pending = []
        return out


class EngineDriver:
    """Runs ``engine`` on the event loop; ``submit``/``release`` from HTTP handlers."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.slowdown = 1.0
        self._clock = clock
        self._handles: dict[int, RequestHandle] = {}
        self._next_id = 0
        self._wake = asyncio.Event()
        self._idle: list[asyncio.Future[None]] = []  # ``drained`` callers
        self.lag = 0.0  # wall clock behind the simulated clock now, seconds
        self.max_lag = 0.0
        self.busy_sim = 0.0  # simulated seconds of steps
        self.busy_wall = 0.0  # wall seconds those steps took
        self.steps = 0
        # Receives each step's KV-cache events (the publisher's ``publish``); None: off.
        self.kv_event_sink: KvEventSink | None = None

    def now(self) -> float:
        """The simulated time of an event happening now."""
        return self._clock() - self.lag

    def submit(
        self,
        prompt_ids: tuple[int, ...],
        output_len: int,
        finish_reason: str,
        output: TokenSource,
        *,
        stream: bool,
        remote_decode: bool = False,
        remote_prefill: bool = False,
        priority: int = 0,
    ) -> RequestHandle:
        self._next_id += 1
        rid = self._next_id
        request = Request(
            rid,
            prompt_ids,
            output_len,
            finish_reason,
            output,
            self.now(),
            remote_decode=remote_decode,
            remote_prefill=remote_prefill,
            priority=priority,
        )
        self.engine.add_request(request)
        handle = RequestHandle(rid, stream=stream)
        self._handles[rid] = handle
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> str | None:
        """End a request now, on demand: out of the engine (the phase it was aborted in, as
        ``release``'s), its handle finished with reason ``abort``. None if it had ended."""
        if handle.finished:
            return None
        self._handles.pop(handle.request_id, None)  # tokens of the step under way: dropped
        handle._aborted()
        return self.engine.abort(handle.request_id)

    def abort_all(self) -> int:
        """Abort every request in the engine, queued or running (sleep mode ``abort``, as
        vLLM's ``finish_requests(None, FINISHED_ABORTED)``); returns how many."""
        handles = list(self._handles.values())
        for handle in handles:
            self.abort(handle)
        return len(handles)

    def pause(self, state: PauseState) -> None:
        """Pause scheduling (``paused_new``: the running requests go on; ``paused_all``:
        nothing runs); new requests are still queued."""
        self.engine.pause = state

    def resume(self) -> None:
        """Schedule again: whatever was queued or kept meanwhile runs now."""
        self.engine.pause = "unpaused"
        self._wake.set()

    async def drained(self) -> None:
        """Wait until a step has nothing left to do (with ``paused_new``: until the running
        requests have finished)."""
        if not self.engine.has_unfinished():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        await waiter

    def drop_kv_cache(self) -> None:
        """Sleep level 1 or 2: see ``Engine.drop_kv_cache``; the prefix cache's
        ``AllBlocksCleared`` is published at once."""
        self.engine.drop_kv_cache()
        self.flush_kv_events()

    def release(self, handle: RequestHandle) -> str | None:
        """The handler is done with ``handle``: abort the request if it is still in
        the engine, returning the phase it was aborted in."""
        self._handles.pop(handle.request_id, None)
        if handle.finished:
            return None
        return self.engine.abort(handle.request_id)

    async def run(self) -> None:
        """Step the engine for ever (cancel the task to stop)."""
        engine = self.engine
        clock = self._clock
        mark: float | None = None  # wall time the current busy stretch is accounted to
        while True:
            if not engine.has_unfinished():
                self.lag = 0.0
                mark = None
                self._notify_idle()
                self._wake.clear()
                await self._wake.wait()
                continue
            if mark is None:
                mark = clock()
                engine.clock = max(engine.clock, mark)  # idle time passes in the simulation too
            result = engine.step(engine.clock, self.slowdown)
            if result.duration == 0 and not result.tokens:
                ready_at = engine.next_ready_at()
                if ready_at is not None:
                    # Nothing can run until a KV transfer completes (or a request arrives).
                    self.flush_kv_events()  # a transfer's allocation may have evicted blocks
                    self.lag = 0.0
                    mark = None
                    self._wake.clear()
                    woken = True
                    try:
                        async with asyncio.timeout(max(0.0, ready_at - engine.clock)):
                            await self._wake.wait()
                    except TimeoutError:
                        woken = False
                    engine.clock = max(engine.clock, clock() if woken else ready_at)
                    continue
            if result.duration > 0:
                self.steps += 1
                delay = engine.clock - clock()
                # Always yield, even when late, so that handlers get to write.
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                await asyncio.sleep(0)
            self._deliver(result.tokens)
            if self.kv_event_sink is not None:
                self.flush_kv_events()
            ended = clock()
            self.busy_sim += result.duration
            self.busy_wall += ended - mark
            mark = ended
            self.lag = max(0.0, ended - engine.clock)
            self.max_lag = max(self.max_lag, self.lag)

    def _notify_idle(self) -> None:
        waiters, self._idle = self._idle, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def flush_kv_events(self) -> None:
        """Hand what the cache recorded since the last flush to the sink, as one batch."""
        sink = self.kv_event_sink
        if sink is None:
            return
        events = self.engine.pool.take_events()
        if events:
            sink(events)

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """``POST /reset_prefix_cache``: see ``Engine.reset_prefix_cache``. Its
        ``AllBlocksCleared`` is published at once (after anything the step in progress
        recorded, which goes out with it), not with the next step as vLLM does: an idle
        engine would never send it."""
        ok = self.engine.reset_prefix_cache(reset_running_requests=reset_running_requests)
        self.flush_kv_events()
        if reset_running_requests:
            self._wake.set()
        return ok

    def _deliver(self, events: list[TokenEvent]) -> None:
        handles = self._handles
        for ev in events:
            handle = handles.get(ev.request_id)
            if handle is not None:
                handle._push(ev)
                if ev.finish_reason is not None:
                    del handles[ev.request_id]

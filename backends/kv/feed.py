"""Following each backend's KV-cache event stream into the ``KvIndex``.

Per backend, a loop finds its publishers (``GET /kv_event_sources``, vLLM's own answer per
data-parallel rank, else the configured endpoint template), connects a ZMQ SUB socket to each
(an endpoint vLLM binds on ``*`` or ``0.0.0.0`` is reached at the backend's own host) and
applies every batch to the index, in sequence:

- **Gaps** (a sequence number skipped: the SUB socket dropped messages, or the connection was
  lost for a while) are repaired from the publisher's replay socket; what the replay no longer
  holds cannot be known, so that backend's entries are cleared (the index may then miss blocks
  the engine holds, never claim blocks it dropped).
- **A restarted engine** starts its sequence at 0 again, with newer timestamps: its entries are
  cleared before its new events are applied. A backend that the health checks mark down is
  cleared too: whatever comes back starts empty.
- **Liveness**: a backend is *live* (its entries are exact, the policy may route on them) while
  its SUB socket holds a ZMTP connection to every publisher (socket monitor events) and its
  sequence is repaired. A backend without events (``/kv_event_sources`` empty, no publisher
  listening, messages that cannot be decoded) is never live: the policy falls back to the
  approximate index for it, and a warning names it and says why, once per state change.

On first contact, and after every reconnection, the replay socket is asked for everything it
holds, so a gateway started (or restarted) next to a running engine knows its cache at once.
Every gateway replica follows the same publishers, so replicas hold the same index without
talking to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from backends.errors import UpstreamError
from backends.kv.sources import (
    FeedSettings,
    FeedStatus,
    Source,
    parse_sources,
)
from backends.kv.wire import END_SEQ, decode, seq_of
from backends.pool import BackendPool
from backends.state import BackendState
from backends.supervise import Supervisor
from backends.upstream.client import Transport, json_or_none
from policies.kv_index import Event, KvIndex, Removed, Stored

log = structlog.get_logger("backends.kv.feed")

_CONNECTED: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED
_LOST: Final = zmq.EVENT_DISCONNECTED
_MAX_MESSAGE: Final = 256 * 1024 * 1024


def _ranked(rank: int, events: list[Event]) -> list[Event]:
    """Data-parallel ranks share one backend's index; their engine hashes must not collide."""
    if rank == 0:
        return events
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, Stored):
            parent = None if ev.parent is None else (rank, ev.parent)
            out.append(
                Stored([(rank, h) for h in ev.hashes], parent, ev.tokens, ev.block_size, ev.extra)
            )
        elif isinstance(ev, Removed):
            out.append(Removed([(rank, h) for h in ev.hashes]))
        else:
            out.append(ev)
    return out


class _Sequence:
    """One publisher's position: the next sequence number expected, the newest timestamp."""

    __slots__ = ("expected", "last_ts")

    def __init__(self) -> None:
        self.expected: int | None = None
        self.last_ts = float("-inf")


class KvFeeds:
    """One feed per backend of the pool, into ``index``; follows the pool's membership."""

    def __init__(
        self,
        pool: BackendPool,
        index: KvIndex,
        client: Transport,
        settings: FeedSettings,
        *,
        supervisor: Supervisor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._index = index
        self._client = client
        self._settings = settings
        self._supervisor = supervisor or Supervisor()
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sync: asyncio.Task[None] | None = None
        self.status: dict[str, FeedStatus] = {}

    async def start(self) -> None:
        self._sync = self._supervisor.spawn("kv_feeds", "kv-feeds", self._membership)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *([self._sync] if self._sync else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    # -- membership --------------------------------------------------------------------------

    async def _membership(self) -> None:
        while True:
            present = {b.id: b for b in self._pool.all() if not b.removed}
            for bid, backend in present.items():
                if bid not in self._tasks:
                    self.status[bid] = FeedStatus()
                    self._tasks[bid] = self._supervisor.spawn(
                        "kv_feed", f"kv-feed:{bid}", functools.partial(self._follow, backend)
                    )
            for bid in set(self._tasks) - set(present):
                self._tasks.pop(bid).cancel()
                self.status.pop(bid, None)
                self._index.forget(bid)
            await asyncio.sleep(self._settings.poll_interval)

    # -- one backend -----------------------------------------------------------------------

    def _set(self, backend: str, state: str, why: str = "") -> None:
        st = self.status.setdefault(backend, FeedStatus())
        if (st.state, st.why) == (state, why):
            return
        was, st.state, st.why = st.state, state, why
        self._index.set_live(backend, state == "live")
        if state == "live":
            log.info("kv_events_live", backend=backend, was=was)
        elif state in ("off", "undecodable", "disconnected") or why:
            log.warning(
                "kv_events_not_followed",
                backend=backend,
                state=state,
                why=why,
                routing="approximate prefix index for this backend",
            )

    async def _follow(self, backend: BackendState) -> None:
        bid = backend.id
        try:
            while True:
                sources = await self._sources(backend)
                if isinstance(sources, str):
                    self._set(bid, "off", sources)
                    await asyncio.sleep(self._settings.rediscover_interval)
                    continue
                self.status[bid].sources = tuple(sources)
                await self._subscribe(backend, sources)
        finally:
            self._index.set_live(bid, False)

    async def _sources(self, backend: BackendState) -> list[Source] | str:
        s = self._settings
        why = "no endpoint configured and discovery is off"
        if s.discover:
            try:
                status, raw = await self._client.get(
                    backend.spec, "/kv_event_sources", within=s.replay_timeout
                )
            except UpstreamError as exc:
                status, raw, why = 0, b"", f"GET /kv_event_sources failed: {exc.message}"
            if status == 200:
                found = parse_sources(json_or_none(raw), backend.spec.url)
                if not isinstance(found, str) or s.endpoint is None:
                    return found
                why = found
            elif status:
                why = f"GET /kv_event_sources answered {status} (vLLM older than 0.12?)"
        if s.endpoint is None:
            return why
        host = urlsplit(backend.spec.url).hostname or "127.0.0.1"
        replay = s.replay_endpoint.format(host=host) if s.replay_endpoint else None
        return [Source(0, s.endpoint.format(host=host), replay, s.topic)]

    async def _subscribe(self, backend: BackendState, sources: list[Source]) -> None:
        """Follow ``sources`` until one of them fails for good or the backend goes down."""
        bid = backend.id
        self._set(bid, "connecting")
        connected: dict[int, bool] = {src.rank: False for src in sources}
        async with asyncio.TaskGroup() as tg:
            for src in sources:
                tg.create_task(self._rank(backend, src, connected))
            tg.create_task(self._health(backend, connected))

    async def _health(self, backend: BackendState, connected: dict[int, bool]) -> None:
        """Clear a backend the probes marked down; warn when no publisher ever connects."""
        bid, s = backend.id, self._settings
        since = time.monotonic()
        was_up = backend.up
        while True:
            await asyncio.sleep(s.poll_interval)
            if was_up and not backend.up:
                self._index.clear(bid)
                log.info("kv_index_cleared", backend=bid, why="backend marked down")
            was_up = backend.up
            if all(connected.values()):
                since = time.monotonic()
            elif time.monotonic() - since > s.silent_warning_s:
                st = self.status[bid]
                if st.state != "live":
                    missing = sorted(r for r, ok in connected.items() if not ok)
                    self._set(
                        bid,
                        st.state if st.state != "connecting" else "disconnected",
                        f"no publisher answering at rank(s) {missing}: is vLLM started with "
                        "--kv-events-config, its port reachable from the gateway, and its "
                        "endpoint one it binds (tcp://*:PORT; vLLM connects out to any other "
                        "host, where no gateway listens)?",
                    )
                since = time.monotonic()

    async def _rank(self, backend: BackendState, src: Source, connected: dict[int, bool]) -> None:
        bid = backend.id
        seq = _Sequence()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)  # a batch is KiBs; this bounds memory
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        mon = sub.get_monitor_socket(_CONNECTED | _LOST)
        sub.connect(src.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(timeout=1000))
                if mon in ready:
                    evt = parse_monitor_message(await mon.recv_multipart())
                    if evt["event"] == _CONNECTED:
                        connected[src.rank] = True
                        # Everything the replay holds: what was missed while disconnected,
                        # or a restarted engine's first batches (told apart by timestamps).
                        await self._reconnected(bid, src, seq)
                        if all(connected.values()):
                            self._set(bid, "live")
                    elif evt["event"] == _LOST:
                        connected[src.rank] = False
                        self._set(bid, "disconnected", f"lost the connection to {src.endpoint}")
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3:
                        self.status[bid].problems["bad_frames"] += 1
                        continue
                    n = seq_of(frames[1])
                    if seq.expected is not None and n > seq.expected:
                        await self._resync(bid, src, seq, since=seq.expected, upto=n)
                    self._accept(bid, src, seq, n, frames[2])
        finally:
            connected[src.rank] = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    async def _reconnected(self, bid: str, src: Source, seq: _Sequence) -> None:
        """(Re)connected: catch up from the replay socket, and tell a restarted publisher
        (its buffer ends before what we saw, or is empty) from a connection that blipped."""
        if seq.expected is None:  # first contact: whatever the buffer holds
            await self._resync(bid, src, seq, since=0)
            return
        got = await self._replay(src, 0) if src.replay else None
        if got is None or not got or got[-1][0] < seq.expected - 1:
            why = "no replay socket to catch up from" if got is None else "publisher restarted"
            self.status[bid].gaps["restart" if got is not None else "lost"] += 1
            self._index.clear(bid)
            log.info("kv_index_cleared", backend=bid, why=why)
            seq.expected, seq.last_ts = None, float("-inf")
        for n, payload in got or ():
            self._accept(bid, src, seq, n, payload)

    async def _resync(
        self, bid: str, src: Source, seq: _Sequence, *, since: int, upto: int | None = None
    ) -> None:
        """Ask the replay socket for batches from ``since``; clear what cannot be repaired."""
        st = self.status[bid]
        got = await self._replay(src, since) if src.replay else None
        if got is None:
            if upto is not None:  # a gap nothing can fill
                st.gaps["lost"] += 1
                self._index.clear(bid)
                log.warning(
                    "kv_events_gap",
                    backend=bid,
                    missing=upto - since,
                    repaired=False,
                    why="no replay endpoint" if not src.replay else "replay did not answer",
                )
            return
        if upto is not None and (not got or got[0][0] > since):
            st.gaps["lost"] += 1
            self._index.clear(bid)
            log.warning("kv_events_gap", backend=bid, missing=upto - since, repaired=False)
        elif upto is not None:
            st.gaps["replayed"] += 1
        for n, payload in got:
            if upto is not None and n >= upto:
                break
            self._accept(bid, src, seq, n, payload)

    async def _replay(self, src: Source, since: int) -> list[tuple[int, bytes]] | None:
        assert src.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(src.replay)
            await dealer.send_multipart([b"", since.to_bytes(8, "big")])
            async with asyncio.timeout(self._settings.replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        continue
                    n = seq_of(frames[2])
                    if n == END_SEQ:
                        return out
                    out.append((n, frames[3]))
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            dealer.close(linger=0)

    def _accept(self, bid: str, src: Source, seq: _Sequence, n: int, payload: bytes) -> None:
        st = self.status[bid]
        batch = decode(payload)
        for kind, count in batch.problems.items():
            st.problems[kind] += count
        if batch.problems and not batch.events:
            if st.batches == 0:
                self._set(bid, "undecodable", f"its events cannot be read: {dict(batch.problems)}")
            return
        ts = batch.ts if batch.ts is not None else self._clock()
        if seq.expected is not None and n < seq.expected:
            if ts <= seq.last_ts:
                return  # seen already (a replay overlapping the live stream)
            st.gaps["restart"] += 1
            self._index.clear(bid)
            log.info("kv_index_cleared", backend=bid, why="publisher restarted (sequence reset)")
        seq.expected, seq.last_ts = n + 1, max(seq.last_ts, ts)
        if st.state == "undecodable":
            self._set(bid, "live")
        st.batches += 1
        st.form = batch.form or st.form
        st.lag_s = self._clock() - ts
        st.events["skipped"] += batch.skipped
        for ev in batch.events:
            st.events[_kind(ev)] += 1
        self._index.apply(bid, _ranked(src.rank, batch.events))


def _kind(ev: Event) -> str:
    if isinstance(ev, Stored):
        return "stored"
    return "removed" if isinstance(ev, Removed) else "cleared"

"""The simulator's KV-event publisher: vLLM's ``ZmqEventPublisher``, on the asyncio loop.

- a PUB socket sends ``(topic, seq, payload)``: ``seq`` 8 bytes big-endian, from 0 in
  every (re)started publisher; ``payload`` a msgpack ``KVEventBatch`` ``[ts, events,
  data_parallel_rank]`` (``kvwire.py``), one per engine step that changed the cache (none
  otherwise);
- an optional ROUTER replay socket answers ``(b"", start_seq)`` with every buffered batch
  from ``start_seq`` on, as ``(b"", topic, seq, payload)``, then the end marker
  ``(b"", b"", -1, b"")``; the last ``buffer_steps`` batches are kept.

Endpoints with ``*``, ``::``, ``ipc://`` or ``inproc://`` are bound, others connected to,
as vLLM decides. ``tcp://*:0`` binds 127.0.0.1 on a free port (vLLM binds its node IP),
and a restarted simulator binds that same port again if it can; ``endpoint`` and
``replay_endpoint`` say what was really bound, as ``GET /kv_event_sources`` does.

Everything runs on the asyncio loop, with plain non-blocking sockets: ``publish`` encodes
and sends at once (a subscriber past its high-water mark loses the batch, as with vLLM;
the batch stays in the replay buffer), and a replay request is read by a loop reader and
answered by a task that yields to the loop every ``_REPLAY_CHUNK`` batches. The publishing
socket is an XPUB, the same as PUB on the wire, so that it sees subscriptions arrive:
``subscriptions`` counts them, and a test waits for a subscriber to have joined instead of
sleeping through ZMQ's "slow joiner" gap (batches sent before that are not delivered).

``KvEvents`` runs one publisher at a time for a simulator app, across its restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import msgspec
import structlog
import zmq

from tools.sim.kvcache import CacheEvent
from tools.sim.kvwire import EventBatch, to_wire

if TYPE_CHECKING:
    from tools.sim.kvconfig import KvEventsConfig

log = structlog.get_logger(__name__)

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_ANY_PORT: Final = "tcp://*:0"
_LOCAL_ANY_PORT: Final = "tcp://127.0.0.1:0"
_REPLAY_CHUNK: Final = 256


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """vLLM's ``ZmqEventPublisher`` on the asyncio loop: PUB, optional ROUTER replay, buffer.

    Construct it in the loop that will use it (its sockets get readers there); ``close`` it
    there too. ``reuse_endpoint``/``reuse_replay_endpoint`` are endpoints a
    previous publisher bound for ``tcp://*:0``, tried first so that a restart keeps them.
    """

    def __init__(
        self,
        config: KvEventsConfig,
        block_size: int,
        *,
        reuse_endpoint: str | None = None,
        reuse_replay_endpoint: str | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.next_seq = 0
        self.dropped = 0  # batches the PUB socket refused at once (it drops silently too)
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._replays: set[asyncio.Task[None]] = set()
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._fds: list[int] = []
        self.subscriptions = 0  # subscribe requests received: each SUB that joined, once per topic
        # XPUB: PUB on the wire, but it hands us subscriptions, so a test can wait for one.
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.endpoint = config.endpoint
            if is_bind_endpoint(config.endpoint):
                self.endpoint = _bind(self._pub, config.endpoint, reuse_endpoint)
            else:
                try:
                    self._pub.connect(config.endpoint)
                except zmq.ZMQError as exc:
                    raise OSError(
                        exc.errno, f"KV events: cannot connect to {config.endpoint}: {exc}"
                    ) from exc
            self._watch(self._pub, self._take_subscriptions)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                # A whole answer is queued at once: no high-water mark, so none is cut short.
                self._router.set_hwm(0)
                self.replay_endpoint = _bind(
                    self._router, config.replay_endpoint, reuse_replay_endpoint
                )
                self._watch(self._router, self._on_replay_readable)
        except BaseException:
            self._close_sockets()
            raise

    def _watch(self, sock: zmq.Socket[bytes], callback: Callable[[], None]) -> None:
        """Call ``callback`` from the loop when ``sock`` may have something to read."""
        fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, callback)
        self._fds.append(fd)
        self._loop.call_soon(callback)

    def source(self) -> dict[str, Any]:
        """This publisher's entry of ``/kv_event_sources``."""
        return self.config.source(self.endpoint, self.replay_endpoint)

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Send the events of one step as one batch; its sequence number."""
        batch = to_wire(
            events, block_size=self.block_size, wire=self.config.wire, hashes=self.config.hashes
        )
        return self.publish_batch(batch)

    def publish_batch(self, batch: EventBatch) -> int:
        """Send a batch of wire structs as it is (a test may craft one); its sequence number."""
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0  # as vLLM's publisher stamps its rank
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        self.next_seq = seq + 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        self._buffer.append((seq, payload))
        self._take_subscriptions()  # sending may have consumed the FD's readable edge
        return seq

    async def close(self) -> None:
        """Stop answering replays and close both sockets at once (linger 0)."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._replays):
            task.cancel()
        await asyncio.gather(*self._replays, return_exceptions=True)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._closed = True
        for fd in self._fds:
            self._loop.remove_reader(fd)
        self._fds.clear()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()  # returns once the sockets are gone: their ports are free again

    def _take_subscriptions(self) -> None:
        """Count the subscriptions the XPUB socket passed up (a SUB that joined)."""
        if self._closed:
            return
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.subscriptions += 1

    # -- replay

    def _on_replay_readable(self) -> None:
        """Take every waiting request (the socket's FD signals edges, so drain it)."""
        router = self._router
        if router is None or self._closed:
            return
        while router.poll(0, zmq.POLLIN):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3:
                log.warning("sim_kv_replay_bad_request", frames=len(frames))
                continue
            client, _empty, start = frames
            wanted = int.from_bytes(start, "big")
            # A snapshot: the buffer goes on changing while the answer is sent.
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= wanted]
            task = self._loop.create_task(self._answer(client, batches))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    async def _answer(self, client: bytes, batches: list[tuple[int, bytes]]) -> None:
        router = self._router
        assert router is not None
        try:
            for i, (seq, payload) in enumerate(batches, 1):
                router.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
                if i % _REPLAY_CHUNK == 0:
                    self._recheck()
                    await asyncio.sleep(0)  # let the engine and other requests run
                    if self._closed:
                        return
            router.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("sim_kv_replay_failed", error=str(exc))
        self._recheck()

    def _recheck(self) -> None:
        """Sending may consume the FD's readable edge: look for requests again."""
        router = self._router
        if router is not None and not self._closed and router.poll(0, zmq.POLLIN):
            self._loop.call_soon(self._on_replay_readable)


def _bind(sock: zmq.Socket[bytes], endpoint: str, reuse: str | None) -> str:
    """Bind ``endpoint``; ``tcp://*:0`` binds 127.0.0.1 (``reuse``'s port if it is free)
    on a free port. Returns the endpoint as bound."""
    try:
        if endpoint != _ANY_PORT:
            if "::" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(endpoint)
            return endpoint
        if reuse is not None:
            with contextlib.suppress(zmq.ZMQError):  # taken meanwhile: any free port will do
                sock.bind(reuse)
                return reuse
        sock.bind(_LOCAL_ANY_PORT)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"KV events: cannot bind {endpoint}: {exc}") from exc
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound


class KvEvents:
    """A simulator app's KV-event publishing, across restarts of the app.

    ``start`` (at app start-up) opens a fresh publisher, so the sequence starts at 0 as in
    a new vLLM process; ``close`` (at clean-up) closes it. Nothing is opened when events
    are off. The endpoints bound for ``tcp://*:0`` are remembered and tried again.
    """

    def __init__(self, config: KvEventsConfig | None, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.publisher: KvEventPublisher | None = None
        self.starts = 0
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.active

    @property
    def subscriptions(self) -> int:
        """Subscriptions the running publisher has received (0 when none runs): wait for
        this to grow before relying on a subscriber to see what is published next."""
        return 0 if self.publisher is None else self.publisher.subscriptions

    @property
    def endpoint(self) -> str | None:
        """The PUB endpoint as bound (a subscriber connects here); None with events off."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER replay endpoint as bound; None without one."""
        return self._replay_endpoint

    def start(self) -> KvEventPublisher | None:
        if self.config is None or not self.config.active or self.publisher is not None:
            return self.publisher
        self.publisher = KvEventPublisher(
            self.config,
            self.block_size,
            reuse_endpoint=self._endpoint,
            reuse_replay_endpoint=self._replay_endpoint,
        )
        self._endpoint = self.publisher.endpoint
        self._replay_endpoint = self.publisher.replay_endpoint
        self.starts += 1
        return self.publisher

    async def close(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            await publisher.close()

    def sources(self) -> dict[str, Any]:
        """``GET /kv_event_sources``: ``{"0": config}`` while publishing, else ``{}``."""
        if self.publisher is None:
            return {}
        return {"0": self.publisher.source()}

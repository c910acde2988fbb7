"""The simulated engine core: a pure state machine stepped on simulated time.

No asyncio, no I/O. ``Engine.step(now)`` schedules one batch the way vLLM V1 does,
"runs" it, and returns how long that took in simulated seconds together with the
tokens it produced; the caller (``driver.py``) sleeps that long and delivers them.

Scheduling (after vLLM V1's unified scheduler):

- Running requests first, in admission order, each taking the tokens it still has
  to compute (a whole prompt chunk, or one decode token) out of the step's budget
  of ``max_num_batched_tokens``, so long prompts are prefilled in chunks.
- When the KV cache cannot hold a running request's next tokens, a running request is
  preempted: its blocks are freed and it goes back to the queue, to be recomputed
  (through the prefix cache) when readmitted. Under ``fcfs`` the most recently admitted
  one, back to the front of the queue; under ``priority`` the least important one (the
  highest priority value, the latest arrival among equals: vLLM's ``max`` over
  ``(priority, arrival_time)``), wherever it stands in the batch (if it was scheduled in
  this step already, its tokens go back to the budget), back in the queue's order.
- Then, unless something was preempted, waiting requests are admitted in the queue's
  order (``waiting.py``: arrival, or priority then arrival) while fewer than
  ``max_num_seqs`` run, budget remains and their blocks can be allocated; cached prefix
  blocks are reused and not computed again. As in vLLM 0.32, a waiting request never
  preempts a running one by itself, whatever its priority: it waits for a free slot and
  free blocks, which it then gets before less important ones.
- A request whose tokens are all computed samples its next token at the end of the
  step; it finishes on its EOS token (``stop``) or at ``max_tokens`` (``length``).

Disaggregated prefill (vLLM's KV connectors, e.g. NIXL):

- A ``remote_decode`` request is a prefill instance's half: its final token event carries
  the KV blocks it filled (``block_ids``), which a real prefill instance would lend to the
  decode instance. (The simulator frees them at once; vLLM holds them until read.)
- A ``remote_prefill`` request is a decode instance's half: its prompt's KV arrives from
  elsewhere. When first admitted it takes KV blocks for the prompt (local prefix-cache hits
  are not transferred) and waits, in the queue and without a running slot, until a "ready
  at" time: ``kv_transfer_us_per_token`` per transferred token later. Then it computes the
  prompt's last token itself (as vLLM's decode instance does) and decodes as usual.
  ``next_ready_at`` tells the driver when to step again if only transfers are pending.

Pausing (vLLM's scheduler pause states, which sleep mode sets; ``sleep.py``):

- ``paused_new``: running requests go on, nothing is admitted from the queue (new requests
  are still queued); ``paused_all``: nothing is scheduled at all. ``has_unfinished`` is what
  a step could still do (vLLM's ``get_num_unfinished_requests``), so a paused engine idles
  with requests in it.
- ``drop_kv_cache``: sleep levels 1 and 2 discard the KV cache: requests holding blocks are
  preempted (recomputed once awake) and the prefix cache is emptied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from tools.sim.config import SimConfig
from tools.sim.kvcache import BlockPool, chain_hash
from tools.sim.stats import EngineStats
from tools.sim.waiting import Order, WaitingQueue, waiting_queue

PauseState = Literal["unpaused", "paused_new", "paused_all"]


class TokenSource(Protocol):
    def token_id(self, index: int) -> int: ...


@dataclass(frozen=True, slots=True)
class Request:
    """A request as the engine sees it. ``finish_reason`` applies at ``output_len``."""

    request_id: int
    prompt_ids: tuple[int, ...]
    output_len: int
    finish_reason: str
    output: TokenSource
    arrival: float
    remote_decode: bool = False  # prefill-only half: report the filled KV blocks at the end
    remote_prefill: bool = False  # decode half: the prompt's KV is transferred, not computed
    priority: int = 0  # lower runs first, under the priority scheduling policy only


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Output token ``index`` of a request; the last one carries its finish reason.

    The last event of a ``remote_decode`` request also carries its KV ``block_ids``. The
    first carries the prompt's prefix-cache figures, as vLLM's ``PrefillStats``: the prompt
    tokens already computed when the request was first scheduled (``cached_tokens``: prefix
    cache hits, or KV received from a prefill instance) and those its prefill then wrote
    into the prefix cache (``created_tokens``).
    """

    request_id: int
    index: int
    finish_reason: str | None
    block_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    created_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    duration: float
    tokens: list[TokenEvent]
    preempted: list[int]
    num_seqs: int
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    clock: float
    running: int
    waiting: int
    kv_cache_usage: float
    free_blocks: int
    cached_blocks: int


class _Seq:
    """Engine-internal mutable state of one request."""

    __slots__ = (
        "blocks",
        "first_token_time",
        "hashes",
        "last_token_time",
        "num_cached",
        "num_computed",
        "num_output",
        "num_registered",
        "order",
        "ready_at",
        "remote_pending",
        "req",
        "running",
        "scheduled_time",
        "token_ids",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.order: Order = (req.priority, req.arrival, req.request_id)
        self.token_ids = list(req.prompt_ids)
        self.hashes: list[int] = []
        self.blocks: list[int] = []
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens already computed when first scheduled
        self.num_registered = 0
        self.num_output = 0
        self.running = False
        self.scheduled_time: float | None = None
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.remote_pending = req.remote_prefill  # KV transfer not begun yet
        self.ready_at: float | None = None  # set while the KV is (or was) being transferred

    def phase(self) -> str:
        if not self.running:
            return "queued" if self.ready_at is None else "transfer"
        if self.num_output == 0 or len(self.token_ids) - self.num_computed > 1:
            return "prefill"
        return "decode"


class Engine:
    """Continuous batching over a paged, prefix-cached KV cache; see module docstring."""

    def __init__(self, config: SimConfig, start: float = 0.0) -> None:
        self.config = config
        self.clock = start
        self.stats = EngineStats()
        self.pool = BlockPool(
            config.num_gpu_blocks_override,
            config.block_size,
            record_events=config.publishes_kv_events,
        )
        self.waiting: WaitingQueue[_Seq] = waiting_queue(config.scheduling_policy)
        self.running: list[_Seq] = []
        self._by_priority = config.scheduling_policy == "priority"
        self.pause: PauseState = "unpaused"
        self._seqs: dict[int, _Seq] = {}
        self._bs = config.block_size
        self._base = config.step_base_ms / 1e3
        self._per_prefill_token = config.prefill_us_per_token / 1e6
        self._per_decode_seq = config.decode_us_per_seq / 1e6
        self._per_context_token = config.attention_ns_per_token / 1e9
        self._per_transfer_token = config.kv_transfer_us_per_token / 1e6

    # -- requests in and out

    def add_request(self, req: Request) -> None:
        if req.request_id in self._seqs:
            raise ValueError(f"duplicate request id {req.request_id}")
        if not req.prompt_ids or req.output_len < 1:
            raise ValueError("a request needs a prompt and at least one output token")
        seq = _Seq(req)
        self._extend_hashes(seq)
        self._seqs[req.request_id] = seq
        self.waiting.add(seq)

    def abort(self, request_id: int) -> str | None:
        """Drop a request at once; returns its phase, or None if it already left."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        phase = seq.phase()
        if seq.running:
            self.running.remove(seq)
            self.pool.free(seq.blocks)
            seq.blocks = []
        else:
            self.waiting.remove(seq)
            self.pool.free(seq.blocks)  # a request receiving its KV holds blocks while queued
            seq.blocks = []
        self.stats.aborted[phase] += 1
        return phase

    def has_work(self) -> bool:
        """Whether any request is in the engine, paused or not."""
        return bool(self.running or self.waiting)

    def has_unfinished(self) -> bool:
        """Whether a step could do anything now: every request unless paused, only the
        running ones under ``paused_new``, none under ``paused_all``."""
        if self.pause == "paused_all":
            return False
        if self.pause == "paused_new":
            return bool(self.running)
        return bool(self.running or self.waiting)

    def drop_kv_cache(self) -> None:
        """Sleep level 1 or 2 discards the KV cache: every request holding blocks is
        preempted (running ones back to the queue, to its front in order under fcfs; a queued
        one receiving its KV will compute it instead), then the prefix cache is emptied."""
        while self.running:
            self._preempt(self.running.pop())
        for seq in self.waiting:
            if seq.blocks:
                self.pool.free(seq.blocks)
                seq.blocks = []
                seq.num_computed = 0
                seq.num_registered = 0
                seq.ready_at = None
        self.pool.clear()

    def next_ready_at(self) -> float | None:
        """The earliest time a queued request's KV transfer completes, if one is pending."""
        times = [s.ready_at for s in self.waiting if s.ready_at is not None]
        return min(times) if times else None

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every cached hash, refused (False) while any
        request holds blocks. ``reset_running_requests`` first preempts the running ones
        (they are recomputed later), so only a queued request receiving its KV can refuse."""
        if reset_running_requests:
            while self.running:  # last admitted first: fcfs puts them back in order
                self._preempt(self.running.pop())
        return self.pool.clear()

    def phase_of(self, request_id: int) -> str | None:
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.phase()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            clock=self.clock,
            running=len(self.running),
            waiting=len(self.waiting),
            kv_cache_usage=self.pool.usage,
            free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached,
        )

    # -- one step

    def step(self, now: float, slowdown: float = 1.0) -> StepResult:
        """Schedule and run one batch starting at ``max(now, clock)``."""
        self.clock = max(self.clock, now)
        start = self.clock
        scheduled, preempted = self._schedule(start)
        if not scheduled:
            return StepResult(0.0, [], preempted, 0, 0)

        prefill_tokens = 0
        decode_seqs = 0
        context = 0
        for seq, n in scheduled:
            if n == 1 and seq.num_output:
                decode_seqs += 1
                context += seq.num_computed
            else:
                prefill_tokens += n
        duration = slowdown * (
            self._base
            + prefill_tokens * self._per_prefill_token
            + decode_seqs * self._per_decode_seq
            + context * self._per_context_token
        )
        end = start + duration
        self.clock = end
        stats = self.stats
        stats.steps += 1
        stats.busy_time += duration

        events: list[TokenEvent] = []
        finished = False
        for seq, n in scheduled:
            seq.num_computed += n
            self._register_blocks(seq)
            if seq.num_computed == len(seq.token_ids):
                events.append(self._sample(seq, end))
                finished = finished or not seq.running
        if finished:
            self.running = [s for s in self.running if s.running]
        return StepResult(duration, events, preempted, len(scheduled), prefill_tokens)

    def _schedule(self, start: float) -> tuple[list[tuple[_Seq, int]], list[int]]:
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[int] = []
        if self.pause == "paused_all":
            return scheduled, preempted
        budget = self._schedule_running(scheduled, preempted)
        if not preempted and self.pause == "unpaused":
            self._schedule_waiting(start, budget, scheduled)
        return scheduled, preempted

    def _schedule_running(self, scheduled: list[tuple[_Seq, int]], preempted: list[int]) -> int:
        """Schedule the running requests' tokens, preempting when blocks run out; the
        step's budget left."""
        budget = self.config.max_num_batched_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self._victim()
                at = running.index(victim)
                del running[at]
                if at < i:  # scheduled in this step already: its tokens go back
                    i -= 1
                    k = next(k for k, (s, _) in enumerate(scheduled) if s is victim)
                    budget += scheduled.pop(k)[1]
                self._preempt(victim)
                preempted.append(victim.req.request_id)
                if victim is seq:
                    break
            if not seq.running:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(
        self, start: float, budget: int, scheduled: list[tuple[_Seq, int]]
    ) -> None:
        """Admit waiting requests in the queue's order while there is room."""
        running = self.running
        waiting = self.waiting
        receiving: list[_Seq] = []  # KV still in transit: skipped, keeping their places
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            seq = waiting.peek()
            if seq.remote_pending and not self._start_transfer(seq, start):
                break
            if seq.ready_at is not None and seq.ready_at > start:
                receiving.append(waiting.pop())
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            waiting.pop()
            seq.running = True
            if seq.scheduled_time is None:
                seq.scheduled_time = start
                seq.num_cached = seq.num_computed
            running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        for seq in reversed(receiving):
            waiting.prepend(seq)

    def _victim(self) -> _Seq:
        """The running request to preempt when blocks run out (see module docstring)."""
        if self._by_priority:
            return max(self.running, key=_importance)
        return self.running[-1]

    def _start_transfer(self, seq: _Seq, start: float) -> bool:
        """Allocate the prompt's blocks and start receiving its KV; False if they do not fit."""
        bs = self._bs
        total = len(seq.token_ids)
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            hits = self.pool.lookup(seq.hashes, (total - 1) // bs)
        fresh = self.pool.allocate(-(-total // bs) - len(hits))
        if fresh is None:
            self.pool.free(hits)
            return False
        if self.config.enable_prefix_caching:
            self.stats.prefix_cache_queries += total
            self.stats.prefix_cache_hits += len(hits) * bs
        seq.remote_pending = False
        seq.blocks = hits + fresh
        seq.num_registered = len(hits)
        # Every prompt token but the last arrives; the last is computed here, for its logits.
        seq.num_computed = total - 1
        transferred = total - 1 - len(hits) * bs
        seq.ready_at = start + transferred * self._per_transfer_token
        self.stats.kv_transfers += 1
        self.stats.kv_transfer_tokens += transferred
        return True

    def _admit(self, seq: _Seq, budget: int) -> int:
        """Take cached prefix blocks and allocate the rest; tokens to compute, 0 if none fit."""
        if seq.ready_at is not None:  # the prompt's KV has arrived into blocks it holds
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            return n if self._grow(seq, seq.num_computed + n) else 0
        bs = self._bs
        total = len(seq.token_ids)
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            # At least one token is always computed: its logits give the next token.
            hits = self.pool.lookup(seq.hashes, (total - 1) // bs)
        computed = len(hits) * bs
        n = min(total - computed, budget)
        fresh = self.pool.allocate(-(-(computed + n) // bs) - len(hits))
        if fresh is None:
            self.pool.free(hits)
            return 0
        if self.config.enable_prefix_caching:
            self.stats.prefix_cache_queries += total
            self.stats.prefix_cache_hits += computed
        seq.blocks = hits + fresh
        seq.num_computed = computed
        seq.num_registered = len(hits)
        return n

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        need = -(-tokens // self._bs) - len(seq.blocks)
        if need <= 0:
            return True
        fresh = self.pool.allocate(need)
        if fresh is None:
            return False
        seq.blocks.extend(fresh)
        return True

    def _preempt(self, seq: _Seq) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.running = False
        seq.ready_at = None  # recomputed locally, as vLLM does with a preempted remote prefill
        self.waiting.prepend(seq)
        self.stats.num_preemptions += 1

    def _register_blocks(self, seq: _Seq) -> None:
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed // self._bs
        pool = self.pool
        if pool.events is not None:
            self._register_recorded(seq, full)
            return
        while seq.num_registered < full:
            j = seq.num_registered
            pool.register(seq.blocks[j], seq.hashes[j])
            seq.num_registered = j + 1

    def _register_recorded(self, seq: _Seq, full: int) -> None:
        """As ``_register_blocks``, handing the pool what its events report: each block's
        parent (the previous block's chain hash) and tokens."""
        bs = self._bs
        hashes = seq.hashes
        tokens = seq.token_ids
        while seq.num_registered < full:
            j = seq.num_registered
            parent = hashes[j - 1] if j else None
            self.pool.register(seq.blocks[j], hashes[j], parent, tokens[j * bs : (j + 1) * bs])
            seq.num_registered = j + 1

    def _extend_hashes(self, seq: _Seq) -> None:
        bs = self._bs
        hashes = seq.hashes
        tokens = seq.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            j = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else 0, tokens[j * bs : (j + 1) * bs]))

    def _sample(self, seq: _Seq, end: float) -> TokenEvent:
        req = seq.req
        stats = self.stats
        index = seq.num_output
        seq.num_output = index + 1
        stats.generation_tokens += 1
        if index == 0:
            seq.first_token_time = end
            stats.prompt_tokens += len(req.prompt_ids)
            stats.ttft.observe(end - req.arrival)
        else:
            stats.itl.observe(end - seq.last_token_time)
        seq.last_token_time = end
        if seq.num_output < req.output_len:
            seq.token_ids.append(req.output.token_id(index))
            if len(seq.token_ids) % self._bs == 0:
                self._extend_hashes(seq)
            if index == 0:
                return self._first_event(seq, None)
            return TokenEvent(req.request_id, index, None)

        seq.running = False
        lent = tuple(seq.blocks) if req.remote_decode else ()
        self.pool.free(seq.blocks)
        seq.blocks = []
        del self._seqs[req.request_id]
        scheduled = seq.scheduled_time if seq.scheduled_time is not None else req.arrival
        stats.request_success[req.finish_reason] += 1
        stats.e2e.observe(end - req.arrival)
        stats.queue_time.observe(scheduled - req.arrival)
        stats.prefill_time.observe(seq.first_token_time - scheduled)
        stats.decode_time.observe(end - seq.first_token_time)
        if index == 0:
            return self._first_event(seq, lent)
        return TokenEvent(req.request_id, index, req.finish_reason, lent)

    def _first_event(self, seq: _Seq, lent: tuple[int, ...] | None) -> TokenEvent:
        """The first token's event, with the prompt's prefix-cache figures; ``lent`` is
        None unless it is also the last one."""
        req = seq.req
        written = min(seq.num_registered * self._bs, len(req.prompt_ids))
        return TokenEvent(
            req.request_id,
            0,
            None if lent is None else req.finish_reason,
            lent or (),
            cached_tokens=seq.num_cached,
            created_tokens=max(0, written - seq.num_cached),
        )


def _importance(seq: _Seq) -> tuple[int, float]:
    """vLLM's preemption key: the largest is the least important running request."""
    return seq.req.priority, seq.req.arrival

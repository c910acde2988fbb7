"""Tokenizers by model, and where each prompt is tokenized.

``load_tokenizer`` turns a spec (``"sim"`` or a path) into a tokenizer. ``Tokenizers`` holds
one per model behind an async ``tokens()``: a short prompt (``prompt_chars`` measures it) is
tokenized inline, a long one in a small, bounded thread pool, so that it does not stall the
event loop and a flood of them does not queue unbounded work. ``TokenizerStats`` counts
where each went.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from gateway.tokenizer.hf import HfTokenizer
from gateway.tokenizer.protocol import PathKind, PromptTokenizer
from gateway.tokenizer.sim import SimTokenizer

DEFAULT_INLINE_CHARS: Final = 4_000
"""Prompts up to this many characters are tokenized on the event loop (about a millisecond
at most; most prompts are far shorter and cost less than the ~50 µs hop to a thread).
Longer ones go to the pool: a 100k-character prompt takes ~50 ms, and the encoder releases
the GIL while it runs (loadtest/bench/tokenize.py has the figures)."""

_CHARS_CAP: Final = 1 << 40


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``"sim"``: the simulator's tokenizer; otherwise a model directory or a tokenizer.json.

    ``ValueError`` (shown to operators at start-up) names the path and what is missing.
    """
    if spec == "sim":
        return SimTokenizer()
    if not spec.strip():
        raise ValueError("tokenizer: empty spec (expected 'sim' or a path)")
    return HfTokenizer.from_path(spec)


def prompt_chars(path_kind: PathKind, doc: Mapping[str, Any], limit: int = _CHARS_CAP) -> int:
    """How much text tokenizing ``doc`` means, in characters (token ids and other numbers
    count one each). Counting stops once past ``limit``, so deciding where to tokenize a
    100k-id prompt costs no more than deciding for a short one. Never raises."""
    if not isinstance(doc, Mapping):
        return 0
    keys = (
        ("messages", "tools", "documents", "chat_template_kwargs")
        if path_kind == "chat"
        else ("prompt",)
    )
    total = 0
    stack: list[tuple[Any, int]] = [(doc.get(k), 0) for k in keys]
    while stack and total <= limit:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value
        if not isinstance(value, list | dict):
            items = (value,)
        for item in items:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, int | float):
                total += 1
            elif depth < 16 and isinstance(item, list | dict):
                stack.append((item, depth + 1))
            if total > limit:
                break
    return total


@dataclass(slots=True)
class TokenizerStats:
    """What ``Tokenizers.tokens`` did, for metrics: where each prompt was tokenized, and the
    ones turned away."""

    inline: int = 0
    offloaded: int = 0
    busy: int = 0  # a long prompt found the pool full: None, the caller falls back
    no_tokenizer: int = 0  # a model without a tokenizer
    failed: int = 0  # a tokenizer raised (prompt_tokens must not: a bug)


class Tokenizers:
    """One ``PromptTokenizer`` per model name, tokenizing without stalling the event loop.

    A prompt of up to ``inline_chars`` characters is tokenized inline: cheaper than a thread
    hop. A longer one goes to a thread pool of ``threads`` owned here, with at most
    ``max_pending`` prompts running or waiting; past that, ``tokens`` answers None at once
    (``stats.busy``) rather than queue work no request will wait for. ``close()`` shuts the
    pool down. ``doc`` must not be modified while ``tokens`` runs.
    """

    def __init__(
        self,
        by_model: Mapping[str, PromptTokenizer],
        *,
        inline_chars: int = DEFAULT_INLINE_CHARS,
        threads: int = 1,
        max_pending: int = 4,
    ) -> None:
        if threads < 1 or max_pending < 1:
            raise ValueError("threads and max_pending must be at least 1")
        self._by_model = dict(by_model)
        self.inline_chars = inline_chars
        self.max_pending = max_pending
        self.stats = TokenizerStats()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._lock = threading.Lock()  # guards _pending and stats.failed (pool threads)
        self._pending = 0
        self._closed = False

    @classmethod
    def load(cls, specs: Mapping[str, str], **options: Any) -> Tokenizers:
        """``{model: spec}`` through ``load_tokenizer``; the first bad spec raises ValueError."""
        return cls({model: load_tokenizer(spec) for model, spec in specs.items()}, **options)

    def get(self, model: str) -> PromptTokenizer | None:
        return self._by_model.get(model)

    @property
    def models(self) -> dict[str, PromptTokenizer]:
        return dict(self._by_model)

    async def tokens(
        self, model: str, path_kind: PathKind, doc: Mapping[str, Any]
    ) -> list[int] | None:
        """The prompt's token ids, or None (no tokenizer, not faithful, pool full, closed)."""
        tokenizer = self._by_model.get(model)
        if tokenizer is None:
            self.stats.no_tokenizer += 1
            return None
        if self._closed:
            return None
        if prompt_chars(path_kind, doc, self.inline_chars) <= self.inline_chars:
            self.stats.inline += 1
            return self._run(tokenizer, path_kind, doc)
        with self._lock:
            full = self._pending >= self.max_pending
            if not full:
                self._pending += 1
        if full:
            self.stats.busy += 1
            return None
        try:
            future: Future[list[int] | None] = self._pool.submit(
                self._run, tokenizer, path_kind, doc
            )
        except RuntimeError:  # shut down meanwhile
            self._done(None)
            return None
        # The slot is freed when the work ends or is cancelled, not when the caller stops
        # waiting: a caller that gave up does not make room while its prompt still runs.
        future.add_done_callback(self._done)
        self.stats.offloaded += 1
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # close() dropped the queued work: the caller gets None, not a cancellation of
            # its own task (which it would take for a client gone away).
            task = asyncio.current_task()
            if future.cancelled() and (task is None or task.cancelling() == 0):
                return None
            raise

    @property
    def pending(self) -> int:
        """Long prompts running or waiting in the pool."""
        return self._pending

    def _done(self, _future: Future[list[int] | None] | None) -> None:
        with self._lock:
            self._pending -= 1

    def _run(
        self, tokenizer: PromptTokenizer, path_kind: PathKind, doc: Mapping[str, Any]
    ) -> list[int] | None:
        try:
            return tokenizer.prompt_tokens(path_kind, doc)
        except Exception:
            with self._lock:
                self.stats.failed += 1
            return None

    def close(self) -> None:
        """Stop the pool: queued prompts are dropped (their callers get None), running ones
        finish in their thread."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

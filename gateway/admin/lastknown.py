"""The admin API's fleet views (replicas, changes, rollouts, keys, usage) answered from the last
state known when Redis does not answer, marked stale with its age, rather than failing.

A view's read is bounded (``timeout``): a paused Redis costs an operator one short wait per
call, not the client's socket timeout. A failed read answers the last document that view got
(per name: the same view with other parameters is another name), or the view's own fallback
(what this replica knows without Redis), with ``"stale": {"age_s": ..., "why": ...}``. One log
line when the views start answering stale (``admin_views_stale``) and one when every view that
did answers fresh again (``admin_views_fresh``): never one per call, nor one per view.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog
from aiohttp import web
from redis.exceptions import RedisError

log = structlog.get_logger("gateway.admin.api")

_FAILURES: Final = (RedisError, OSError, TimeoutError)
_KEPT: Final = 64  # views remembered (a name per view and its parameters)
_FORGET_S: Final = 120.0  # a view stale this long ago and not read since ends no outage

ViewDoc = dict[str, Any]


class ViewUnavailable(Exception):
    """A view's read reached nothing it can answer with (its store said so without raising)."""


class LastKnown:
    def __init__(self, timeout: float, *, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self._docs: OrderedDict[str, tuple[float, ViewDoc]] = OrderedDict()
        self.failing: str | None = None  # why the views answer stale, while they do
        self._stale: dict[str, float] = {}  # the views answering stale, since when

    async def read(
        self,
        name: str,
        fetch: Callable[[], Awaitable[ViewDoc]],
        fallback: Callable[[], ViewDoc],
    ) -> ViewDoc:
        """``fetch``'s document, kept as ``name``'s last; if it fails (or takes longer than
        ``timeout``), the last one kept, else ``fallback``'s, marked stale."""
        try:
            doc = await asyncio.wait_for(fetch(), self.timeout)
        except (*_FAILURES, ViewUnavailable) as exc:
            return self._answer_stale(name, fallback, str(exc) or type(exc).__name__)
        now = self._clock()
        self._docs[name] = (now, doc)
        self._docs.move_to_end(name)
        while len(self._docs) > _KEPT:
            self._docs.popitem(last=False)
        self._stale.pop(name, None)
        self._stale = {n: at for n, at in self._stale.items() if now - at < _FORGET_S}
        if self.failing is not None and not self._stale:
            log.info("admin_views_fresh", after=self.failing)
            self.failing = None
        return doc

    def note_failure(self, why: str) -> None:
        """Redis failed an admin call: said once until a view reads it again."""
        if self.failing is None:
            log.warning(
                "admin_views_stale",
                error=why,
                effect="the fleet's views answer from the last state known until Redis answers",
            )
            self.failing = why

    def _answer_stale(self, name: str, fallback: Callable[[], ViewDoc], why: str) -> ViewDoc:
        self._stale.setdefault(name, self._clock())
        self.note_failure(why)
        kept = self._docs.get(name)
        if kept is None:
            return {**fallback(), "stale": {"age_s": None, "why": why}}
        at, doc = kept
        return {**doc, "stale": {"age_s": round(max(0.0, self._clock() - at), 3), "why": why}}


VIEWS: Final = web.AppKey("views", LastKnown)

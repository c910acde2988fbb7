"""Turns a model name into a lease on one backend: candidates from the pool, choice by policy."""

from __future__ import annotations

from collections.abc import Collection

from backends.errors import NoBackendAvailable
from backends.pool import BackendPool, Lease
from policies import BackendSnapshot, Policy, RouteFacts


class Router:
    def __init__(self, pool: BackendPool, policy: Policy, *, retry_after: int = 1) -> None:
        self.pool = pool
        self.policy = policy  # swapped whole, never mutated, when ops change it live
        self._retry_after = retry_after

    def pick(
        self,
        facts: RouteFacts,
        exclude: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> tuple[Lease, list[BackendSnapshot]]:
        """Lease the policy's choice among routable backends not in ``exclude``.

        ``only`` restricts the candidates to a model pool's backends. Also returns the
        candidates it chose among (for logs and metrics).
        """
        candidates = self.pool.candidates(facts.model, exclude, only=only)
        choice = self.policy.choose(facts, candidates)
        if choice is None:
            raise NoBackendAvailable(
                f"No backend can take a request for `{facts.model}` right now.",
                retry_after=self._retry_after,
            )
        return self.pool.acquire(choice.id), candidates

"""Backends as functions on the in-memory transport (``backends.upstream.mock``), and a policy
that always picks the first untried backend, so a test knows where the attempt loop goes next."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from backends.upstream.mock import MockRequest, MockResponse
from policies import BackendSnapshot, Decision, Needs, Outcome, RouteFacts, Weights
from policies.least_load import LeastLoad

Answer = Callable[[MockRequest], Awaitable[MockResponse]]


def chunk(doc: dict[str, Any]) -> bytes:
    """One SSE event carrying ``doc``."""
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


@dataclass
class Fleet:
    """``answers[backend]`` answers its POSTs (a function, or one ``MockResponse`` for all);
    GETs (health, models, metrics) are answered as an idle vLLM would."""

    answers: dict[str, Answer | MockResponse] = field(default_factory=dict)

    async def __call__(self, request: MockRequest) -> MockResponse:
        if request.method == "GET":
            if request.path == "/v1/models":
                return MockResponse.json({"object": "list", "data": [{"id": "m"}]})
            if request.path == "/metrics":
                return MockResponse(200, b"", {"Content-Type": "text/plain"})
            return MockResponse(200)
        answer = self.answers[request.backend.id]
        return answer if isinstance(answer, MockResponse) else await answer(request)


@dataclass
class InOrder:
    """Picks the first untried backend in the configured order, and writes down every
    outcome it is told."""

    inner: LeastLoad = field(default_factory=LeastLoad)
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)
    name: str = "in_order"

    @property
    def needs(self) -> Needs:
        return self.inner.needs

    @property
    def weights(self) -> Weights | None:
        return self.inner.weights

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        return Decision(candidates[0]) if candidates else None

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        self.outcomes.append((decision.backend.id, outcome))

"""Routes: which backends may serve each step of a request, and which policy picks among them.

``Router.route`` decides a request's route once, from its model: one ``Step`` for a model served
whole (by any backend, or by the backends of the model pool its alias chose), or two, prefill then
decode, for a model served by prefill and decode pools (``gateway.request.disagg``). Each step
carries its policy, what that policy offers beyond the contract (its ``Capabilities``, found once
when the policy is set, not per request) and the facts it asked for; ``Router.pick`` leases the
policy's choice among the step's candidates. The request path runs every step through the same
attempt loop (``gateway.request.attempt``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from backends.errors import GatewayError, NoBackendAvailable
from backends.pool import BackendPool, Lease
from gateway.request.rollout import Choice
from policies import BackendSnapshot, Decision, Policy, RouteFacts
from policies.capabilities import Capabilities
from policies.facts import route_facts

StepName = Literal["serve", "prefill", "decode"]
# Endpoints whose generation is split into prefill and decode (None: a caller that names none);
# any other (embeddings, audio...) goes to one backend of the model, a decode one where split.
_DISAGGREGATED: Final = frozenset({None, "chat", "completions"})


@dataclass(frozen=True, slots=True)
class Step:
    """One leg of a request: a policy choosing among some of the backends of a model."""

    name: StepName
    policy: Policy
    facts: RouteFacts
    caps: Capabilities  # the policy's
    role: Literal["prefill", "decode"] | None = None  # None: any backend but prefill-only ones
    only: frozenset[str] | None = None  # a model pool's backends (``gateway.request.rollout``)
    # the endpoint asked (``gateway.request.endpoints``): not to backends known to lack it
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """The steps of one request: ``serve`` answers it; ``prefill`` (if any) runs first."""

    serve: Step
    prefill: Step | None = None


class Router:
    def __init__(
        self,
        pool: BackendPool,
        policy: Policy,
        *,
        prefill: Policy,
        decode: Policy,
        retry_after: int = 1,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self._prefill = prefill
        self._prefill_caps = Capabilities.of(prefill)
        self._decode = decode
        self._decode_caps = Capabilities.of(decode)
        self._retry_after = retry_after

    @property
    def policy(self) -> Policy:
        """The policy of requests served whole."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        # Swapped whole, never mutated, when ops change it live: what it offers is found here.
        self._policy = policy
        self._caps = Capabilities.of(policy)

    @property
    def capabilities(self) -> Capabilities:
        """What ``policy`` offers beyond the contract."""
        return self._caps

    @property
    def prefill_policy(self) -> Policy:
        return self._prefill

    @property
    def decode_policy(self) -> Policy:
        return self._decode

    def disaggregated(self, model: str) -> bool:
        """Whether ``model`` has both a prefill and a decode pool (healthy or not)."""
        roles = self.pool.roles(model)
        return "prefill" in roles and "decode" in roles

    @property
    def wants_tokens(self) -> bool:
        """Whether a policy in use routes on the prompt's token ids (``Needs.tokens``)."""
        return self._policy.needs.tokens or self._prefill.needs.tokens or self._decode.needs.tokens

    def route(
        self,
        model: str,
        doc: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        choice: Choice | None = None,
        tokens: Sequence[int] | None = None,
        objective: str | None = None,
        endpoint: str | None = None,
        pin: str | None = None,
    ) -> Route:
        """The route of a request for ``model`` (the served name; ``choice``: an alias's pool).

        ``tokens``: the prompt's token ids, for a policy that asked for them (``wants_tokens``);
        ``objective``: what the caller wants fastest (its key tier's), for
        ``predicted_latency``; ``pin``: the only backend the request may go to (the one
        holding the stored response it continues). Every step's facts carry the prompt's
        size, which the latency tracker learns from whatever the policy.
        """

        def step(name: StepName, policy: Policy, caps: Capabilities, **where: Any) -> Step:
            facts = route_facts(
                policy.needs, model, doc, headers, tokens, objective=objective, size=True
            )
            return Step(name, policy, facts, caps, endpoint=endpoint, **where)

        policy, caps = self._policy, self._caps
        if pin is not None:  # the one backend that holds what the request builds on
            return Route(step("serve", policy, caps, only=frozenset({pin})))
        if choice is not None:
            return Route(step("serve", policy, caps, only=choice.pool.backends))
        if self.disaggregated(model) and endpoint in _DISAGGREGATED:
            return Route(
                serve=step("decode", self._decode, self._decode_caps, role="decode"),
                prefill=step("prefill", self._prefill, self._prefill_caps, role="prefill"),
            )
        return Route(step("serve", policy, caps))

    def check(self, step: Step, exclude: Collection[str] = ()) -> None:
        """Raise as ``pick`` would if no backend can take ``step`` now (nothing is leased)."""
        self.pool.candidates(
            step.facts.model, exclude, role=step.role, only=step.only, endpoint=step.endpoint
        )

    def others(self, step: Step, backend: str) -> list[BackendSnapshot]:
        """The backends other than ``backend`` that could take ``step`` now, as snapshots."""
        try:
            return self.pool.candidates(
                step.facts.model, (backend,), role=step.role, only=step.only, endpoint=step.endpoint
            )
        except GatewayError:
            return []

    def pick(
        self, step: Step, exclude: Collection[str] = ()
    ) -> tuple[Lease, list[BackendSnapshot], Decision]:
        """Lease the step policy's choice among its candidates not in ``exclude``.

        Also returns the candidates it chose among (for logs, metrics, and whether another
        backend is left to try) and the policy's decision (the chosen one's snapshot, the load
        it was chosen under; what the policy believed of it), which its outcome settles.
        """
        facts = step.facts
        candidates = self.pool.candidates(
            facts.model, exclude, role=step.role, only=step.only, endpoint=step.endpoint
        )
        decision = step.policy.choose(facts, candidates)
        if decision is None:
            where = f"{step.role} backend" if step.role else "backend"
            raise NoBackendAvailable(
                f"No {where} can take a request for `{facts.model}` right now.",
                retry_after=self._retry_after,
            )
        return self.pool.acquire(decision.backend.id), candidates, decision

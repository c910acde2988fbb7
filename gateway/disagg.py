"""Disaggregated prefill/decode: one request in two steps, as vLLM's KV connectors expect.

A model served by backends with role ``prefill`` and backends with role ``decode`` (settings
``backends[].role``) is answered like this (vLLM's
``examples/online_serving/disaggregated_serving/toy_proxy_server.py``, NIXL connector):

1. **prefill**: the request, with ``max_tokens`` (and ``max_completion_tokens``) 1, not
   streamed, and ``kv_transfer_params`` asking for a remote decode, goes to a backend of the
   prefill pool, chosen by that pool's own policy. Its JSON answer carries the
   ``kv_transfer_params`` that locate the prompt's KV (engine id, block ids, host, port).
2. **decode**: the original request plus those parameters goes to a backend of the decode
   pool, which pulls the KV instead of computing the prompt; its answer reaches the client
   through the normal path (``proxy._route`` / ``_attempt`` / the relay), so streaming,
   usage, cancellation and failover before the first byte work as for any request.

Either step that fails before the client has received anything is tried again on another
backend of the same pool, within the retry policy's bounds, or ends in OpenAI's error shape.
A prefill answered 4xx (the request itself is wrong, e.g. too long) is passed on as is.
A client that goes away cancels the handler and so whichever step is running: the prefill's
upstream response is closed unread (vLLM aborts it), the decode's as for any stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import replace
from typing import Any, Final, Protocol

import structlog
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.trace import Span, set_span_in_context

from backends.errors import NoBackendAvailable, UpstreamError, UpstreamProtocolError
from backends.pool import BackendPool, Lease
from backends.state import BackendSpec
from backends.upstream import json_or_none
from gateway.headers import downstream_headers
from gateway.keys import METRICS, RETRY, TRACER, UPSTREAM
from gateway.record import RequestRecord
from gateway.retry import RETRYABLE_STATUS
from gateway.settings import RolePoolSettings, Settings
from gateway.tracing import attempt_span, end_attempt, inject
from policies import (
    AffinityConfig,
    BackendSnapshot,
    Policy,
    PrefixHasher,
    RouteFacts,
    Weights,
    make_policy,
)

log = structlog.get_logger("gateway.disagg")
_rng = random.Random()

# What the prefill request asks of the prefill instance (vLLM's toy proxy sends exactly this).
PREFILL_KV_PARAMS: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Picker(Protocol):
    """Leases a backend for ``facts`` among those not in ``exclude`` (``Router.pick``'s shape)."""

    def __call__(
        self, facts: RouteFacts, exclude: Collection[str] = ()
    ) -> tuple[Lease, list[BackendSnapshot]]: ...


class StepCall(Protocol):
    """What the request path knows of the request (``proxy._Call``)."""

    @property
    def request(self) -> web.Request: ...
    @property
    def path(self) -> str: ...
    @property
    def body(self) -> bytes: ...
    @property
    def headers(self) -> CIMultiDict[str]: ...
    @property
    def record(self) -> RequestRecord: ...
    @property
    def extra_headers(self) -> dict[str, str] | None: ...


# The decode step: the normal route over a body, with these facts and this picker.
Decode = Callable[[bytes, RouteFacts, Picker], Awaitable[web.StreamResponse]]


def prefill_body(doc: Mapping[str, Any]) -> bytes:
    """The prefill step's request: one token, no stream, KV kept for a remote decode."""
    body = dict(doc)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("min_tokens", None)  # above max_tokens it would be a 400
    body.pop("stream_options", None)  # refused without stream
    body["stream"] = False
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return json.dumps(body, separators=(",", ":")).encode()


def decode_body(doc: Mapping[str, Any], raw: bytes, kv: dict[str, Any] | None) -> bytes:
    """The decode step's request: the original one, with the prefill's parameters if any.

    Without parameters (a prefill instance that has no KV connector) the decode instance
    computes the prompt itself, as vLLM's toy proxy lets it.
    """
    if not kv:
        return raw
    return json.dumps({**doc, "kv_transfer_params": kv}, separators=(",", ":")).encode()


def facts_for(
    policy: Policy, facts: RouteFacts, doc: Mapping[str, Any], headers: Mapping[str, str]
) -> RouteFacts:
    """``facts`` with what ``policy`` needs (prefix hashes, session) if it needs more."""
    hasher = getattr(policy, "prefix_hasher", None)
    if isinstance(hasher, PrefixHasher):
        keyed = getattr(policy, "prefix_keyed", False) is True
        hashes, key = hasher.facts(facts.model, dict(doc), keyed=keyed)
        facts = replace(facts, prefix_hashes=hashes, prefix_key=key)
    header = getattr(policy, "session_header", None)
    if isinstance(header, str):
        facts = replace(facts, session_key=headers.get(header))
    return facts


class Disagg:
    """The role pools, each with its own policy, and the two-step flow."""

    def __init__(self, pool: BackendPool, prefill: Policy, decode: Policy) -> None:
        self.pool = pool
        self.prefill_policy = prefill
        self.decode_policy = decode

    @classmethod
    def from_settings(cls, settings: Settings, pool: BackendPool) -> Disagg:
        affinity = AffinityConfig(**settings.affinity.model_dump())

        def policy(s: RolePoolSettings) -> Policy:
            w = s.weights
            return make_policy(
                s.policy, Weights(active=w.active, queue=w.queue, kv=w.kv), affinity=affinity
            )

        return cls(pool, policy(settings.disagg.prefill), policy(settings.disagg.decode))

    def serves(self, model: str) -> bool:
        """Whether ``model`` has both a prefill and a decode pool (healthy or not)."""
        roles = self.pool.roles(model)
        return "prefill" in roles and "decode" in roles

    def _pick(
        self, role: str, policy: Policy, facts: RouteFacts, exclude: Collection[str]
    ) -> tuple[Lease, list[BackendSnapshot]]:
        candidates = self.pool.candidates(facts.model, exclude, role=role)
        choice = policy.choose(facts, candidates)
        if choice is None:
            raise NoBackendAvailable(
                f"No {role} backend can take a request for `{facts.model}` right now.",
                retry_after=1,
            )
        return self.pool.acquire(choice.id), candidates

    def pick_prefill(
        self, facts: RouteFacts, exclude: Collection[str] = ()
    ) -> tuple[Lease, list[BackendSnapshot]]:
        return self._pick("prefill", self.prefill_policy, facts, exclude)

    def pick_decode(
        self, facts: RouteFacts, exclude: Collection[str] = ()
    ) -> tuple[Lease, list[BackendSnapshot]]:
        return self._pick("decode", self.decode_policy, facts, exclude)

    async def route(
        self, call: StepCall, facts: RouteFacts, span: Span | None, decode: Decode
    ) -> web.StreamResponse:
        """Prefill on the prefill pool, then ``decode`` on the decode pool."""
        app, record = call.request.app, call.record
        metrics = app[METRICS]
        self.pool.candidates(facts.model, role="decode")  # no decode backend: fail before prefill
        doc = json.loads(call.body)  # already validated as a JSON object by the proxy
        headers = call.request.headers
        prefill_facts = facts_for(self.prefill_policy, facts, doc, headers)
        outcome = await self._prefill(call, doc, prefill_facts, span)
        if isinstance(outcome, web.StreamResponse):
            return outcome
        answered = time.monotonic()
        body = decode_body(doc, call.body, outcome)
        decode_facts = facts_for(self.decode_policy, facts, doc, headers)
        sent = time.monotonic()
        metrics.disagg_handoff.labels(facts.model).observe(sent - answered)
        try:
            return await decode(body, decode_facts, self.pick_decode)
        finally:
            if record.first_token_at is not None:
                metrics.disagg_decode_ttft.labels(facts.model, record.backend).observe(
                    record.first_token_at - sent
                )

    async def _prefill(
        self, call: StepCall, doc: dict[str, Any], facts: RouteFacts, span: Span | None
    ) -> dict[str, Any] | web.StreamResponse | None:
        """The prefill step with its retries: the KV parameters, or a 4xx to pass on."""
        app, record = call.request.app, call.record
        retry = app[RETRY]
        body = prefill_body(doc)
        tried: list[str] = []
        last_error: UpstreamError | None = None
        while True:
            try:
                lease, _ = self.pick_prefill(facts, exclude=tried)
            except NoBackendAvailable:
                if last_error is not None:
                    raise last_error from None
                raise
            tried.append(lease.backend.id)
            try:
                return await _prefill_attempt(call, body, lease, len(tried), span)
            except UpstreamError as exc:
                last_error = exc
                app[METRICS].disagg_failures.labels(
                    "prefill", lease.backend.id, type(exc).__name__
                ).inc()
                wait = retry.next_wait(len(tried), time.monotonic() - record.started, _rng)
                if wait is None:
                    raise
                log.info(
                    "disagg_prefill_retry",
                    request_id=record.request_id,
                    backend=lease.backend.id,
                    error=exc.message,
                    wait_ms=round(wait * 1e3, 1),
                )
                await asyncio.sleep(wait)
            finally:
                lease.release()


DISAGG: Final = web.AppKey("disagg", Disagg)


async def _prefill_attempt(
    call: StepCall, body: bytes, lease: Lease, n: int, parent: Span | None
) -> dict[str, Any] | web.StreamResponse | None:
    """One prefill backend's try; raises ``UpstreamError`` for what another may do better."""
    app, record = call.request.app, call.record
    backend = lease.backend
    headers, span = call.headers, None
    if parent is not None:
        span = attempt_span(app[TRACER], parent, backend.id, n)
        span.set_attribute("llm_gateway.disagg_step", "prefill")
        headers = CIMultiDict(headers)
        inject(headers, set_span_in_context(span))
    started = time.monotonic()
    status, error = 0, None
    try:
        status, resp_headers, raw = await _fetch(call, backend.spec, body, headers)
        if status >= 500 or status in RETRYABLE_STATUS:
            raise UpstreamError(f"backend {backend.id}: the prefill step answered {status}")
        answer = json_or_none(raw) if status == 200 else None
        if status == 200 and not isinstance(answer, dict):
            raise UpstreamProtocolError(f"backend {backend.id}: the prefill answer is not JSON")
    except UpstreamError as exc:
        if status != 429:  # busy is not broken; anything else counts against the circuit
            lease.failed()
        error = exc
        raise
    except asyncio.CancelledError:
        record.abort_reason = "client_disconnect"
        raise
    finally:
        end_attempt(span, status, error)
    lease.succeeded()
    if not isinstance(answer, dict):  # a 4xx: the request itself was refused, pass it on
        record.status, record.ending = status, "complete"
        if call.extra_headers:
            resp_headers.update(call.extra_headers)
        return web.Response(status=status, body=raw, headers=resp_headers)
    elapsed = time.monotonic() - started
    app[METRICS].disagg_prefill.labels(record.model, backend.id).observe(elapsed)
    if parent is not None:
        parent.set_attribute("llm_gateway.prefill_backend", backend.id)
        parent.set_attribute("llm_gateway.prefill_s", elapsed)
    kv = answer.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv:
        log.warning("disagg_no_kv_transfer_params", backend=backend.id, model=record.model)
        return None
    return kv


async def _fetch(
    call: StepCall, spec: BackendSpec, body: bytes, headers: CIMultiDict[str]
) -> tuple[int, CIMultiDict[str], bytes]:
    """POST the prefill request and read the whole answer; closed unread if cancelled."""
    client = call.request.app[UPSTREAM]
    upstream = await client.open(spec, call.path, body, headers)
    call.record.sent = True
    complete = False
    try:
        raw = await client.read_body(upstream)
        complete = True
    finally:
        client.finish(upstream, complete=complete)  # unread: closed, and vLLM aborts
    resp = upstream.response
    return resp.status, downstream_headers(resp.headers, call.record.request_id), raw

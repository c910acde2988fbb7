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
   as any answer does, so streaming, usage, cancellation and failover before the first byte
   work as for any request.

Both are steps of the request's route (``gateway.request.router``) and run the request path's
one attempt loop (``gateway.request.attempt``): a step that fails before the client has received
anything is tried again on another backend of the same pool, within the retry policy's bounds, or
ends in OpenAI's error shape. A prefill answered 4xx (the request itself is wrong, e.g. too
long) is passed on as is. A client that goes away cancels the handler and so whichever step
is running: the prefill's upstream response is closed unread (vLLM aborts it), the decode's
as for any stream. This module holds what is particular to the two steps: their bodies, the
prefill attempt, and the pools' policies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import structlog

from backends.errors import BackendRefused, UpstreamError, UpstreamProtocolError
from backends.upstream.client import json_or_none
from gateway.config.policies import build_policy, weights_of
from gateway.config.routing import RolePoolSettings
from gateway.config.settings import Settings
from gateway.http import Response
from gateway.request.call import Answered, Try
from gateway.request.headers import downstream_headers
from gateway.request.record import Ending
from gateway.request.retry import RETRYABLE_STATUS
from gateway.request.send import open_upstream
from policies import KvIndex, LatencyTracker, Policy

log = structlog.get_logger("gateway.request.disagg")

# What the prefill request asks of the prefill instance (vLLM's toy proxy sends exactly this).
PREFILL_KV_PARAMS: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def role_policies(
    settings: Settings, kv_index: KvIndex, tracker: LatencyTracker
) -> tuple[Policy, Policy]:
    """The prefill pool's policy and the decode pool's, from ``[disagg]``."""

    def policy(s: RolePoolSettings) -> Policy:
        return build_policy(settings, s.policy, weights_of(s.weights), kv_index, tracker)

    return policy(settings.disagg.prefill), policy(settings.disagg.decode)


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


async def prefill_attempt(t: Try, body: bytes) -> dict[str, Any] | Answered | None:
    """One prefill backend's try: the KV parameters (None without a connector), or the
    backend's 4xx to pass on; raises ``UpstreamError`` for what another may do better."""
    call = t.call
    svc, record = call.svc, call.record
    client = svc.upstream
    backend = t.lease.backend.id
    upstream = await open_upstream(t, body)
    complete = False
    try:
        raw = await client.read_body(upstream)  # closed unread if cancelled: vLLM aborts
        complete = True
    finally:
        client.finish(upstream, complete=complete)
    status = upstream.status
    if status in RETRYABLE_STATUS:
        retry_after = upstream.headers.get("Retry-After")
        raise BackendRefused(backend, status, raw, retry_after=retry_after)
    if status >= 500:
        raise UpstreamError(f"backend {backend}: the prefill step answered {status}")
    answer = json_or_none(raw) if status == 200 else None
    if status == 200 and not isinstance(answer, dict):
        raise UpstreamProtocolError(f"backend {backend}: the prefill answer is not JSON")
    t.tally.answered = True
    if not isinstance(answer, dict):  # a 4xx: the request itself was refused, pass it on
        record.status = status
        headers = downstream_headers(upstream.headers, record.request_id)
        if call.extra_headers:
            headers.update(call.extra_headers)
        return Answered(Response(status=status, body=raw, headers=headers), Ending.COMPLETE)
    elapsed = t.tally.outcome().duration_s
    svc.metrics.disagg_prefill.labels(record.model, backend).observe(elapsed)
    if t.parent is not None:
        t.parent.set_attribute("llm_gateway.prefill_backend", backend)
        t.parent.set_attribute("llm_gateway.prefill_s", elapsed)
    kv = answer.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv:
        log.warning("disagg_no_kv_transfer_params", backend=backend, model=record.model)
        return None
    return kv

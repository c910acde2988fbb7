"""The gateway's one exception tree; one middleware maps it to OpenAI's error envelope (or
Anthropic's, on ``/v1/messages``: ``GatewayError.shaped``).

It lives in the lowest layer that raises any of it (``backends``: the pool and the upstream
client), so every layer above imports it and no arrow points back up. Every error the gateway
answers a client with is here:

    GatewayError                      500 internal_error
    ├── InvalidRequest                400 invalid_request_error
    │   ├── BodyTooLarge              413 invalid_request_error / request_too_large
    │   ├── BodyTimeout               408 invalid_request_error (body not received in time)
    │   └── IdempotencyKeyReused      422 invalid_request_error / idempotency_key_reused (an
    │                                     admin call repeats a key with another request)
    ├── AuthenticationError           401 authentication_error / invalid_api_key
    ├── NotFound                      404 not_found_error (an admin object: backend, alias, pool)
    ├── ModelNotFound                 404 invalid_request_error / model_not_found
    ├── EndpointNotServed             404 invalid_request_error / endpoint_not_served (every
    │                                     backend of the model lacks the endpoint)
    ├── ResponseNotFound              404 invalid_request_error / response_not_found (a stored
    │   │                                 response no backend is known to hold)
    │   └── ResponseBackendGone           / response_backend_gone (its backend left the fleet)
    ├── RateLimited                   429 requests|tokens / rate_limit_exceeded
    │                                     (+ Retry-After, x-ratelimit-*)
    ├── BudgetExceeded                429 insufficient_quota / budget_exceeded (a key's daily or
    │                                     monthly tokens spent; Retry-After: until it resets)
    ├── ShuttingDown                  503 service_unavailable (connection closed after it)
    ├── Unavailable                   503 service_unavailable (+ Retry-After)
    │   ├── NoBackendAvailable            / no_backend_available
    │   ├── LimitsUnavailable             / limits_unavailable (limit store down, fail-closed)
    │   ├── FleetLogUnavailable           / fleet_log_unavailable (an admin change refused:
    │   │   │                                 the fleet's change log, on Redis, is unreachable;
    │   │   │                                 certainly not written)
    │   │   └── FleetLogLost                  / fleet_log_lost (the log was lost or rewound and
    │   │                                     is being healed: no change goes in meanwhile)
    │   └── AdmissionRejected
    │       ├── QueueFull                 / queue_full (admission queue at its bound)
    │       └── QueueTimeout              / queue_timeout (waited the maximum time)
    └── UpstreamError                 an upstream attempt failed before a response was relayed
        ├── UpstreamUnreachable       502 bad_gateway (connect error, reset, closed early)
        │   └── BackendDown           502 bad_gateway (its probes marked it down meanwhile)
        ├── UpstreamProtocolError     502 bad_gateway (the backend answered nonsense)
        ├── UpstreamTimeout           504 gateway_timeout (no byte within the idle timeout)
        │   └── BackendStalled        504 gateway_timeout (none of its streams moved)
        ├── EngineFailed              502 bad_gateway (an error event, or an abort, mid-stream)
        ├── BackendLacksEndpoint      404 (as EndpointNotServed) the backend has no such route:
        │                                 another backend of the model is tried
        └── BackendRefused            the backend's own 429/502/503/504 answer, passed on as
                                      it came (+ Retry-After) when no other backend could help

Each carries the envelope fields, so the middleware needs no knowledge of the cases. Pure
modules raise their own ``ValueError`` subclasses (``WeightsError``, ``FaultsError``,
``PlanError``, ``ScenarioError``, ``MetricsFormatError``), which never reach a client as
such: where a client's input caused one, it is re-raised as ``InvalidRequest``.

The HTTP server refuses malformed or oversized HTTP itself, before any handler
(``gateway.http.refusal``), in the same envelope, ``invalid_request_error`` with the code its
status names: 400 ``malformed_http_request``, 408 ``request_timeout`` (the head too slow),
414 ``uri_too_long``, 417 ``expectation_failed``, 431 ``request_header_fields_too_large``,
505 ``http_version_not_supported``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class GatewayError(Exception):
    status: int = 500  # an instance may carry its own (BackendRefused)
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.type, param=self.param, code=self.code)

    def shaped(self, dialect: str) -> dict[str, Any]:
        """The error body in the shape of the API the client called (``"openai"`` or
        ``"anthropic"``, ``gateway.request.endpoints.Dialect``)."""
        if dialect == "anthropic":
            return anthropic_envelope(self.status, self.message)
        return self.envelope()


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413
    default_code = "request_too_large"


class BodyTimeout(InvalidRequest):
    status = 408
    default_code = "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class IdempotencyKeyReused(InvalidRequest):
    status = 422
    default_code = "idempotency_key_reused"


class AuthenticationError(GatewayError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class RateLimited(GatewayError):
    """429; ``limit_type`` ("requests" or "tokens") is the envelope's type, as OpenAI sends it."""

    status = 429
    type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, limit_type: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, headers=headers)
        self.limit_type = limit_type

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.limit_type, param=self.param, code=self.code)


class BudgetExceeded(GatewayError):
    """429: the caller's token budget for the day or month is spent; in OpenAI's shape as a
    spent quota (type ``insufficient_quota``), code ``budget_exceeded``, and ``Retry-After``
    until it resets."""

    status = 429
    type = "insufficient_quota"
    default_code = "budget_exceeded"


class NotFound(GatewayError):
    """An object of the admin API (backend, alias, pool) that does not exist."""

    status = 404
    type = "not_found_error"


class Conflict(GatewayError):
    """409: an admin change that cannot follow the state it would change (a rollout already
    under way, a step that is not the next one)."""

    status = 409
    type = "conflict_error"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class EndpointNotServed(GatewayError):
    """Every backend serving the model lacks the endpoint (generation against pooling)."""

    status = 404
    type = "invalid_request_error"
    default_code = "endpoint_not_served"


class ResponseNotFound(GatewayError):
    """A Responses API id (``previous_response_id``, ``GET /v1/responses/{id}``) that no
    backend is known to hold."""

    status = 404
    type = "invalid_request_error"
    default_code = "response_not_found"


class ResponseBackendGone(ResponseNotFound):
    """The response was stored by a backend that is no longer in the fleet: it is lost."""

    default_code = "response_backend_gone"


class Unavailable(GatewayError):
    """503: the gateway cannot take the request now; ``Retry-After`` says when to come back."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class NoBackendAvailable(Unavailable):
    default_code = "no_backend_available"


class LimitsUnavailable(Unavailable):
    default_code = "limits_unavailable"


class FleetLogUnavailable(Unavailable):
    default_code = "fleet_log_unavailable"


class FleetLogLost(FleetLogUnavailable):
    default_code = "fleet_log_lost"


class AdmissionRejected(Unavailable):
    pass


class QueueFull(AdmissionRejected):
    default_code = "queue_full"


class QueueTimeout(AdmissionRejected):
    default_code = "queue_timeout"


class Shed(GatewayError):
    """429: the fleet is overloaded and this request's priority is among the lowest waiting
    (``gateway.limits.admission``); ``Retry-After`` says when the queue ahead of it will have
    drained."""

    status = 429
    type = "requests"
    default_code = "shed_by_priority"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ShuttingDown(GatewayError):
    status = 503
    type = "service_unavailable"
    default_code = "shutting_down"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close", "Retry-After": "1"})


class UpstreamError(GatewayError):
    status = 502
    type = "bad_gateway"


class UpstreamUnreachable(UpstreamError):
    default_code = "backend_unreachable"


class BackendDown(UpstreamUnreachable):
    """The request was waiting for its backend's answer when the probes marked it down."""

    default_code = "backend_down"


class FirstTokenLate(UpstreamError):
    """No first token came by the deadline the policy set (``predicted_latency``'s rescue):
    the request, of which nothing reached the client yet, is sent to another backend."""

    status = 504
    type = "gateway_timeout"
    default_code = "first_token_late"


class UpstreamProtocolError(UpstreamError):
    default_code = "backend_protocol_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "gateway_timeout"
    default_code = "backend_timeout"


class BackendStalled(UpstreamTimeout):
    """Every stream on the backend stopped moving: it was taken out of rotation."""

    default_code = "backend_stalled"


class EngineFailed(UpstreamError):
    """The engine said, inside a stream that had begun, that it could not go on."""

    default_code = "backend_engine_error"


class BackendLacksEndpoint(UpstreamError):
    """The backend answered the endpoint with "no such route" (FastAPI's 404): it is the
    other kind of vLLM server. Another backend of the model is tried; if none is left, the
    client is told as ``EndpointNotServed`` would tell it."""

    status = 404
    type = "invalid_request_error"
    default_code = "endpoint_not_served"


class BackendRefused(UpstreamError):
    """A backend answered "not now" (429, 502, 503, 504) before sending anything else.

    Another backend is tried while one is left; when none is, this answer is passed on to the
    client as the backend gave it (its status and error body), with a ``Retry-After``.
    """

    def __init__(self, backend: str, status: int, body: bytes, *, retry_after: str | None) -> None:
        super().__init__(
            f"backend {backend} answered {status}", headers={"Retry-After": retry_after or "1"}
        )
        self.status = status
        self.body = body

    def envelope(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.body)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return doc  # vLLM's own envelope
        kind = "rate_limit_exceeded" if self.status == 429 else "service_unavailable"
        return error_envelope(self.message, kind, code=self.status)

    def shaped(self, dialect: str) -> dict[str, Any]:
        if dialect != "anthropic":
            return self.envelope()
        return as_anthropic(self.status, self.body, self.message)


def error_envelope(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error types by status (its API's documented pairs; 503 is its "overloaded").
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic(status: int, body: bytes, fallback: str = "") -> dict[str, Any]:
    """A backend's error answer in Anthropic's shape: as it came if it is in that shape
    already (vLLM's Messages routes), else its OpenAI envelope's message (vLLM checks a body
    before the route runs, and answers that in OpenAI's shape), else ``fallback``."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error" and isinstance(doc.get("error"), dict):
        return doc
    inner = doc.get("error") if isinstance(doc, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    if not isinstance(message, str) and isinstance(doc, dict):
        detail = doc.get("detail")  # FastAPI's own answers
        message = detail if isinstance(detail, str) else None
    if not isinstance(message, str):
        message = fallback or body[:500].decode(errors="replace")
    return anthropic_envelope(status, message)

"""The gateway's exception tree; one middleware maps it to OpenAI's error envelope.

    GatewayError                      500 internal_error
    ├── InvalidRequest                400 invalid_request_error
    │   └── BodyTooLarge              413 invalid_request_error
    ├── ModelNotFound                 404 invalid_request_error / model_not_found
    ├── NoBackendAvailable            503 service_unavailable (+ Retry-After)
    └── UpstreamError                 an upstream attempt failed before a response was relayed
        ├── UpstreamUnreachable       502 bad_gateway (connect error, reset, closed early)
        ├── UpstreamProtocolError     502 bad_gateway (the backend answered nonsense)
        └── UpstreamTimeout           504 gateway_timeout (no byte within the idle timeout)

Each carries the envelope fields, so the middleware needs no knowledge of the cases.
"""

from __future__ import annotations

from typing import Any, ClassVar


class GatewayError(Exception):
    status: ClassVar[int] = 500
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


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413
    default_code = "request_too_large"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class NoBackendAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    default_code = "no_backend_available"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class UpstreamError(GatewayError):
    status = 502
    type = "bad_gateway"


class UpstreamUnreachable(UpstreamError):
    default_code = "backend_unreachable"


class UpstreamProtocolError(UpstreamError):
    default_code = "backend_protocol_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "gateway_timeout"
    default_code = "backend_timeout"


def error_envelope(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

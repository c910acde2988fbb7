"""How each soak request ended, as the client saw it, sorted into outcomes. Pure.

The client records an ``Observation`` (status, times, what the stream held, how it left);
``classify`` names its outcome. Whose error a response carries is told by its envelope: the
gateway's own errors have snake_case types and string codes (``backends/errors.py``); a
backend's answer passed on as it came (vLLM's envelope) has a CamelCase type and the HTTP
status as an integer code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal

from loadtest.soak.mix import BAD_INPUT, Behaviour

Outcome = Literal[
    "ok",
    "left_before_head",
    "left_after_head",
    "left_mid_stream",
    "left_nonstream_wait",
    "bad_input_rejected",
    "bad_input_not_rejected",
    "auth_rejected",
    "auth_not_rejected",
    "rate_limited",
    "admission_rejected",
    "backend_refused",  # a backend's own 429/502/503/504, passed on (every candidate refused)
    "backend_error",  # a backend's other error answer, passed on
    "no_backend_available",
    "limits_unavailable",
    "gateway_error",  # the gateway's 502/504 before the first byte
    "internal_error",
    "undocumented_5xx",
    "unexpected_4xx",
    "connection_error",
    "stream_cut",  # an error event after the stream began (a killed backend)
    "stream_incomplete",
    "client_timeout",
]
Left = Literal["before_head", "after_head", "mid_stream", "nonstream_wait"]

# Every code the gateway answers a 5xx with (backends/errors.py); internal_error has none.
DOCUMENTED_5XX_CODES: Final = frozenset(
    {
        "no_backend_available",
        "limits_unavailable",
        "queue_full",
        "queue_timeout",
        "shutting_down",
        "backend_unreachable",
        "backend_down",
        "backend_protocol_error",
        "backend_timeout",
    }
)
BEFORE_FIRST_BYTE_FAILURES: Final = frozenset(
    {
        "no_backend_available",
        "limits_unavailable",
        "gateway_error",
        "internal_error",
        "undocumented_5xx",
        "connection_error",
    }
)


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An OpenAI error envelope's fields (or what stood in their place)."""

    message: str | None
    type: str | None
    param: Any
    code: Any
    well_formed: bool  # {"error": {"message": str, "type": str, "param": .., "code": ..}}

    @property
    def from_backend(self) -> bool:
        """vLLM's envelope carries the status as an integer code; the gateway's never does."""
        return isinstance(self.code, int) and not isinstance(self.code, bool)

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "code": self.code}


def parse_envelope(body: bytes | str | None) -> ErrorInfo | None:
    """The error envelope in ``body``; None if it is not JSON with an ``error`` object."""
    if not body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return None
    well_formed = (
        isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and "code" in err
    )
    return ErrorInfo(
        err.get("message"), err.get("type"), err.get("param"), err.get("code"), well_formed
    )


def stream_error_event(tail: bytes) -> ErrorInfo | None:
    """The last ``data: {"error": ...}`` event in the end of a stream, if any."""
    for line in reversed(tail.replace(b"\r\n", b"\n").split(b"\n")):
        if line.startswith(b"data:") and b'"error"' in line:
            found = parse_envelope(line[5:].strip())
            if found is not None:
                return found
    return None


@dataclass(frozen=True, slots=True)
class Observation:
    """One request as the client saw it; times in seconds since the load started."""

    index: int
    replica: int
    behaviour: Behaviour
    key: str
    stream: bool
    start: float
    end: float
    status: int = 0  # 0: no response head
    head_at: float | None = None
    first_token_at: float | None = None
    tokens: int = 0  # content events
    done: bool = False  # [DONE] seen / a whole JSON answer read
    error: ErrorInfo | None = None  # the error body, or the stream's error event
    exception: str | None = None  # the client's own failure: connect, disconnect, timeout...
    left: Left | None = None  # the client left on purpose, at this phase
    left_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "i": self.index,
            "replica": self.replica,
            "behaviour": self.behaviour,
            "key": self.key,
            "stream": self.stream,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "status": self.status,
            "tokens": self.tokens,
            "left": self.left,
            "exception": self.exception,
            "error": None if self.error is None else self.error.to_json(),
        }


def classify(obs: Observation) -> Outcome:
    """The outcome of one request."""
    if obs.left is not None:
        return _LEFT[obs.left]
    err = obs.error
    if obs.behaviour == "wrong_key":
        ok = obs.status == 401 and err is not None and err.well_formed
        return "auth_rejected" if ok else "auth_not_rejected"
    if obs.behaviour in BAD_INPUT:
        ok = 400 <= obs.status < 500 and err is not None and err.well_formed
        return "bad_input_rejected" if ok else "bad_input_not_rejected"
    if obs.status == 0:
        return "client_timeout" if obs.exception in _TIMEOUTS else "connection_error"
    if obs.status == 200:
        if obs.stream and err is not None:
            return "stream_cut"
        if obs.exception in _TIMEOUTS:
            return "client_timeout"
        if obs.exception is not None or not obs.done or (obs.stream and obs.tokens == 0):
            return "stream_incomplete"
        return "ok"
    return _error_status(obs.status, err)


def _error_status(status: int, err: ErrorInfo | None) -> Outcome:
    if err is not None and err.from_backend:
        return "backend_refused" if status in (429, 502, 503, 504) else "backend_error"
    code = None if err is None else err.code
    if status == 429 and code == "rate_limit_exceeded":
        return "rate_limited"
    if err is not None and err.type == "internal_error":
        return "internal_error"
    if code in ("queue_full", "queue_timeout"):
        return "admission_rejected"
    if code == "no_backend_available":
        return "no_backend_available"
    if code == "limits_unavailable":
        return "limits_unavailable"
    if status >= 500:
        documented = err is not None and err.well_formed and code in DOCUMENTED_5XX_CODES
        return "gateway_error" if documented else "undocumented_5xx"
    return "unexpected_4xx"


def gateway_error_documented(err: ErrorInfo | None) -> bool:
    """Whether a 5xx answer (or a stream's error event) is one the gateway documents.

    A backend's own answer passed on is the backend's business; the gateway's must be a
    well-formed envelope with one of its documented codes, and never ``internal_error``.
    """
    if err is None:
        return False
    if err.from_backend:
        return True
    return err.well_formed and err.type != "internal_error" and err.code in DOCUMENTED_5XX_CODES


_LEFT: Final[dict[Left, Outcome]] = {
    "before_head": "left_before_head",
    "after_head": "left_after_head",
    "mid_stream": "left_mid_stream",
    "nonstream_wait": "left_nonstream_wait",
}
_TIMEOUTS: Final = frozenset({"timeout", "connect_timeout", "stall"})

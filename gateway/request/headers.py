"""Which headers cross the gateway, in each direction."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

# RFC 9110 section 7.6.1 hop-by-hop headers, plus the ones the gateway sets itself.
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Never sent upstream: the client's credentials (a backend has its own key), encodings the
# gateway would then have to undo, and ``Expect: 100-continue`` (the gateway has the body
# already; asking the backend would cost a round trip per attempt).
_NOT_UPSTREAM: Final = _HOP_BY_HOP | {
    "authorization",
    "cookie",
    "accept-encoding",
    "x-api-key",
    "expect",
}
_NOT_UPSTREAM_NOR_PRIORITY: Final = _NOT_UPSTREAM | {"x-vllm-priority"}
_NOT_DOWNSTREAM: Final = _HOP_BY_HOP | {"server", "date", "set-cookie"}

REQUEST_ID: Final = "X-Request-Id"
_REQUEST_ID_OK: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def valid_request_id(value: str | None) -> str | None:
    """The client's request id if it is safe to reuse (short, no spaces or odd bytes)."""
    if value and _REQUEST_ID_OK.match(value):
        return value
    return None


def _listed_in_connection(headers: Mapping[str, str]) -> set[str]:
    conn = headers.get("Connection")
    if not conn:
        return set()
    return {t.strip().lower() for t in conn.split(",") if t.strip()}


def _filtered(
    headers: CIMultiDictProxy[str], drop: frozenset[str], request_id: str
) -> CIMultiDict[str]:
    extra = _listed_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in drop and lk not in extra:
            out.add(k, v)
    out[REQUEST_ID] = request_id
    return out


def upstream_headers(
    client: CIMultiDictProxy[str], request_id: str, *, own_priority: bool = True
) -> CIMultiDict[str]:
    """The client's headers as the backend gets them: no hop-by-hop, no credentials; and no
    ``X-Vllm-Priority`` of the client's unless ``own_priority`` (its tier lets it set it, and
    the gateway does not set its own: ``gateway.request.priority``)."""
    return _filtered(
        client, _NOT_UPSTREAM if own_priority else _NOT_UPSTREAM_NOR_PRIORITY, request_id
    )


def downstream_headers(upstream: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    """The backend's headers as the client gets them, with the request's id."""
    return _filtered(upstream, _NOT_DOWNSTREAM, request_id)

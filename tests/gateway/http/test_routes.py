"""Routing (``gateway.http.routes.Routes``): fixed and ``{name}`` paths, HEAD, 404 and 405."""

from __future__ import annotations

import pytest

from backends.errors import GatewayError, NotFound
from gateway.http import MethodNotAllowed, Request, Response, RouteNotFound, Routes


async def a(request: Request) -> Response:
    return Response(body=b"a")


async def b(request: Request) -> Response:
    return Response(body=b"b")


def router() -> Routes:
    r = Routes()
    r.add("POST", "/v1/chat/completions", a)
    r.add("GET", "/v1/responses/{response_id}", a)
    r.add("POST", "/v1/responses/{response_id}/cancel", b)
    r.add("POST", "/v1/responses", b)
    r.add("GET", "/health", b)
    return r


def test_fixed_paths_and_named_segments_resolve() -> None:
    r = router()
    assert r.resolve("POST", "/v1/chat/completions") == (a, {})
    assert r.resolve("GET", "/v1/responses/resp_1") == (a, {"response_id": "resp_1"})
    assert r.resolve("POST", "/v1/responses/resp_1/cancel") == (b, {"response_id": "resp_1"})
    assert r.resolve("POST", "/v1/responses") == (b, {})


def test_a_get_route_answers_head() -> None:
    assert router().resolve("HEAD", "/health") == (b, {})
    assert router().resolve("HEAD", "/v1/responses/x") == (a, {"response_id": "x"})


@pytest.mark.parametrize(
    "path", ["/nope", "/v1/responses/x/y", "/v1/responses//cancel", "/v1/chat/completions/x"]
)
def test_an_unknown_path_is_404(path: str) -> None:
    with pytest.raises(RouteNotFound) as caught:
        router().resolve("GET", path)
    assert isinstance(caught.value, NotFound)
    assert caught.value.status == 404
    assert caught.value.message == f"Not Found (GET {path})"


def test_a_method_the_path_lacks_is_405_with_allow() -> None:
    with pytest.raises(MethodNotAllowed) as caught:
        router().resolve("GET", "/v1/chat/completions")
    err = caught.value
    assert isinstance(err, GatewayError)
    assert (err.status, err.headers) == (405, {"Allow": "POST"})
    assert err.message == "Method Not Allowed (GET /v1/chat/completions)"
    with pytest.raises(MethodNotAllowed) as caught:
        router().resolve("DELETE", "/v1/responses/x")
    assert caught.value.headers == {"Allow": "GET, HEAD"}


def test_a_route_is_added_once() -> None:
    r = router()
    with pytest.raises(ValueError, match="second route"):
        r.add("POST", "/v1/chat/completions", b)
    with pytest.raises(ValueError, match="starts with /"):
        r.add("GET", "health", b)
    with pytest.raises(ValueError, match="whole"):
        r.add("GET", "/v1/x{y}", b)

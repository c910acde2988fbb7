"""Which handler answers a method and path: fixed paths in a dict, ``{name}`` segments matched
by the number of segments. A GET route answers HEAD too.

A path no route has is ``RouteNotFound`` (404), a method its routes lack ``MethodNotAllowed``
(405, with ``Allow``): both ``GatewayError``s, answered by the middleware as any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeAlias

from backends.errors import GatewayError, NotFound
from gateway.http.message import Request
from gateway.http.response import Response, StreamResponse

Handler: TypeAlias = Callable[[Request], Awaitable[Response | StreamResponse]]


class RouteNotFound(NotFound):
    """404: no route has this path."""


class MethodNotAllowed(GatewayError):
    """405: the path's routes do not take this method (``Allow`` says which they take)."""

    status = 405
    type = "invalid_request_error"

    def __init__(self, message: str, *, allow: Iterable[str]) -> None:
        super().__init__(message, headers={"Allow": ", ".join(sorted(set(allow)))})


def _segments(path: str) -> list[str]:
    return path.strip("/").split("/")


def _template(path: str) -> tuple[str | None, ...] | None:
    """A path with ``{name}`` segments: each segment's name (None for a fixed one, which is
    matched as itself); None for a path without any."""
    if "{" not in path:
        return None
    names: list[str | None] = []
    for seg in _segments(path):
        if seg.startswith("{") and seg.endswith("}") and len(seg) > 2:
            names.append(seg[1:-1])
        elif "{" in seg or "}" in seg:
            raise ValueError(f"a route segment is a whole {{name}} or fixed text: {path!r}")
        else:
            names.append(None)
    return tuple(names)


class _Pattern:
    __slots__ = ("handlers", "names", "segments")

    def __init__(self, path: str, names: tuple[str | None, ...]) -> None:
        self.segments = _segments(path)
        self.names = names
        self.handlers: dict[str, Handler] = {}

    def match(self, segments: list[str]) -> dict[str, str] | None:
        info: dict[str, str] = {}
        for want, got, name in zip(self.segments, segments, self.names, strict=True):
            if name is not None:
                if not got:
                    return None
                info[name] = got
            elif want != got:
                return None
        return info


class Routes:
    """Routes by method and path; ``resolve`` finds the handler and the path's parameters."""

    __slots__ = ("_fixed", "_patterns")

    def __init__(self) -> None:
        self._fixed: dict[str, dict[str, Handler]] = {}
        self._patterns: dict[int, list[_Pattern]] = {}  # by number of segments

    def add(self, method: str, path: str, handler: Handler) -> None:
        if not path.startswith("/"):
            raise ValueError(f"a route's path starts with /: {path!r}")
        method = method.upper()
        names = _template(path)
        if names is None:
            handlers = self._fixed.setdefault(path, {})
        else:
            patterns = self._patterns.setdefault(len(names), [])
            for pattern in patterns:
                if pattern.segments == _segments(path):
                    break
            else:
                pattern = _Pattern(path, names)
                patterns.append(pattern)
            handlers = pattern.handlers
        if method in handlers:
            raise ValueError(f"a second route for {method} {path}")
        handlers[method] = handler

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler for ``method`` on ``path`` and the path's ``{name}`` values;
        ``RouteNotFound`` or ``MethodNotAllowed`` if there is none."""
        allowed: list[str] = []
        handlers = self._fixed.get(path)
        if handlers is not None:
            handler = handlers.get(method)
            if handler is None and method == "HEAD":
                handler = handlers.get("GET")
            if handler is not None:
                return handler, {}
            allowed.extend(handlers)
        segments = _segments(path)
        for pattern in self._patterns.get(len(segments), ()):
            info = pattern.match(segments)
            if info is None:
                continue
            handler = pattern.handlers.get(method)
            if handler is None and method == "HEAD":
                handler = pattern.handlers.get("GET")
            if handler is not None:
                return handler, info
            allowed.extend(pattern.handlers)
        if not allowed:
            raise RouteNotFound(f"Not Found ({method} {path})")
        if "GET" in allowed:
            allowed.append("HEAD")
        raise MethodNotAllowed(f"Method Not Allowed ({method} {path})", allow=allowed)

"""The server's limits and timeouts, apart from the server so what every connection shares
(``gateway.http.shared``) can name them without importing the server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.http.refusal import default_error_body


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """The server's limits and timeouts (seconds)."""

    max_header_bytes: int = 16 * 1024  # request line or header field; the whole head: 4x
    max_headers: int = 100
    max_body_bytes: int  # what Request.read() accepts (413 beyond)
    header_timeout: float = 60.0  # from a request's first byte to its whole head: 408
    keepalive_timeout: float = 75.0  # an idle connection (or a silent new one) is closed
    send_timeout: float = 60.0  # a client that reads nothing for this long is cut off
    max_pipelined: int = 16  # requests parsed ahead of the one answered, then reading stops
    # status, message, path (if known) -> the JSON body of a refusal
    error_body: Callable[[int, str, str | None], bytes] = default_error_body
    server_name: str | None = None  # the Server header's value; None: no Server header

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1 or self.max_headers < 1 or self.max_pipelined < 1:
            raise ValueError("max_header_bytes, max_headers and max_pipelined must be positive")
        if min(self.header_timeout, self.keepalive_timeout, self.send_timeout) <= 0:
            raise ValueError("the timeouts must be positive")
        if self.server_name is not None and ("\r" in self.server_name or "\n" in self.server_name):
            raise ValueError("a line break in server_name")

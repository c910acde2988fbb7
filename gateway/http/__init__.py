"""The gateway's own HTTP/1.1 server for the model endpoints, on httptools (llhttp).

    message.py    Request, Body: a request's head, and its body as it arrives
    response.py   Response, StreamResponse, json_response: what handlers answer
    routes.py     Routes: method and path to handler; 404 and 405
    protocol.py   Connection: one client connection (keep-alive, pipelining, refusals)
    server.py     Server: listeners, graceful stop
    config.py     ServerConfig: the server's limits and timeouts
    shared.py     Shared: what every connection of one server shares
    head.py, refusal.py, sampling.py: pure pieces (response heads, refusals, log sampling)

aiohttp stays for the admin API and the console (``gateway.admin``).
"""

from gateway.http.config import ServerConfig
from gateway.http.message import Body, Request
from gateway.http.protocol import Connection
from gateway.http.refusal import Refused, default_error_body, refusal_code
from gateway.http.response import Response, StreamResponse, json_response
from gateway.http.routes import Handler, MethodNotAllowed, RouteNotFound, Routes
from gateway.http.sampling import LogSampler
from gateway.http.server import Server

__all__ = [
    "Body",
    "Connection",
    "Handler",
    "LogSampler",
    "MethodNotAllowed",
    "Refused",
    "Request",
    "Response",
    "RouteNotFound",
    "Routes",
    "Server",
    "ServerConfig",
    "StreamResponse",
    "default_error_body",
    "json_response",
    "refusal_code",
]

"""Typed keys for what the app and each request carry."""

from __future__ import annotations

from typing import Final

from aiohttp import web

from backends.monitor import BackendMonitor
from backends.pool import BackendPool
from backends.upstream import UpstreamClient
from gateway.router import Router
from gateway.settings import Settings

SETTINGS: Final = web.AppKey("settings", Settings)
POOL: Final = web.AppKey("pool", BackendPool)
ROUTER: Final = web.AppKey("router", Router)
UPSTREAM: Final = web.AppKey("upstream", UpstreamClient)
MONITOR: Final = web.AppKey("monitor", BackendMonitor)

REQUEST_ID_KEY: Final = web.RequestKey("request_id", str)

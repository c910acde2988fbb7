"""What the admin API's views use, kept on its app under one key and looked up once per call
(``admin_of``): the gateway's services, and the admin API's own memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from aiohttp import web

from gateway.admin.lastknown import LastKnown
from gateway.admin.replays import Replays
from gateway.request.services import Services


@dataclass(frozen=True, slots=True)
class Admin:
    svc: Services
    views: LastKnown  # the fleet's views, as last known while Redis does not answer
    replays: Replays  # without a fleet: the answers of the changes made here, by id


_ADMIN: Final = web.AppKey("admin", Admin)


def hand_in(app: web.Application, admin: Admin) -> None:
    app[_ADMIN] = admin


def admin_of(request: web.Request) -> Admin:
    return request.app[_ADMIN]

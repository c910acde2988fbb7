"""OpenAI's Responses API: a stored response is remembered with the backend that answers it
(its id the client's ``request_id``, else a new one), and a request that goes on from one
(``previous_response_id``) is pinned to that backend (``gateway.request.responses``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gateway.request.api import Plain, Prepared
from gateway.request.responses import with_response_id
from gateway.request.stored import home_of

if TYPE_CHECKING:
    from gateway.request.form import Upload
    from gateway.request.services import Services


class Responses(Plain):
    async def prepare(self, svc: Services, doc: dict[str, Any], raw: bytes | Upload) -> Prepared:
        assert isinstance(raw, bytes)  # a JSON endpoint
        response_id, doc, raw = with_response_id(doc, raw)
        pin = await home_of(svc, doc.get("previous_response_id"), "previous_response_id")
        stored = doc.get("store", True) is not False
        return Prepared(doc, raw, response_id=response_id if stored else None, pin=pin)


RESPONSES_API: Final = Responses()

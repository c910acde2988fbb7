"""What differs between the APIs the gateway routes, as one small protocol.

The request path (``gateway.request.proxy``, ``answer``, ``resume``) is the same for every
model-addressed endpoint; what differs is asked of the endpoint's ``Api`` (one module each in
``gateway.request.apis``), never tested by name:

- ``view``: the body as limits and routing read it (a chat's or a completion's fields);
- ``prepare``: what the API does to a body before it is routed (a Responses request's id, and
  the backend holding the conversation it goes on);
- ``prompt_ids``: the prompt's token ids for precise prefix routing, if the API has a prompt;
- ``continuing``: whether and how a broken stream of this request goes on elsewhere
  (a ``Continuing``, or None);
- ``upstream_id``: the request id the backend gets;
- ``serving``: what is kept while the request runs (the token-in generations the abort route
  finds), or None.

Whose shapes the clients parse (errors, the end of a stream) is the endpoint's ``Dialect``
(``gateway.request.dialects``). Adding an API is a module in ``gateway.request.apis`` and a row
in ``gateway.request.endpoints``' table.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from gateway.request.continuation import StreamProgress

if TYPE_CHECKING:
    from gateway.request.form import Upload
    from gateway.request.record import RequestRecord
    from gateway.request.services import Services


class Stitcher(Protocol):
    """Rewrites a continuation's events into the client's stream (``feed``); ``cut`` is set
    (and nothing more passes) at an event saying the engine failed."""

    cut: str | None

    def feed(self, data: bytes) -> bytes: ...


P = TypeVar("P", bound=StreamProgress)


class Continuing(Protocol, Generic[P]):
    """How one request's stream goes on on another backend when its own breaks mid-way."""

    @property
    def doc(self) -> dict[str, Any]:
        """The request as the client sent it (its model names the continuation's)."""
        ...

    @property
    def path(self) -> str | None:
        """Where the rest is asked for (None: the request's own path)."""
        ...

    def progress(self) -> P:
        """A new record of what one stream's client receives."""
        ...

    def blocker(self, progress: P) -> str | None:
        """Why the stream cannot go on faithfully from ``progress``; None if it can."""
        ...

    def rest(self, progress: P, sent: int) -> tuple[dict[str, Any], Stitcher]:
        """The request for the rest of the answer (``sent`` tokens of it sent), and what
        rewrites its events into the client's stream."""
        ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A body as the API prepared it for routing."""

    doc: dict[str, Any]
    raw: bytes | Upload
    response_id: str | None = None  # remembered with the backend that answers (Responses)
    pin: str | None = None  # the backend it must go to (the one holding what it continues)


class Api(Protocol):
    """What one API does differently; ``Plain`` is what most do."""

    def view(self, doc: dict[str, Any]) -> dict[str, Any]: ...

    async def prepare(
        self, svc: Services, doc: dict[str, Any], raw: bytes | Upload
    ) -> Prepared: ...

    async def prompt_ids(
        self, svc: Services, model: str, doc: dict[str, Any], view: Mapping[str, Any]
    ) -> list[int] | None: ...

    def continuing(self, doc: dict[str, Any]) -> Continuing[Any] | None: ...

    def upstream_id(
        self, headers: Mapping[str, str], doc: Mapping[str, Any], request_id: str
    ) -> str: ...

    def serving(
        self, svc: Services, request_id: str, owner: str, record: RequestRecord
    ) -> AbstractContextManager[object] | None: ...


class Plain:
    """An API the gateway routes as it comes: the body is what limits and routing read, no
    prompt ids of its own, a stream not continued, the request's own id upstream."""

    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc

    async def prepare(self, svc: Services, doc: dict[str, Any], raw: bytes | Upload) -> Prepared:
        return Prepared(doc, raw)

    async def prompt_ids(
        self, svc: Services, model: str, doc: dict[str, Any], view: Mapping[str, Any]
    ) -> list[int] | None:
        return None

    def continuing(self, doc: dict[str, Any]) -> Continuing[Any] | None:
        return None

    def upstream_id(
        self, headers: Mapping[str, str], doc: Mapping[str, Any], request_id: str
    ) -> str:
        return request_id

    def serving(
        self, svc: Services, request_id: str, owner: str, record: RequestRecord
    ) -> AbstractContextManager[object] | None:
        return None  # nothing kept while it runs


PLAIN = Plain()

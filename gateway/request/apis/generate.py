"""vLLM's token-in, token-out route (``gateway.request.generate``): the body's token ids are
the prompt (no tokenizing), a broken stream goes on from the ids sent, the client's own
``request_id`` names the generation upstream, and the abort route finds it while it runs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gateway.request.api import Continuing, Plain, Stitcher
from gateway.request.continuation import Progress, Stitch, can_resume
from gateway.request.generate import (
    abort_ids,
    generate_refusal,
    generate_resume_body,
    generate_view,
    token_ids,
)
from gateway.request.headers import REQUEST_ID, valid_request_id

if TYPE_CHECKING:
    from gateway.request.record import RequestRecord
    from gateway.request.services import Services


@dataclass(frozen=True, slots=True)
class GenerateContinuing:
    doc: dict[str, Any]
    path: None = None

    def progress(self) -> Progress:
        return Progress(chat=False)

    def blocker(self, progress: Progress) -> str | None:
        return can_resume(self.doc, False, progress)

    def rest(self, progress: Progress, sent: int) -> tuple[dict[str, Any], Stitcher]:
        return generate_resume_body(self.doc, progress, sent), Stitch(progress, sent)


class Generate(Plain):
    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        return generate_view(doc)

    async def prompt_ids(
        self, svc: Services, model: str, doc: dict[str, Any], view: Mapping[str, Any]
    ) -> list[int] | None:
        return token_ids(doc)

    def continuing(self, doc: dict[str, Any]) -> Continuing[Progress] | None:
        return GenerateContinuing(doc) if generate_refusal(doc) is None else None

    def upstream_id(
        self, headers: Mapping[str, str], doc: Mapping[str, Any], request_id: str
    ) -> str:
        """vLLM names the generation after the header, else the body's ``request_id``: the
        one the client chose is the one it aborts by."""
        if REQUEST_ID in headers:
            return request_id
        return valid_request_id(doc.get("request_id")) or request_id

    def serving(
        self, svc: Services, request_id: str, owner: str, record: RequestRecord
    ) -> AbstractContextManager[object]:
        return _findable(svc, request_id, owner, record)


@contextmanager
def _findable(svc: Services, request_id: str, owner: str, record: RequestRecord) -> Iterator[None]:
    """Where the abort route finds the generation meanwhile (by the id it went upstream with)."""
    generations = svc.generations
    aborts = abort_ids(request_id)
    generations.started(aborts, owner, record)
    try:
        yield
    finally:
        generations.ended(aborts)


GENERATE_API: Final = Generate()

"""Anthropic's Messages API: vLLM renders a Messages body as a chat, which is how limits and
routing read it (``gateway.request.messages.chat_view``) and how a broken stream goes on: as
that chat, rewritten into the client's named events (``gateway.request.messages_resume``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gateway.request.api import Continuing, Plain, Stitcher
from gateway.request.messages import chat_view
from gateway.request.messages_resume import (
    CHAT_PATH,
    MessagesProgress,
    MessagesStitch,
    messages_refusal,
    messages_resume_body,
)

if TYPE_CHECKING:
    from gateway.request.services import Services


@dataclass(frozen=True, slots=True)
class MessagesContinuing:
    doc: dict[str, Any]
    path: str = CHAT_PATH  # the rest is asked for as the chat vLLM renders

    def progress(self) -> MessagesProgress:
        return MessagesProgress()

    def blocker(self, progress: MessagesProgress) -> str | None:
        return progress.blocker

    def rest(self, progress: MessagesProgress, sent: int) -> tuple[dict[str, Any], Stitcher]:
        return messages_resume_body(self.doc, progress, sent), MessagesStitch(progress, sent)


class MessagesSide(Plain):
    """Messages' other routes (``count_tokens``, ``render``): read as the chat they render."""

    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        return chat_view(doc)


class Messages(MessagesSide):
    """``/v1/messages`` itself."""

    async def prompt_ids(
        self, svc: Services, model: str, doc: dict[str, Any], view: Mapping[str, Any]
    ) -> list[int] | None:
        tokenizers = svc.tokenizers
        return None if tokenizers is None else await tokenizers.tokens(model, "chat", view)

    def continuing(self, doc: dict[str, Any]) -> Continuing[MessagesProgress] | None:
        return MessagesContinuing(doc) if messages_refusal(doc) is None else None


MESSAGES_API: Final = Messages()
MESSAGES_SIDE_API: Final = MessagesSide()

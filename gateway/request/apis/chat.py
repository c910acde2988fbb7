"""OpenAI's chat completions and completions: the prompt tokenized for precise prefix routing
(as vLLM renders it), and a broken stream continued from what the client received
(``gateway.request.continuation``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.request.api import Continuing, Plain, Stitcher
from gateway.request.continuation import Progress, Stitch, can_resume, refusal, resume_body

if TYPE_CHECKING:
    from gateway.request.services import Services


@dataclass(frozen=True, slots=True)
class ChatContinuing:
    """A chat's (``chat``) or a completion's stream, continued with the text sent appended."""

    doc: dict[str, Any]
    chat: bool
    path: None = None

    def progress(self) -> Progress:
        return Progress(chat=self.chat)

    def blocker(self, progress: Progress) -> str | None:
        return can_resume(self.doc, self.chat, progress)

    def rest(self, progress: Progress, sent: int) -> tuple[dict[str, Any], Stitcher]:
        return resume_body(self.doc, self.chat, progress, sent), Stitch(progress, sent)


class Chat(Plain):
    """``chat``: the chat completions API; else the (text) completions API."""

    def __init__(self, *, chat: bool) -> None:
        self._chat = chat
        self._kind: Any = "chat" if chat else "completions"  # the tokenizer's PathKind

    async def prompt_ids(
        self, svc: Services, model: str, doc: dict[str, Any], view: Mapping[str, Any]
    ) -> list[int] | None:
        tokenizers = svc.tokenizers
        return None if tokenizers is None else await tokenizers.tokens(model, self._kind, view)

    def continuing(self, doc: dict[str, Any]) -> Continuing[Progress] | None:
        return ChatContinuing(doc, self._chat) if refusal(doc, self._chat) is None else None


CHAT_API = Chat(chat=True)
COMPLETIONS_API = Chat(chat=False)

"""A toy API, added as a newcomer would add one: this module, and one row of the table (the
test's ``TOY``). ``POST /v1/toy`` takes ``{"model", "input", "budget", "stream", "toy_id"}``;
limits and routing read it as a completion of ``input`` within ``budget`` tokens, and the
toy's own id names the request upstream. Everything else is ``Plain``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.request.api import Plain
from gateway.request.endpoints import Endpoint


class Toy(Plain):
    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": doc.get("model"),
            "prompt": doc.get("input", ""),
            "max_tokens": doc.get("budget", 16),
        }

    def upstream_id(
        self, headers: Mapping[str, str], doc: Mapping[str, Any], request_id: str
    ) -> str:
        toy_id = doc.get("toy_id")
        return toy_id if isinstance(toy_id, str) and toy_id.isalnum() else request_id


TOY: Final = Endpoint("toy", ("/v1/toy",), "data", api=Toy(), generates=True, streams_tokens=True)

"""What an admin change is: one row of the table of changes the gateway can make at run time
(``gateway.admin.actions``), checked, then applied, the same way on every replica."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gateway.request.services import Services

# The path's parameters, and who asked under ``CALLER`` where an operator did (the audit
# trail's ``caller``: the same on every replica, from the change in the log)
Params = Mapping[str, str]
CALLER: Final = "@caller"  # never a path parameter's name
Doc = Any  # a JSON document


@dataclass(frozen=True, slots=True)
class Action:
    """``routed``: False for a change only the gateway itself appends (a record of what was
    done once for the fleet, such as a LoRA adapter loaded on the backends)."""

    method: str
    pattern: str  # aiohttp's form: /admin/backends/{backend_id}/drain
    check: Callable[[Services, Params, Doc], Doc]  # what it would set; raises if bad
    apply: Callable[[Services, Params, Doc], Doc]  # the answer's document
    before: Callable[[Services, Params], Doc]  # what it replaces (the audit's ``old``)
    json_body: bool = False
    # Run once, where the change is made, before anything else: the body to log and apply in
    # its place, and what to add to the answer there (a key made by the gateway: its secret
    # goes to the caller once, only its hash to the log)
    prepare: Callable[[Services, Params, Doc], tuple[Doc, dict[str, Any]]] | None = None
    routed: bool = True
    # A change that would set what ``before`` says is set already is answered as such and not
    # logged (``old == new``: a drain of a drained backend)
    skip_unchanged: bool = False
    # ``?dry_run=1``: what it would change, answered here; nothing changed, nothing logged
    dry_run: Callable[[Services, Params, Doc], Doc] | None = None

    def __post_init__(self) -> None:
        # What ``prepare`` makes is logged as JSON: read back as such where it is applied
        assert self.prepare is None or self.json_body, f"{self.pattern}: prepare needs json_body"

    def matcher(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.pattern) + "$")

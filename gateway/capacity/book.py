"""The capacity manager's state as every replica has it, from the fleet's log: the rules per
model (the file's, changed by ``PUT``/``DELETE /admin/capacity/{model}``) and the fencing token
of the newest manager whose decision was applied (a manager that lost its lease, or a decision
made twice, is refused where it is applied: ``accept``). Which engines the fleet wants asleep
is the pool's (``BackendState.sleep_wanted``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.errors import Conflict
from gateway.capacity.plan import Rule
from gateway.capacity.settings import rule_doc, rule_of


@dataclass(slots=True)
class CapacityBook:
    enabled: bool = False
    rules: dict[str, Rule] = field(default_factory=dict)
    token: int = 0

    def accept(self, token: int | None) -> None:
        """A manager's decision under ``token`` (None: an operator's, always taken): refused
        if a newer manager decided since."""
        if token is None:
            return
        if token < self.token:
            raise Conflict(
                f"a newer capacity manager (token {self.token}) decides now; this one's "
                f"({token}) lost its lease"
            )
        self.token = token

    def state(self) -> dict[str, Any]:
        return {"rules": {m: rule_doc(r) for m, r in self.rules.items()}, "token": self.token}

    def restore(self, doc: Mapping[str, Any]) -> None:
        rules = doc.get("rules")
        if isinstance(rules, dict):
            taken: dict[str, Rule] = {}
            for model, rule in rules.items():
                try:
                    taken[str(model)] = rule_of(dict(rule))
                except (TypeError, ValueError):
                    continue  # written by another version: the rest taken
            self.rules = taken
        token = doc.get("token")
        if isinstance(token, int):
            self.token = max(self.token, token)

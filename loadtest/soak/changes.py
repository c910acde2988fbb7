"""Admin changes made while Redis is in trouble, and what must hold of them. Pure: records in,
verdicts out.

During the soak's Redis faults (``loadtest.soak.redis_faults``) admin changes are sent with an
``Idempotency-Key``, some through two replicas at once, and each is then followed by its id on
every replica (``GET /admin/changes/{id}``) and by its effect on every replica's state; the
fleet's views are read on every replica throughout; the state of every replica is read before
and after Redis comes back empty; the replicas' logs are read at the end. The fleet promises
(docs/fleet.md, "What happens to a change"):

- an answer never says more than is known: 200 applied, 202 ``pending`` in the log, 202
  ``unknown`` perhaps, 503 certainly not written; so a change's fate, once settled, is the same
  on every replica, agrees with every answer its calls got, and is what each replica's state
  shows (``check_answers``);
- a call repeated with the same key is answered with the first outcome and never applied twice:
  once settled, a repeat is answered 200, ``Idempotent-Replayed`` exactly when the change was
  already applied, and the audit trail holds one entry with its id (``check_answers``; the
  trail is counted only where it is whole: a log healed after Redis came back empty starts
  from a snapshot, so the entries before are gone from it);
- the views (replicas, changes, rollouts, keys, a key's usage) answer 200 throughout, marked
  ``stale`` while Redis is away (``check_views``);
- a log lost with an empty Redis is flagged by every replica and healed once, and every
  replica's state afterwards is the state before, a budget's spent count included, and was
  so whenever it was read meanwhile (``check_log_losses``);
- no replica logs a traceback, and the views' outage is one log line per outage
  (``check_replica_logs``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from loadtest.soak.invariants import EXAMPLES, Verdict

SETTLED: Final = frozenset({"applied", "refused", "not_applied"})
VIEWS: Final = ("/admin/replicas", "/admin/changes", "/admin/rollouts", "/admin/keys")
Claim = Literal["applied", "in_log", "unknown", "not_written", "refused", "no_answer"]
_WROTE_PERHAPS: Final = frozenset({"applied", "in_log", "unknown"})


@dataclass(frozen=True, slots=True)
class Call:
    """One call that made (or tried to make) a change, and what its caller was told."""

    through: int  # the replica it was sent to
    at: float
    status: int  # 0: no answer
    change_id: str | None  # its X-Gateway-Change-Id
    state: str | None = None  # a 202's "state": pending (in the log) or unknown
    code: str | None = None  # an error's code
    replayed: bool = False  # Idempotent-Replayed: true

    @property
    def claim(self) -> Claim:
        """What the answer says of the change."""
        if self.status == 200:
            return "applied"
        if self.status == 202:
            return "in_log" if self.state == "pending" else "unknown"
        if self.status == 503:
            return "not_written"
        if 400 <= self.status < 500:
            return "refused"
        return "no_answer"  # none, or a 5xx that says nothing of the change

    def to_json(self) -> dict[str, Any]:
        return {
            "through": self.through,
            "at_s": round(self.at, 2),
            "status": self.status,
            "id": self.change_id,
            "state": self.state,
            "code": self.code,
            "replayed": self.replayed,
        }


@dataclass(frozen=True, slots=True)
class KeyedChange:
    """A change sent with an ``Idempotency-Key`` (``key``) by ``calls`` during (or before) a
    Redis fault; its fate on each replica once Redis answered again (``settled``) and what
    each replica's state showed then (``effect_settled``); the same call repeated once more
    (``repeat``); its fate and effect on each replica after that (``fates``, ``effect``);
    its entries in the audit trail (``entries``, None: not counted)."""

    key: str
    what: str  # e.g. "POST /admin/keys soak-p0"
    phase: str  # pause, before_restart, restart, after_restart
    calls: tuple[Call, ...]
    settled: tuple[str, ...]
    effect_settled: tuple[bool, ...]
    repeat: Call | None
    fates: tuple[str, ...]
    effect: tuple[bool, ...]
    entries: int | None = None

    def problems(self) -> list[str]:
        out: list[str] = []
        for call in (*self.calls, *([] if self.repeat is None else [self.repeat])):
            if call.claim == "no_answer":
                out.append(f"through replica {call.through}: no answer ({call.status})")
            if call.change_id != self.key:
                out.append(f"answered the id {call.change_id!r} for the key {self.key!r}")
        fresh = [c for c in self.calls if c.claim in ("applied", "in_log") and not c.replayed]
        if len(fresh) > 1:
            out.append(f"{len(fresh)} calls applied it afresh (none replayed)")
        if any(c.replayed for c in self.calls) and not any(
            c.claim in _WROTE_PERHAPS and not c.replayed for c in self.calls
        ):
            out.append("a call was answered as a replay of a change no call answered written")
        fate = _one(self.settled)
        if fate is None:
            out.append(f"its fate was not settled alike on every replica: {list(self.settled)}")
        else:
            out += self._against(fate)
            if any(e != (fate == "applied") for e in self.effect_settled):
                out.append(f"{fate}, but the replicas' state showed {list(self.effect_settled)}")
        if self.repeat is not None:
            out += self._repeated(fate)
        if self.entries is not None and self.entries != (1 if _one(self.fates) == "applied" else 0):
            out.append(f"{self.entries} entries with its id in the audit trail")
        return out

    def _against(self, fate: str) -> list[str]:
        """Whether the settled ``fate`` is what the calls' answers said."""
        claims = {c.claim for c in self.calls}
        if "applied" in claims and fate != "applied":
            return [f"answered 200, but {fate} on every replica"]
        if "in_log" in claims and fate not in ("applied", "refused"):
            return [f"answered 202 pending (in the log), but {fate}"]
        said = ", ".join(str(c.status) for c in self.calls)
        if claims and claims <= {"not_written"} and fate != "not_applied":
            return [f"answered {said} (not written), but {fate}"]
        if claims and claims <= {"not_written", "refused"} and fate == "applied":
            return [f"answered {said} (refused or not written), but applied"]
        return []

    def _repeated(self, fate: str | None) -> list[str]:
        assert self.repeat is not None
        out = []
        if self.repeat.status != 200:
            out.append(f"the repeat was answered {self.repeat.status}")
        elif fate is not None and self.repeat.replayed != (fate == "applied"):
            out.append(
                f"the repeat of a change {fate} was "
                + ("answered as a replay" if self.repeat.replayed else "applied again")
            )
        if _one(self.fates) != "applied":
            out.append(f"after the repeat: {list(self.fates)}, not applied everywhere")
        if not all(self.effect):
            out.append(f"after the repeat the replicas' state showed {list(self.effect)}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "what": self.what,
            "phase": self.phase,
            "calls": [c.to_json() for c in self.calls],
            "settled": list(self.settled),
            "effect_settled": list(self.effect_settled),
            "repeat": None if self.repeat is None else self.repeat.to_json(),
            "fates": list(self.fates),
            "effect": list(self.effect),
            "entries": self.entries,
        }


def _one(states: Sequence[str]) -> str | None:
    """The state every replica tells, if they all tell the same settled one."""
    found = set(states)
    return next(iter(found)) if len(found) == 1 and found <= SETTLED else None


def check_answers(changes: Sequence[KeyedChange], planned_phases: int) -> Verdict:
    """Every change's answers match what every replica applied; repeats applied once."""
    claims = Counter(c.claim for ch in changes for c in ch.calls)
    figures: dict[str, Any] = {
        "changes": len(changes),
        "calls": sum(len(ch.calls) for ch in changes),
        "answers": dict(sorted(claims.items())),
        "fates": dict(sorted(Counter(_one(ch.settled) or "unsettled" for ch in changes).items())),
        "replayed_repeats": sum(1 for ch in changes if ch.repeat and ch.repeat.replayed),
        "entries_counted": sum(1 for ch in changes if ch.entries is not None),
        "detail": [ch.to_json() for ch in changes],
    }
    phases = {ch.phase for ch in changes}
    if planned_phases and not changes:
        return Verdict(
            "admin_answers_true", False, "no change was made under a Redis fault", figures
        )
    bad = [f"{ch.what} ({ch.key}): {'; '.join(p)}" for ch in changes if (p := ch.problems())]
    figures["problems"] = bad[:EXAMPLES]
    if bad:
        return Verdict("admin_answers_true", False, "; ".join(bad[:3]), figures)
    said = ", ".join(f"{n} {k}" for k, n in sorted(claims.items()))
    why = (
        f"{len(changes)} changes in {len(phases)} phases, {figures['calls']} calls ({said}): "
        f"every answer what every replica applied; each repeat applied once "
        f"({figures['replayed_repeats']} replayed)"
    )
    return Verdict("admin_answers_true", True, why, figures)


# -- the views ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ViewRead:
    replica: int
    path: str
    start: float
    end: float
    status: int  # 0: no answer
    stale: bool  # marked "stale"


@dataclass(frozen=True, slots=True)
class Outage:
    """Redis away: paused (``redis_pause``), or dead (``redis_kill``), from ``start`` until it
    was resumed or answered again (empty) at ``end``."""

    kind: str
    start: float
    end: float

    def covers(self, start: float, end: float) -> bool:
        return self.start <= start and end <= self.end


def check_views(reads: Sequence[ViewRead], outages: Sequence[Outage], replicas: int) -> Verdict:
    """Every view answered 200; every read made while Redis was away is marked stale, and each
    view of each replica was read so at least once."""
    away = [r for r in reads if any(o.covers(r.start, r.end) for o in outages)]
    failed = [r for r in reads if r.status != 200]
    fresh = [r for r in away if r.status == 200 and not r.stale]
    paths = sorted({r.path for r in reads})
    unread = [
        f"{path} on replica {n}"
        for n in range(replicas)
        for path in paths
        if not any(r.replica == n and r.path == path for r in away)
    ]
    figures = {
        "reads": len(reads),
        "while_away": len(away),
        "stale": sum(1 for r in reads if r.stale),
        "failed": len(failed),
        "fresh_while_away": len(fresh),
        "slowest_s": round(max((r.end - r.start for r in reads), default=0.0), 3),
        "outages": [
            {"kind": o.kind, "start_s": round(o.start, 2), "end_s": round(o.end, 2)}
            for o in outages
        ],
        "examples": [_read_json(r) for r in [*failed, *fresh][:EXAMPLES]],
    }
    if not outages:
        return Verdict("views_up_under_redis_faults", False, "Redis was never away", figures)
    problems = []
    if failed:
        problems.append(f"{len(failed)} of {len(reads)} reads not answered 200")
    if fresh:
        problems.append(f"{len(fresh)} reads while Redis was away not marked stale")
    if not paths or unread:
        problems.append(f"never read while Redis was away: {', '.join(unread) or 'any view'}")
    if problems:
        return Verdict("views_up_under_redis_faults", False, "; ".join(problems), figures)
    why = (
        f"{len(reads)} reads of {len(paths)} views, all 200; the {len(away)} made while Redis "
        f"was away ({len(outages)} outages) all marked stale"
    )
    return Verdict("views_up_under_redis_faults", True, why, figures)


def _read_json(r: ViewRead) -> dict[str, Any]:
    return {
        "replica": r.replica,
        "path": r.path,
        "start_s": round(r.start, 2),
        "end_s": round(r.end, 2),
        "status": r.status,
        "stale": r.stale,
    }


# -- a lost log, healed ---------------------------------------------------------------------


STATE_PATHS: Final = ("/admin/backends", "/admin/policy", "/admin/aliases", "/admin/keys")


def state_part(path: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a replica's state one of ``STATE_PATHS`` tells (not the figures: health,
    load, spent counts)."""
    if path == "/admin/backends":
        return {"draining": {b["id"]: b.get("draining") for b in doc.get("backends", [])}}
    if path == "/admin/policy":
        return {"policy": doc.get("policy"), "weights": doc.get("weights")}
    if path == "/admin/aliases":
        pools = doc.get("pools") or {}
        return {
            "aliases": doc.get("aliases"),
            "pools_drained": {n: p.get("drained") for n, p in pools.items()},
        }
    if path == "/admin/keys":
        return {"keys": {k["name"]: _key_state(k) for k in doc.get("keys", [])}}
    raise ValueError(f"no state at {path}")


def fleet_state(
    backends: Mapping[str, Any],
    policy: Mapping[str, Any],
    aliases: Mapping[str, Any],
    keys: Mapping[str, Any],
) -> dict[str, Any]:
    """What the admin changes set, from one replica's ``STATE_PATHS``."""
    out: dict[str, Any] = {}
    for path, doc in zip(STATE_PATHS, (backends, policy, aliases, keys), strict=True):
        out |= state_part(path, doc)
    return out


def _key_state(doc: Mapping[str, Any]) -> dict[str, Any]:
    budget = doc.get("budget")
    kept = {k: v for k, v in doc.items() if k != "budget"}
    if isinstance(budget, dict):
        kept["budget"] = {k: v for k, v in budget.items() if k != "periods"}
    return kept


@dataclass(frozen=True, slots=True)
class LogLoss:
    """One empty restart of Redis beneath the running replicas."""

    at: float  # when Redis was killed
    restarts: int  # empty restarts so far, this one included
    before: tuple[Any, ...]  # each replica's state just before the kill
    after: tuple[Any, ...]  # each replica's state once the log was whole again (None: unread)
    losses: tuple[int | None, ...]  # each replica's /admin/replicas "losses" then
    flagged: tuple[int, ...]  # fleet_log_lost lines each replica logged since the kill
    healed: int  # fleet_log_healed lines the replicas logged since the kill, together
    healed_after: float | None  # seconds from the restart until every replica said "ok"
    spent_before: int | None  # the budget key's spent count (the largest any replica read)
    spent_after: tuple[int | None, ...]  # ... as each replica read it afterwards
    # Each replica's state read again and again from the kill until the log was whole (how
    # many reads), and the reads that found another state than before: (t, replica, fields).
    sampled: tuple[int, ...] = ()
    drifted: tuple[tuple[float, int, str], ...] = ()

    def problems(self) -> list[str]:
        out = []
        if self.healed_after is None:
            out.append("the log was not whole again on every replica")
        if any(s != self.before[0] for s in self.before):
            out.append("the replicas' states differed before the kill")
        if self.drifted:
            t, replica, fields = self.drifted[0]
            who = sorted({r for _, r, _ in self.drifted})
            out.append(
                f"replica(s) {who} showed another state while the log was lost and healed: "
                f"{len(self.drifted)} of {sum(self.sampled)} reads, the first at {t:.2f} s on "
                f"replica {replica} ({fields})"
            )
        changed = [n for n, s in enumerate(self.after) if s != self.before[0]]
        if changed:
            out.append(f"replica(s) {changed}: state after != before ({_diff(self, changed[0])})")
        unflagged = [n for n, k in enumerate(self.losses) if k is None or k < self.restarts]
        if unflagged:
            out.append(f"replica(s) {unflagged}: losses {list(self.losses)} < {self.restarts}")
        silent = [n for n, k in enumerate(self.flagged) if k < 1]
        if silent:
            out.append(f"replica(s) {silent} logged no fleet_log_lost")
        if self.healed != 1:
            out.append(f"healed {self.healed} times (fleet_log_healed), not once")
        if self.spent_before is not None and any(
            s is None or s < self.spent_before for s in self.spent_after
        ):
            out.append(f"a budget's spent {self.spent_before} became {list(self.spent_after)}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at, 2),
            "restarts": self.restarts,
            "losses": list(self.losses),
            "flagged": list(self.flagged),
            "healed": self.healed,
            "healed_after_s": None if self.healed_after is None else round(self.healed_after, 2),
            "spent_before": self.spent_before,
            "spent_after": list(self.spent_after),
            "sampled": list(self.sampled),
            "drifted": [[round(t, 3), r, f] for t, r, f in self.drifted[:EXAMPLES]],
            "same_state": all(s == self.before[0] for s in (*self.before, *self.after)),
            "keys": len((self.before[0] or {}).get("keys", {})) if self.before else 0,
        }


def differs(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> list[str]:
    """The fields of ``fleet_state`` in which ``after`` (all of it, or the part one path tells)
    differs from ``before``."""
    if before is None or after is None:
        return []
    return sorted(k for k in after if before.get(k) != after.get(k))


def drift(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str:
    """How ``after`` differs from ``before`` (empty: it does not), each field's values short."""

    def short(v: Any) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 160 else text[:157] + "..."

    return "; ".join(
        f"{k}: {short((before or {}).get(k))} -> {short((after or {}).get(k))}"
        for k in differs(before, after)
    )


def _diff(loss: LogLoss, replica: int) -> str:
    before, after = loss.before[0], loss.after[replica]
    if before is None or after is None:
        return "unread"
    return "differs in " + ", ".join(differs(before, after))


def check_log_losses(losses: Sequence[LogLoss], planned: int) -> Verdict:
    figures: dict[str, Any] = {"planned": planned, "losses": [x.to_json() for x in losses]}
    if len(losses) < planned:
        why = f"{planned - len(losses)} of {planned} empty restarts not measured"
        return Verdict("lost_log_healed", False, why, figures)
    bad = [f"at {x.at:.0f} s: {'; '.join(p)}" for x in losses if (p := x.problems())]
    if bad:
        return Verdict("lost_log_healed", False, "; ".join(bad), figures)
    if not losses:
        return Verdict("lost_log_healed", True, "no empty restart planned", figures)
    took = ", ".join(f"{x.healed_after:.1f}" for x in losses if x.healed_after is not None)
    why = (
        f"{len(losses)} empty restart(s): flagged by every replica, healed once, whole again "
        f"after {took} s; every replica's state after = before "
        f"({figures['losses'][-1]['keys']} keys), budgets' spent kept"
    )
    return Verdict("lost_log_healed", True, why, figures)


# -- the replicas' logs ---------------------------------------------------------------------


def log_events(text: str) -> list[dict[str, Any]]:
    """The JSON lines of a replica's log, as events (other lines left out)."""
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def count(events: Iterable[Mapping[str, Any]], name: str) -> int:
    return sum(1 for e in events if e.get("event") == name)


def tracebacks(text: str) -> list[str]:
    """The log's lines that carry a traceback: a JSON event with an ``exception``, or Python's
    own print of one."""
    out = []
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            out.append(line)
            continue
        events = log_events(line)
        if events and "exception" in events[0]:
            out.append(line)
    return out


def check_replica_logs(logs: Mapping[str, str], outages: int) -> Verdict:
    """No replica logged a traceback, and none said its views went stale more often than Redis
    was away."""
    found = {name: tracebacks(text) for name, text in logs.items()}
    stale = {name: count(log_events(text), "admin_views_stale") for name, text in logs.items()}
    figures = {
        "replicas": len(logs),
        "tracebacks": {n: len(t) for n, t in found.items()},
        "admin_views_stale": stale,
        "outages": outages,
        "examples": [line[:2000] for lines in found.values() for line in lines][:EXAMPLES],
    }
    problems = [f"{n}: {len(t)} traceback(s)" for n, t in found.items() if t]
    problems += [
        f"{n}: {k} admin_views_stale lines for {outages} Redis outages"
        for n, k in stale.items()
        if k > outages
    ]
    if not logs:
        problems.append("no replica log")
    if problems:
        return Verdict("no_traceback", False, "; ".join(problems), figures)
    why = (
        f"{len(logs)} replica logs, no traceback; admin_views_stale "
        f"{', '.join(str(k) for k in stale.values())} time(s) for {outages} Redis outages"
    )
    return Verdict("no_traceback", True, why, figures)

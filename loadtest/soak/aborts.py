"""Every client that left had its request aborted upstream: the two sides' counts compared.

Pure. The client knows when it left and at which phase (``Observation.left``); the gateways
count the upstream requests they cut (``llm_gateway_upstream_aborts_total`` by reason); the
simulators count the requests their engines dropped (``sim:aborted_requests`` by phase, kept
across a kill from the scrape just before it). ``check_aborts`` says why equality cannot hold
and which bounds must.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from loadtest.soak.faults import BACKEND_FAULTS, FaultWindow
from loadtest.soak.invariants import Verdict
from loadtest.soak.outcomes import Observation


@dataclass(frozen=True, slots=True)
class AbortFigures:
    sim_aborted: float  # sum over simulators, the counts of killed instances included
    sim_aborted_by_phase: Mapping[str, float]
    gateway_aborts: Mapping[str, float]  # llm_gateway_upstream_aborts_total by reason
    gateway_backend_down_retries: float  # llm_gateway_retries_total{reason="BackendDown"}


@dataclass(frozen=True, slots=True)
class ClientLeaving:
    """The client's side of the comparison, from the observations (``client_leaving``)."""

    by_phase: Mapping[str, int]
    total: int  # every client that went away early: on purpose, or its own timeout
    sure: int  # ... after its request surely reached a backend's engine, still running
    near_kills: int  # ... of those, left within seconds of a kill (its count may die too)


def client_leaving(obs: Iterable[Observation], windows: Sequence[FaultWindow]) -> ClientLeaving:
    """Count the clients that left, and those whose request surely was in an engine.

    Sure: a stream's head (the gateway sends it with the first upstream chunk) or a stream cut
    after k of >= 128 tokens; and a non-streamed request left after 0.4-1 s of a >= 128-token
    answer, unless a backend fault was on (it may have been hanging before the engine, or in a
    retry's backoff). Before the head, nobody can tell whether it reached a backend.
    """
    by_phase: Counter[str] = Counter()
    total = sure = near = 0
    kills = [w for w in windows if w.kind == "kill"]
    faults = [w for w in windows if w.kind in BACKEND_FAULTS]
    for o in obs:
        if o.left is None:
            if o.exception in ("timeout", "stall"):
                total += 1
                by_phase["client_timeout"] += 1
            continue
        total += 1
        by_phase[o.left] += 1
        at = o.left_at if o.left_at is not None else o.end
        if o.left in ("after_head", "mid_stream"):
            is_sure = True
        elif o.left == "nonstream_wait":
            is_sure = not any(w.overlaps(o.start, at, 2.0) for w in faults)
        else:
            is_sure = False
        if is_sure:
            sure += 1
            if any(w.start - 1.0 <= at <= w.start + 0.5 for w in kills):
                near += 1
    return ClientLeaving(dict(by_phase), total, sure, near)


def check_aborts(sim: AbortFigures, client: ClientLeaving) -> Verdict:
    """Every client that left had its upstream request aborted.

    Exact equality cannot hold, for reasons that are all one-sided, so the check is two
    bounds per side:

    - gateway: ``sure - near_kills <= G <= total``, G its client_disconnect aborts. Every sure
      leaver had a request the gateway was relaying or waiting on (unless a kill had just cut
      it, and the gateway ended it as an error first); and it never counts one who stayed.
    - simulators: ``sure - near_kills <= S <= G + other + down``, S their aborts.
      A leaver before the head may or may not have reached an engine (so only ``sure`` is
      owed); a count kept by a killed backend after its last scrape is lost (``near_kills``).
      Every abort a backend sees is an upstream request the gateway cut: for a client (G),
      for an error or idle stream (``other``: aborts of other reasons), or because it gave up
      waiting on a backend its probes marked down (``down``: retries with reason BackendDown).
    """
    g = sim.gateway_aborts.get("client_disconnect", 0.0)
    other = sum(v for k, v in sim.gateway_aborts.items() if k != "client_disconnect")
    s = sim.sim_aborted
    owed = client.sure - client.near_kills
    s_high = g + other + sim.gateway_backend_down_retries
    figures = {
        "client_left": dict(client.by_phase),
        "client_left_total": client.total,
        "client_left_surely_in_engine": client.sure,
        "client_left_near_a_kill": client.near_kills,
        "gateway_client_disconnect_aborts": g,
        "gateway_aborts_by_reason": dict(sim.gateway_aborts),
        "gateway_backend_down_retries": sim.gateway_backend_down_retries,
        "sim_aborted": s,
        "sim_aborted_by_phase": dict(sim.sim_aborted_by_phase),
        "gateway_bounds": [owed, client.total],
        "sim_bounds": [owed, s_high],
    }
    problems = []
    if g < owed:
        problems.append(
            f"gateway counted {g:g} client-disconnect aborts < {owed} (sure leavers less near-kill)"
        )
    if g > client.total:
        problems.append(f"gateway counted {g:g} client-disconnect aborts > {client.total} left")
    if s < owed:
        problems.append(f"simulators aborted {s:g} < {owed} (sure leavers less near-kill)")
    if s > s_high:
        problems.append(f"simulators aborted {s:g} > {s_high:g} (every cause counted)")
    if problems:
        return Verdict("aborted_upstream", False, "; ".join(problems), figures)
    why = (
        f"{client.total} left ({client.sure} surely in an engine); gateway {g:g} in "
        f"[{owed}, {client.total}], simulators {s:g} in [{owed}, {s_high:g}]"
    )
    return Verdict("aborted_upstream", True, why, figures)

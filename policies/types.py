"""The routing contract: everything a policy may ask for, is given, returns and is told.

A request reaches a policy in four steps, all plain data:

1. **Needs.** A policy declares, as data (``Needs``), what it wants to know of a request
   beyond its model: the prompt's prefix as block hashes (with the hasher to cut them), a key
   for those hashes that every gateway replica computes alike, the value of a session
   header. The request path computes exactly that and nothing more (``policies.facts``).
2. **Facts.** ``choose`` is handed the request's ``RouteFacts`` and the candidates, frozen
   ``BackendSnapshot``s of the backends that may take it (healthy, serving its model, in the
   pool or role its route allows, not yet tried by this request).
3. **Decision.** It returns a ``Decision`` (or ``None`` to choose none): one of the
   candidates, the prompt's tokens it believed that backend holds (``cached_tokens``: the
   latency tracker learns TTFT against the tokens not cached) and what it assumed until the
   attempt's outcome (``tentative``: its own, read by nobody else).
4. **Outcome.** After each attempt the request path calls ``on_result`` once with the
   ``Decision`` that attempt went under and what really happened (``Outcome``): whether the
   backend answered and produced output, its status, the time to its first token, the tokens
   it generated. A stateful policy learns from this, not from its own choice, and settles
   what the decision assumed; a decision never settled (a request dropped on the way) must
   leave nothing behind that grows.

``weights`` are the load-score weights of policies that score load (``None`` for the others);
operators tune them live, and metrics and the admin API show the scores they give.

Beyond that, a policy may offer **capabilities** (``policies.capabilities``).
Nothing here does I/O or knows about aiohttp; the pool builds snapshots, a policy reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from policies.setting import check_settings, spec

if TYPE_CHECKING:
    from policies.prefix import PrefixHasher


@dataclass(frozen=True, slots=True)
class Weights:
    """Weights of each load signal in the score; ops tune them live."""

    active: float = field(
        default=2.0, metadata=spec("score weight of each request in flight", ge=0)
    )
    queue: float = field(
        default=3.0, metadata=spec("score weight of each request queued in the engine", ge=0)
    )
    kv: float = field(
        default=0.0, metadata=spec("score weight of the engine's KV-cache usage (0..1)", ge=0)
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """A backend's load at one instant, as the gateway knows it.

    ``queue_depth``, ``running`` and ``kv_cache_usage`` are ``None`` when no scraped figure
    younger than the staleness bound exists: a policy then falls back to the local counts.
    ``sent_since_scrape`` counts requests the gateway sent after the last scrape began, which
    the scraped figures cannot include yet.
    """

    id: str
    in_flight: int
    sent_since_scrape: int = 0
    queue_depth: int | None = None
    running: int | None = None
    kv_cache_usage: float | None = None

    @property
    def scraped(self) -> bool:
        return self.queue_depth is not None


@dataclass(frozen=True, slots=True)
class Decision:
    """What ``choose`` decided for one attempt, handed back to ``on_result`` with its outcome.

    ``cached_tokens``: the prompt's tokens the policy believed ``backend`` holds when it chose
    it (0: it does not say). ``tentative``: the policy's own record of what it assumed until the
    outcome (a prefix it credited ``backend`` with), opaque to everyone else; a policy that
    delegates to another keeps the inner policy's decision in it, to hand back on settling.
    """

    backend: BackendSnapshot
    cached_tokens: float = 0.0
    tentative: object | None = None


@dataclass(frozen=True, slots=True)
class Needs:
    """What a policy asks to know of a request beyond its model (nothing, by default)."""

    prefix: PrefixHasher | None = None  # cut the prompt into block hashes this way
    prefix_key: bool = False  # also the prompt's replica-stable key (needs ``prefix``)
    session_header: str | None = None  # the value of this request header
    tokens: bool = False  # the prompt's token ids, as the model's tokenizer gives them
    size: bool = False  # the prompt's size in characters and the answer's token budget


NO_NEEDS = Needs()


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What a policy is told about the request being routed: its model and its ``Needs``."""

    model: str
    session_key: str | None = None
    prefix_hashes: tuple[int, ...] = field(default=())
    prefix_key: int | None = None  # the same in every gateway replica (``prefix.stable_key``)
    # The prompt's token ids (``Needs.tokens``); None when the model has no tokenizer or the
    # request cannot be tokenized faithfully (several prompts, images, ...).
    prompt_tokens: tuple[int, ...] | None = None
    # ``Needs.size``: the prompt's characters (its text, or four per token id) and the
    # answer's budget (``max_tokens`` / ``max_completion_tokens``; None when not given).
    prompt_chars: int = 0
    max_tokens: int | None = None
    # What the request's caller wants fastest: "ttft" or "e2e" (None: the policy's own).
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt on the chosen backend ended, as the gateway saw it.

    ``ok``: the backend answered 2xx and gave its answer (the whole body, or a stream that the
    backend did not cut). ``error`` names what went wrong otherwise: ``unreachable`` (no
    connection, or lost before an answer), ``down`` (its probes marked it down while the
    request waited), ``timeout``, ``refused`` (429/502/503/504), ``protocol``, ``status``
    (another 4xx/5xx), ``stream`` (cut mid-answer), ``abandoned`` (the client left first).
    """

    ok: bool
    status: int = 0  # 0: no status line arrived
    error: str | None = None
    first_token_s: float | None = None  # from sending the request to its first token
    tokens: int | None = None  # completion tokens, when the backend reported usage
    duration_s: float = 0.0


class Policy(Protocol):
    """Decides on one of the candidates (or ``None``) and hears how each attempt went."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> Needs: ...

    @property
    def weights(self) -> Weights | None: ...

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None: ...

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None: ...


class Rng(Protocol):
    """The part of ``random.Random`` a policy uses, so tests can inject a seeded one."""

    def random(self) -> float: ...

    def randrange(self, stop: int, /) -> int: ...

"""Model pools and aliases: which pool answers a request for a public model name.

A pool is a named group of backends serving one model (one version of it). An alias is a
public model name split between pools by weight (``policies.rollout``). The request path asks
``Rollout.resolve`` once per request; the admin API and a reload change the weights, drain a
pool or roll an alias back to its previous weights (a progressive rollout, all its steps, is
one change: its previous weights are those before it began). A change takes effect on the
next request: one already routed stays on its pool until it ends. Every change is validated
first (a bad one changes nothing) and logged with the old and new weights.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from backends.errors import InvalidRequest, NoBackendAvailable, NotFound
from gateway.config.settings import Settings
from policies import Rng
from policies.rollout import WeightsError, check_weights, choose_pool

log = structlog.get_logger("gateway.request.rollout")


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    model: str  # the name the backends serve, sent upstream
    backends: frozenset[str]  # backend ids
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one request goes: the alias the client asked for and the pool chosen for it."""

    alias: str
    pool: Pool
    # In the answer, the pool's model name becomes the alias again (None: same name).
    rename: tuple[bytes, bytes] | None


def _model_field(name: str) -> bytes:
    return b'"model":' + json.dumps(name).encode()


def _pools(settings: Settings) -> dict[str, Pool]:
    ids = {b.url: b.id for b in settings.backends} | {b.id: b.id for b in settings.backends}
    return {
        p.name: Pool(p.name, p.model, frozenset(ids[r] for r in p.backends), dict(p.labels))
        for p in settings.pools
    }


class Rollout:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        aliases: Mapping[str, Mapping[str, float]],
        *,
        sticky_header: str | None = None,
        expose_pools: bool = False,
        rng: Rng | None = None,
    ) -> None:
        self.pools = dict(pools)
        self.aliases = {a: dict(w) for a, w in aliases.items()}
        self.previous: dict[str, dict[str, float]] = {}
        self.drained: set[str] = set()
        self.sticky_header = sticky_header
        self.expose_pools = expose_pools
        self._rng: Rng = rng or random.Random()

    @classmethod
    def from_settings(cls, settings: Settings, rng: Rng | None = None) -> Rollout:
        r = settings.rollout
        made = cls(
            _pools(settings),
            settings.aliases,
            sticky_header=r.sticky_header,
            expose_pools=r.expose_pools,
            rng=rng,
        )
        made.drained = {p.name for p in settings.pools if p.drain}
        return made

    def pairs(self) -> list[tuple[str, str]]:
        """Every (alias, pool) the configuration routes, for the per-pool metrics."""
        return [(alias, pool) for alias, weights in self.aliases.items() for pool in weights]

    def names(self) -> list[str]:
        """The model names clients may use beyond the backends' own."""
        return sorted(set(self.aliases) | (set(self.pools) if self.expose_pools else set()))

    def resolve(
        self,
        model: str,
        headers: Mapping[str, str],
        usable: Callable[[Pool], bool] = lambda pool: True,
    ) -> Choice | None:
        """The pool for a request naming ``model``; None if it is no alias or exposed pool.

        A pool that is not ``usable`` now (no backend of it can take a request) is passed over
        while another pool of the alias is, as a drained one is: a canary whose only backend
        died does not fail its share of the traffic. Sticky sessions come back to it when it
        recovers (rendezvous hashing over the pools left).
        """
        weights = self.aliases.get(model)
        if weights is None:
            if not (self.expose_pools and model in self.pools):
                return None
            name = model
        else:
            if self.drained:
                weights = {p: 0.0 if p in self.drained else w for p, w in weights.items()}
            key = headers.get(self.sticky_header) if self.sticky_header else None
            live = {p: w if w > 0 and usable(self.pools[p]) else 0.0 for p, w in weights.items()}
            chosen = choose_pool(live, key, self._rng) or choose_pool(weights, key, self._rng)
            if chosen is None:
                raise NoBackendAvailable(f"Every pool serving `{model}` is drained.", retry_after=1)
            name = chosen
        pool = self.pools[name]
        rename = None
        if pool.model != model:
            rename = (_model_field(pool.model), _model_field(model))
        return Choice(model, pool, rename)

    # -- changes (admin API, reload) -------------------------------------------------------

    def describe(self, alias: str) -> dict[str, Any]:
        weights = self.aliases.get(alias)
        if weights is None:
            raise NotFound(f"No alias {alias!r}.")
        return {
            "alias": alias,
            "weights": weights,
            "previous": self.previous.get(alias),
            "drained": sorted(self.drained & set(weights)),
            "sticky_header": self.sticky_header,
        }

    def checked_weights(self, alias: str, weights: Any) -> dict[str, float]:
        """``weights`` as ``set_weights`` would set them; ``InvalidRequest`` if bad."""
        if not isinstance(weights, dict):
            raise InvalidRequest("The body must be a JSON object of pool: weight.")
        try:
            return check_weights(weights, self.pools.keys())
        except WeightsError as exc:
            raise InvalidRequest(f"Invalid weights for {alias!r}: {exc}.") from exc

    def set_weights(self, alias: str, weights: Any, *, undoable: bool = True) -> dict[str, Any]:
        """Set (or create) an alias's weights; ``InvalidRequest`` and no change if bad.
        ``undoable``: the weights replaced become the ``previous`` a rollback goes back to
        (False: a progressive rollout's step, promotion or abort, which keep the split from
        before the rollout began)."""
        new = self.checked_weights(alias, weights)
        old = self.aliases.get(alias)
        if old is not None and undoable:
            self.previous[alias] = old
        self.aliases[alias] = new
        log.info("alias_weights_changed", alias=alias, old=old, new=new)
        return self.describe(alias)

    def check_rollback(self, alias: str) -> dict[str, float]:
        """The weights a rollback of ``alias`` goes back to; ``NotFound``/``InvalidRequest``."""
        self.describe(alias)  # 404 if unknown
        previous = self.previous.get(alias)
        if previous is None:
            raise InvalidRequest(f"Alias {alias!r} has no previous weights to roll back to.")
        return previous

    def rollback(self, alias: str) -> dict[str, Any]:
        """Back to the weights in force before the last change (one step; again undoes it)."""
        previous = self.check_rollback(alias)
        old = self.aliases[alias]
        self.aliases[alias], self.previous[alias] = previous, old
        log.warning("alias_rolled_back", alias=alias, old=old, new=previous)
        return self.describe(alias)

    def check_drain(self, pool: str, drained: bool) -> None:
        """``NotFound`` or ``InvalidRequest`` if ``set_drained`` would refuse."""
        if pool not in self.pools:
            raise NotFound(f"No pool {pool!r}.")
        if drained:
            for alias, weights in self.aliases.items():
                left = [p for p, w in weights.items() if w > 0 and p not in self.drained | {pool}]
                if not left:
                    raise InvalidRequest(f"Draining {pool!r} would leave {alias!r} no pool.")

    def set_drained(self, pool: str, drained: bool) -> dict[str, Any]:
        """A drained pool gets no new requests through its aliases; in-flight ones finish."""
        self.check_drain(pool, drained)
        if drained:
            self.drained.add(pool)
        else:
            self.drained.discard(pool)
        log.info("pool_drain_changed", pool=pool, drained=drained)
        p = self.pools[pool]
        return {"pool": pool, "model": p.model, "labels": dict(p.labels), "drained": drained}

    def state(self) -> dict[str, Any]:
        """What changes at run time (for a fleet's snapshot): weights, history, drains."""
        return {
            "aliases": self.aliases,
            "previous": self.previous,
            "drained": sorted(self.drained),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take ``state()`` of another replica; pools this one does not know are left out."""
        known = self.pools.keys()

        def kept(table: Any) -> dict[str, dict[str, float]]:
            return {
                str(alias): {str(p): float(w) for p, w in weights.items()}
                for alias, weights in dict(table).items()
                if set(weights) <= known
            }

        self.aliases = kept(state.get("aliases", {}))
        self.previous = kept(state.get("previous", {}))
        self.drained = {str(p) for p in state.get("drained", ())} & known

    def reconfigure(self, settings: Settings, owned: Collection[str] = ()) -> None:
        """Take pools and aliases from a reloaded (already validated) configuration; the
        aliases in ``owned`` (a progressive rollout under way moves them) keep the weights
        they have, while their pools remain."""
        fresh = Rollout.from_settings(settings, self._rng)
        for alias in owned:
            now = self.aliases.get(alias)
            if now is not None and alias in fresh.aliases and set(now) <= fresh.pools.keys():
                fresh.aliases[alias] = now
        for alias, new in fresh.aliases.items():
            old = self.aliases.get(alias)
            if old is not None and old != new:
                fresh.previous[alias] = old
                log.info("alias_weights_changed", alias=alias, old=old, new=new, by="reload")
            elif alias in self.previous:
                fresh.previous[alias] = self.previous[alias]
        # A pool drained now stays so; one the file adds starts as the file says.
        fresh.drained = (self.drained & fresh.pools.keys()) | (fresh.drained - self.pools.keys())
        self.pools, self.aliases, self.previous = fresh.pools, fresh.aliases, fresh.previous
        self.drained = fresh.drained
        self.sticky_header, self.expose_pools = fresh.sticky_header, fresh.expose_pools

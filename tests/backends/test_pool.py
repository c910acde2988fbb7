"""The pool's bookkeeping: leases, snapshots, staleness, removal."""

from __future__ import annotations

import pytest

from backends.errors import EndpointNotServed, ModelNotFound, NoBackendAvailable
from backends.health import Health
from backends.pool import BackendPool
from backends.state import BackendSpec
from backends.vllm_metrics import LoadReading


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_with(*ids: str, clock: Clock | None = None) -> BackendPool:
    pool = BackendPool(
        [BackendSpec(id=i, url=f"http://{i}") for i in ids], stale_after=2.0, clock=clock or Clock()
    )
    for i in ids:
        pool.record_probe(i, True)
        pool.record_models(i, ["m"])
    return pool


def test_lease_counts_in_flight_and_releases_exactly_once() -> None:
    pool = pool_with("a")
    lease = pool.acquire("a")
    b = pool.get("a")
    assert b is not None
    assert b.in_flight == 1
    lease.release()
    lease.release()
    assert b.in_flight == 0
    assert b.sent_total == 1


def test_snapshot_uses_fresh_scrapes_only_and_counts_what_was_sent_since() -> None:
    clock = Clock()
    pool = pool_with("a", clock=clock)
    b = pool.get("a")
    assert b is not None
    leases = [pool.acquire("a") for _ in range(3)]
    pool.record_load("a", LoadReading(5, 2, 0.5), began_at=clock.now, sent_at_start=1)
    snap = pool.snapshot(b, clock.now)
    assert (snap.queue_depth, snap.running, snap.kv_cache_usage) == (5, 2, 0.5)
    assert snap.sent_since_scrape == 2  # two of the three were sent after the scrape began
    leases[2].release()
    leases[1].release()
    # Finished requests are in no queue: the count is capped by what is still in flight.
    assert pool.snapshot(b, clock.now).sent_since_scrape == 1
    clock.now += 2.5
    stale = pool.snapshot(b, clock.now)
    assert stale.queue_depth is None
    assert stale.sent_since_scrape == 0
    assert stale.in_flight == 1
    leases[0].release()


def test_candidates_unknown_model_no_routable_and_exclusion() -> None:
    pool = pool_with("a", "b")
    with pytest.raises(ModelNotFound):
        pool.candidates("nope")
    assert {s.id for s in pool.candidates("m", exclude={"a"})} == {"b"}
    pool.set_draining("b", True)
    with pytest.raises(NoBackendAvailable):
        pool.candidates("m", exclude={"a"})
    pool.record_probe("a", False)
    pool.record_probe("a", False)
    pool.record_probe("a", False)
    assert pool.get("a").health.state is Health.DOWN  # type: ignore[union-attr]
    with pytest.raises(NoBackendAvailable):
        pool.candidates("m")


def test_removed_backend_is_forgotten_only_after_its_last_request() -> None:
    pool = pool_with("a", "b")
    lease = pool.acquire("a")
    pool.remove("a")
    assert pool.get("a") is not None
    assert {s.id for s in pool.candidates("m")} == {"b"}
    lease.release()
    assert pool.get("a") is None
    assert pool.models() == ["m"]
    pool.remove("b")
    assert pool.models() == []


def test_a_backend_that_lacks_an_endpoint_is_left_out_of_it_until_it_may_have_changed() -> None:
    pool = pool_with("gen", "emb")
    pool.record_lacks("gen", "embeddings")
    pool.record_lacks("emb", "chat")
    ids = lambda endpoint: [s.id for s in pool.candidates("m", endpoint=endpoint)]  # noqa: E731
    assert ids("embeddings") == ["emb"]
    assert ids("chat") == ["gen"]
    assert sorted(ids(None)) == ["emb", "gen"]  # no endpoint named: every backend
    pool.record_lacks("emb", "embeddings")
    with pytest.raises(EndpointNotServed):  # not "unavailable now": no backend has it at all
        pool.candidates("m", endpoint="embeddings")
    # A new model list (a restart as the other kind of server, say) forgets what it lacked.
    pool.record_models("emb", ["m", "m-lora"])
    assert ids("embeddings") == ["emb"]
    assert ids("chat") == ["emb", "gen"] or ids("chat") == ["gen", "emb"]
    # So does coming back up after being down.
    for _ in range(5):
        pool.record_probe("gen", False, "down")
    assert pool.get("gen").health.state is Health.DOWN  # type: ignore[union-attr]
    for _ in range(5):
        pool.record_probe("gen", True)
    assert pool.get("gen").lacks == frozenset()  # type: ignore[union-attr]
    assert sorted(ids("embeddings")) == ["emb", "gen"]

"""The fleet's change log, the same contract on a real Redis and in files (the workers of one
host without Redis): order, durability across clients, readers that were away, compaction that
never opens a gap, two compactors at once, a reader woken by an append."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from backends.errors import InvalidRequest
from gateway.fleet.changes import Batch, Change, Known, Position, Snapshot, behind, change_id
from gateway.fleet.files import FileLog
from gateway.fleet.log import Appended, AppendRefused, ChangeLog, LogKeys, RedisLog

EPOCH = "0000000000001-test"

Open = Callable[[str], ChangeLog]  # a fleet's log, as one more client (replica, worker) sees it


@pytest.fixture(params=["redis", "files"])
async def open_log(
    request: pytest.FixtureRequest, redis_prefix: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[Open]:
    """Each call: another client of the same store (its own connection, or its own FileLog)."""
    clients: list[Redis] = []

    def redis_log(fleet: str) -> ChangeLog:
        client = Redis.from_url(redis_url, socket_timeout=5.0)
        clients.append(client)
        return RedisLog(client, LogKeys.of(redis_prefix, fleet))

    def file_log(fleet: str) -> ChangeLog:
        return FileLog(tmp_path / "fleet", fleet, poll=0.005)

    try:
        yield redis_log if request.param == "redis" else file_log
    finally:
        for c in clients:
            await c.aclose()


def drain(i: int, *, replica: str = "r0", cid: str | None = None) -> Change:
    return Change(
        "POST",
        f"/admin/backends/b{i}/drain",
        replica=replica,
        caller="ops",
        at=1.0,
        id=change_id(cid),
        fingerprint=f"fp{i}",
    )


async def put(log: ChangeLog, change: Change) -> Position:
    """Appended as a replica of the log's epoch appends (the epoch given first, if none)."""
    got = await log.append(change, epoch=await log.establish(EPOCH))
    assert isinstance(got, Appended), got
    assert got.new
    return got.position


async def everything(log: ChangeLog, applied: Position | None = None) -> Batch:
    """What a reader at ``applied`` would apply, in batches of 2 (so paging is exercised)."""
    first = await log.after(applied, count=2)
    entries = list(first.entries)
    at = first.last or applied
    while True:
        more = await log.after(at, count=2)
        assert more.snapshot is None  # only the first batch may start from a snapshot
        if not more.entries:
            return Batch(first.snapshot, entries)
        entries += more.entries
        at = more.last


def test_positions_order_as_the_stream_ids_do() -> None:
    assert Position.parse("5-0") < Position.parse("5-1") < Position.parse(b"6-0")
    assert Position.parse("12-3") > Position.parse("9-99")  # numbers, not text
    assert str(Position.parse("7-2").next()) == "7-3"
    for bad in ("x-1", "1-y", "-1-0", ""):
        with pytest.raises(InvalidRequest):
            Position.parse(bad)


def test_a_change_survives_its_encoding_and_an_unreadable_one_is_refused() -> None:
    c = Change(
        "PUT", "/admin/policy?x=1", b'{"policy": "p2c"}', replica="r1", caller="ops", at=3.5,
        old={"policy": "round_robin"}, new={"policy": "p2c"}, labels={"ticket": "OPS-1"},
    )  # fmt: skip
    fields = {k.encode(): v.encode() for k, v in c.encode().items()}
    assert Change.decode(fields) == c
    assert "body" not in c.describe(Position(1, 0))
    with pytest.raises(InvalidRequest):
        Change.decode({b"change": b'{"method": "POST"}'})
    with pytest.raises(InvalidRequest):
        Change.decode({b"other": b"1"})


def test_a_replica_starts_from_the_snapshot_only_when_behind_it() -> None:
    snap = Snapshot(Position(10, 0), {})
    assert behind(snap, None)
    assert behind(snap, Position(9, 5))
    assert not behind(snap, Position(10, 0))
    assert not behind(None, None)


async def test_changes_come_back_in_the_order_appended_to_any_reader(open_log: Open) -> None:
    log = open_log("f")
    positions = [await put(log, drain(i)) for i in range(5)]
    assert positions == sorted(positions)
    assert len(set(positions)) == 5
    assert await log.head() == positions[-1]
    got = await everything(open_log("f"))  # another replica's client
    assert got.snapshot is None
    assert [p for p, _ in got.entries] == positions
    assert [c.path for _, c in got.entries] == [f"/admin/backends/b{i}/drain" for i in range(5)]
    later = await log.after(positions[2])
    assert [p for p, _ in later.entries] == positions[3:]


async def test_two_fleets_share_one_store_apart(open_log: Open) -> None:
    a, b = open_log("a"), open_log("b")
    await put(a, drain(1))
    assert (await b.after(None)).entries == []
    assert await b.head() is None


async def test_a_reader_that_was_away_while_the_log_was_compacted_starts_from_the_snapshot(
    open_log: Open,
) -> None:
    log = open_log("f")
    p = [await put(log, drain(i)) for i in range(6)]
    assert await log.compact(Snapshot(p[3], {"drained": ["b0", "b1", "b2", "b3"]}), None)
    assert await log.extent() == (2, p[3])  # what follows the snapshot, nothing more
    for applied in (None, p[0], p[2]):  # behind the snapshot: it comes first
        got = await everything(log, applied)
        assert got.snapshot == Snapshot(p[3], {"drained": ["b0", "b1", "b2", "b3"]})
        assert [q for q, _ in got.entries] == p[4:]
    got = await everything(log, p[4])  # past it: entries only
    assert got.snapshot is None
    assert [q for q, _ in got.entries] == p[5:]
    assert await log.head() == p[5]


async def test_of_two_compactions_from_the_same_snapshot_one_wins(open_log: Open) -> None:
    log = open_log("f")
    p = [await put(log, drain(i)) for i in range(4)]
    assert await log.compact(Snapshot(p[1], {"n": 2}), None)
    # Both read the snapshot at p[1]; the second would trim what only the first's covers.
    first, second = await asyncio.gather(
        log.compact(Snapshot(p[3], {"n": 4}), p[1]),
        open_log("f").compact(Snapshot(p[2], {"n": 3}), p[1]),
    )
    assert sorted([first, second]) == [False, True]
    got = await everything(log)
    state, last = (got.snapshot.state, got.snapshot.position) if got.snapshot else ({}, None)
    # Whichever won, snapshot plus entries cover every change once.
    assert state["n"] + len(got.entries) == 4
    assert [q for q, _ in got.entries] == [q for q in p if last is None or q > last]


async def test_a_compacted_log_keeps_its_head_and_a_waiting_reader_wakes_on_append(
    open_log: Open,
) -> None:
    log = open_log("f")
    p = await put(log, drain(0))
    assert await log.compact(Snapshot(p, {"n": 1}), None)
    assert await log.head() == p  # the log is empty, its position is not lost
    assert await log.wait(p, block=0.001) is False
    waiting = asyncio.create_task(open_log("f").wait(p, block=30.0))
    q = await put(log, drain(1))
    assert await waiting is True
    assert q > p
    assert [x for x, _ in (await log.after(p)).entries] == [q]
    assert [x for x, _ in await log.recent(5)] == [q]


async def test_the_recent_changes_come_newest_first(open_log: Open) -> None:
    log = open_log("f")
    p = [await put(log, drain(i)) for i in range(4)]
    recent = await log.recent(3)
    assert [x for x, _ in recent] == p[:0:-1]
    assert recent[0][1].path == "/admin/backends/b3/drain"


async def test_in_files_a_line_cut_short_by_a_crash_is_passed_over_and_cut_off(
    tmp_path: Path,
) -> None:
    log = FileLog(tmp_path, "f")
    p = await put(log, drain(0))
    log.path.write_bytes(log.path.read_bytes() + b'{"position": "99')  # a writer died mid-line
    assert [x for x, _ in (await log.after(None)).entries] == [p]
    q = await put(log, drain(1))
    assert [x for x, _ in (await log.after(None)).entries] == [p, q]
    assert log.path.read_bytes().count(b"\n") == 2
    assert oct(os.stat(log.path).st_mode & 0o777) == "0o600"  # bodies are for this user only


async def test_an_id_appended_once_is_found_and_a_repeat_is_not_appended_again(
    open_log: Open,
) -> None:
    log = open_log("f")
    first = drain(1, cid="op-1")
    p = await put(log, first)
    again = await open_log("f").append(first, epoch=EPOCH)  # a retry, through another replica
    assert again == Appended(Known(p, "fp1"), new=False)
    assert (await log.find("op-1")).known == Known(p, "fp1")
    assert len((await everything(log)).entries) == 1
    assert (await log.find("never-sent")).known is None


async def test_a_fenced_id_refuses_the_append_still_on_its_way_and_a_new_attempt_goes_in(
    redis: Redis, redis_prefix: str
) -> None:
    """A look at a change's fate that finds it absent fences its id: an append of that
    attempt arriving later is refused, so "not applied" stays true; a repeat names the new
    generation and goes in, once."""
    log = RedisLog(redis, LogKeys.of(redis_prefix, "f"))
    await log.establish(EPOCH)
    fenced = await log.fence("op-2")
    assert fenced.known is None
    assert fenced.generation == 1
    late = await log.append(drain(2, cid="op-2"), epoch=EPOCH, attempt=0)
    assert late == AppendRefused(fenced=1)
    assert (await log.after(None)).entries == []
    retried = await log.append(drain(2, cid="op-2"), epoch=EPOCH, attempt=1)
    assert isinstance(retried, Appended)
    assert retried.new
    assert (await log.fence("op-2")).known == retried.known  # in the log: fencing changes nothing
    assert len((await log.after(None)).entries) == 1


async def test_an_append_under_another_epoch_is_refused_and_heal_starts_the_log_again(
    open_log: Open,
) -> None:
    log = open_log("f")
    p = [await put(log, drain(i, cid=f"c{i}")) for i in range(3)]
    assert await log.append(drain(9), epoch="0000000000000-old") == AppendRefused(epoch=EPOCH)
    state = Snapshot(p[1], {"drained": ["b0", "b1"]}, {"c0": Known(p[0], "fp0")})
    assert not await log.heal("0000000000000-old", "0000000000002-new", state)  # not the seen
    assert await log.heal(EPOCH, "0000000000002-new", state)
    got = await log.after(None)
    assert (got.epoch, got.head, got.snapshot, got.entries) == (
        "0000000000002-new",
        p[1],
        state,
        [],
    )
    assert (await log.find("c0")).known == Known(p[0], "fp0")  # the snapshot's ids come back
    q = await log.append(drain(5), epoch="0000000000002-new")
    assert isinstance(q, Appended)
    assert q.position > p[1]

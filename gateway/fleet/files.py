"""The fleet's change log and registry in a directory: for the workers of one host that share
no Redis (``serve --workers``), or one gateway whose run-time changes must outlive it
(``fleet.dir``). The same ``ChangeLog`` and ``Registry`` as on Redis, so every worker applies
every admin change once, in one order, through the same follower.

Under the directory, for a fleet named ``<fleet>``:

- ``<fleet>.log``: one JSON line a change, ``{"position": "<ms>-<seq>", "change": ...}``.
- ``<fleet>.snapshot``: ``{"position": ..., "state": ..., "ids": ...}`` once the log was
  compacted (or healed).
- ``<fleet>.epoch``: the log's identity (``gateway.fleet.epoch``); an append names it.
- ``<fleet>.lock``: ``flock``, exclusive to append or compact, shared to read. The kernel's
  lock orders the writers (and dies with its holder): no locking of ours.
- ``<fleet>.replicas/<id>.json``: each process's last report; one older than the TTL is gone.

Positions are made as Redis makes stream ids: the time in ms and a sequence, always after the
last. An append is on disk (``fsync``) before it answers. Compaction writes the new snapshot and
the new log beside the old and moves each into place (``os.replace``), so a crash leaves one or
the other; a line a crash cut short is passed over, and cut off by the next append. A reader
waits by looking at the log file's size and identity every ``poll`` s: local and cheap. The
file work runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import quote

from gateway.fleet.changes import Batch, Change, Known, Position, Snapshot, behind
from gateway.fleet.log import Appended, AppendRefused, FateUnknown, IdState, NotAppended
from gateway.fleet.registry import Report, check_ttl

POLL_S: Final = 0.02
_SEPARATORS: Final = (",", ":")


@dataclass(frozen=True, slots=True)
class _Read:
    snapshot: Snapshot | None
    entries: list[tuple[Position, Change]]
    whole: int  # bytes of the log up to its last whole line
    epoch: str | None

    @property
    def head(self) -> Position | None:
        if self.entries:
            return self.entries[-1][0]
        return None if self.snapshot is None else self.snapshot.position

    def known(self, change_id: str) -> Known | None:
        for position, change in reversed(self.entries):
            if change.id == change_id:
                return Known(position, change.fingerprint)
        return None if self.snapshot is None else self.snapshot.ids.get(change_id)


def _write_new(path: Path, data: bytes, *, durable: bool = True) -> None:
    """``path`` holds ``data``, whole, or what it held before (a crash between)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class FileLog:
    def __init__(self, directory: Path, fleet: str, *, poll: float = POLL_S) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / f"{fleet}.log"
        self.snapshot_path = directory / f"{fleet}.snapshot"
        self.epoch_path = directory / f"{fleet}.epoch"
        self._lock = directory / f"{fleet}.lock"
        self.poll = poll

    # -- the files, under the lock (in a thread) -------------------------------------------

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self._lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # and with it the lock

    def _read(self) -> _Read:
        snapshot = None
        with contextlib.suppress(FileNotFoundError):
            doc = json.loads(self.snapshot_path.read_bytes())
            snapshot = Snapshot.decode(doc["position"], doc["state"], doc.get("ids"))
        epoch = None
        with contextlib.suppress(FileNotFoundError):
            epoch = self.epoch_path.read_text().strip() or None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        whole = data.rfind(b"\n") + 1
        entries = []
        for line in data[:whole].splitlines():
            doc = json.loads(line)
            entries.append((Position.parse(doc["position"]), Change.decode(doc)))
        return _Read(snapshot, entries, whole, epoch)

    def _append(self, change: Change, epoch: str) -> Appended | AppendRefused:
        with self._locked(exclusive=True):
            read = self._read()
            if read.epoch != epoch:
                return AppendRefused(epoch=read.epoch)
            if change.id and (known := read.known(change.id)) is not None:
                return Appended(known, new=False)
            now, last = Position(time.time_ns() // 1_000_000), read.head
            position = now if last is None or now > last else last.next()
            line = {"position": str(position), **change.encode()}
            data = json.dumps(line, separators=_SEPARATORS).encode() + b"\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                if os.fstat(fd).st_size > read.whole:  # a line a crash cut short
                    os.ftruncate(fd, read.whole)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                except OSError as exc:  # perhaps written, perhaps read already by another
                    raise FateUnknown(str(exc)) from exc
            finally:
                os.close(fd)
            return Appended(Known(position, change.fingerprint), new=True)

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        doc = {
            "position": str(snapshot.position),
            "state": snapshot.encode(),
            "ids": snapshot.encode_ids(),
        }
        _write_new(self.snapshot_path, json.dumps(doc, separators=_SEPARATORS).encode())

    def _establish(self, epoch: str) -> str:
        with self._locked(exclusive=True):
            current = self._read().epoch
            if current is None:
                _write_new(self.epoch_path, epoch.encode())
                return epoch
            return current

    def _heal(self, seen: str | None, epoch: str, snapshot: Snapshot | None) -> bool:
        with self._locked(exclusive=True):
            if self._read().epoch != seen:
                return False
            self.snapshot_path.unlink(missing_ok=True)
            if snapshot is not None:
                self._write_snapshot(snapshot)
            _write_new(self.path, b"")
            _write_new(self.epoch_path, epoch.encode())
            return True

    def _compact(self, snapshot: Snapshot, replaces: Position | None) -> bool:
        with self._locked(exclusive=True):
            read = self._read()
            if (None if read.snapshot is None else read.snapshot.position) != replaces:
                return False
            self._write_snapshot(snapshot)
            kept = b"".join(
                json.dumps({"position": str(p), **c.encode()}, separators=_SEPARATORS).encode()
                + b"\n"
                for p, c in read.entries
                if p > snapshot.position
            )
            _write_new(self.path, kept)
            return True

    def _reading(self) -> _Read:
        with self._locked(exclusive=False):
            return self._read()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    # -- ChangeLog ------------------------------------------------------------------------

    async def append(
        self, change: Change, *, epoch: str, attempt: int = 0
    ) -> Appended | AppendRefused:
        try:
            return await asyncio.to_thread(self._append, change, epoch)
        except OSError as exc:  # before anything was written (``FateUnknown`` after)
            raise NotAppended(str(exc)) from exc

    async def find(self, change_id: str) -> IdState:
        return IdState((await asyncio.to_thread(self._reading)).known(change_id))

    async def fence(self, change_id: str) -> IdState:
        """As ``find``: an append holds the lock until it is on disk, none is ever on its way."""
        return await self.find(change_id)

    async def establish(self, epoch: str) -> str:
        return await asyncio.to_thread(self._establish, epoch)

    async def heal(self, seen: str | None, epoch: str, snapshot: Snapshot | None) -> bool:
        return await asyncio.to_thread(self._heal, seen, epoch, snapshot)

    async def head(self) -> Position | None:
        return (await asyncio.to_thread(self._reading)).head

    async def extent(self) -> tuple[int, Position | None]:
        read = await asyncio.to_thread(self._reading)
        return len(read.entries), None if read.snapshot is None else read.snapshot.position

    async def after(self, applied: Position | None, *, count: int = 256) -> Batch:
        read = await asyncio.to_thread(self._reading)
        snapshot = read.snapshot if behind(read.snapshot, applied) else None
        floor = snapshot.position if snapshot is not None else applied
        entries = [(p, c) for p, c in read.entries if floor is None or p > floor]
        return Batch(snapshot, entries[:count], read.epoch, read.head)

    async def recent(self, count: int) -> list[tuple[Position, Change]]:
        read = await asyncio.to_thread(self._reading)
        return read.entries[::-1][:count]

    async def wait(self, applied: Position | None, block: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block
        seen = self._stamp()  # before the look at the head: an append after it changes it
        head = await self.head()
        if head is not None and (applied is None or head > applied):
            return True
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(self.poll, left))  # sleep-ok: the poll of a local file
            if self._stamp() != seen:
                return True
        return False

    async def compact(self, snapshot: Snapshot, replaces: Position | None) -> bool:
        return await asyncio.to_thread(self._compact, snapshot, replaces)


class FileRegistry:
    def __init__(
        self,
        directory: Path,
        fleet: str,
        ttl: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl = check_ttl(ttl)
        self.dir = directory / f"{fleet}.replicas"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._clock = clock

    def _file(self, replica: str) -> Path:
        return self.dir / f"{quote(replica, safe='')}.json"

    def _list(self) -> list[Report]:
        now, reports = self._clock(), []
        for path in sorted(self.dir.glob("*.json")):
            try:
                report = Report.decode(path.read_bytes())
            except FileNotFoundError:  # it left meanwhile
                continue
            if now - report.reported_at > self.ttl:
                path.unlink(missing_ok=True)
                continue
            reports.append(report)
        return sorted(reports, key=lambda r: r.id)

    async def report(self, report: Report) -> None:
        data = report.encode().encode()
        await asyncio.to_thread(_write_new, self._file(report.id), data, durable=False)

    async def leave(self, replica: str) -> None:
        self._file(replica).unlink(missing_ok=True)

    async def replicas(self) -> list[Report]:
        return await asyncio.to_thread(self._list)

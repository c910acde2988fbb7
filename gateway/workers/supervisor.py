"""``llm-gateway serve --workers N``: N gateway processes on one port, one fleet view per host.

One process is one core. With ``workers`` above 1 the process started becomes a supervisor
that forks N workers, each a full gateway (its own event loop, backends, monitors and
policies) accepting on the same port (``SO_REUSEPORT``: the kernel spreads connections over
them). What they share:

- **in-flight counts**, the policies' main input: a table in shared memory
  (``backends.shared_inflight``), each worker writing its own row, every snapshot adding the
  others'. A burst spread over the workers is seen whole by each.
- **the admin changes**: worker 0 serves the admin API on the admin port, every worker on its
  private admin socket (a Unix socket in a directory only this user can enter). A change (policy
  and weights, drain, aliases, keys, reload) goes through the fleet's change log
  (``gateway.fleet``): on Redis when the workers share one, else in files in that directory
  (``gateway.fleet.files``). Every worker applies every change, in the log's order, once; one
  started again applies what it missed before it takes traffic.
- **one ``/metrics``**: the worker a scrape reaches combines every worker's figures
  (``gateway.observe.host_metrics``), asked on their private sockets, which also say which backend
  holds a stored response a worker made (``gateway.request.responses.PeerHomes``).
- **signals**: SIGTERM and SIGINT drain every worker (each with its ``shutdown_grace``); SIGHUP
  goes to worker 0, which appends a reload to the change log, so it takes its place among the
  changes every worker applies.

A worker that dies is started again (its row of in-flight counts cleared first: its requests died
with it), at most once a second, and applies the change log before it takes traffic. Each backend
is read (health, models, load figures) once per host: by worker 0, whose latest readings the others
take (``gateway.workers.shared_reads``). What each worker learns on its own (prefix memory, latency
fits) it learns from the same backends. Limits with the memory store would count per process and are
refused (``Settings.per_process_limits``): Redis shares them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from types import FrameType
from typing import Final

import aiohttp
import structlog

from backends.shared_inflight import SharedInFlight, table_bytes

log = structlog.get_logger("gateway.workers.supervisor")

WorkerMain = Callable[["Worker"], int]  # what a worker runs (``gateway.server``'s): its exit code

RESTART_EVERY_S: Final = 1.0  # a worker that keeps dying is started again at most this often
_HANDLED: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True, slots=True)
class Worker:
    """What one worker process is: its index among ``count``, the shared in-flight table,
    and where the workers' private admin sockets are."""

    index: int
    count: int
    table: SharedInFlight
    sockets: Path

    def admin_socket(self, index: int) -> Path:
        return self.sockets / f"admin-{index}.sock"

    def private_socket(self, index: int) -> Path:
        return self.sockets / f"private-{index}.sock"

    @property
    def private_peers(self) -> list[Path]:
        """The other workers' private sockets: their own ``/metrics`` (combined by
        ``gateway.observe.host_metrics``) and the stored responses they know
        (``gateway.request.responses``)."""
        return [self.private_socket(i) for i in range(self.count) if i != self.index]


PeerAnswer = tuple[int, bytes]  # a peer worker's status and body


async def ask_peer(
    socket: Path,
    method: str,
    path_qs: str,
    *,
    within: float,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> PeerAnswer | str:
    """One request to another worker of this host on its Unix socket: its status and body,
    or why it could not be asked (unreachable, too slow)."""
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(socket)),
                timeout=aiohttp.ClientTimeout(total=within),
            ) as session,
            session.request(method, f"http://worker{path_qs}", data=body, headers=headers) as r,
        ):
            return r.status, await r.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"


class WorkerSupervisor:
    """Forks the workers, passes signals on, and starts again one that died."""

    def __init__(self, count: int, run: WorkerMain, hup_to_first: bool = False) -> None:
        """``hup_to_first``: SIGHUP goes to worker 0 alone (it logs the reload for all)."""
        self.count = count
        self._run = run
        self._hup_to_first = hup_to_first
        self._shm = shared_memory.SharedMemory(create=True, size=table_bytes(count))
        self._table = SharedInFlight(self._shm.buf, count, 0)
        self._sockets = Path(tempfile.mkdtemp(prefix="llm-gateway-workers-"))  # mode 0700
        self._children: dict[int, int] = {}  # pid -> worker index
        self._started: dict[int, float] = {}  # worker index -> when it was last started
        self._stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGHUP, self._forward)
        try:
            for i in range(self.count):
                self._spawn(i)
            log.info("workers_started", workers=self.count, pids=sorted(self._children))
            return self._wait()
        finally:
            self._table.release()
            self._shm.close()
            self._shm.unlink()
            shutil.rmtree(self._sockets, ignore_errors=True)

    def _spawn(self, index: int) -> None:
        wait = self._started.get(index, 0.0) + RESTART_EVERY_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._started[index] = time.monotonic()
        # Held until the worker has its own handlers: a signal in between must not run the
        # supervisor's handlers in the worker (nor be lost by the supervisor).
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        pid = os.fork()
        if pid == 0:  # the worker: its own signal handling, then a whole gateway
            code = 1
            try:
                for sig in _HANDLED:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
                table = SharedInFlight(self._shm.buf, self.count, index)
                code = self._run(Worker(index, self.count, table, self._sockets))
            except BaseException:
                log.exception("worker_crashed", worker=index)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # not the supervisor's atexit handlers (the shared memory's)
        self._children[pid] = index
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)

    def _wait(self) -> int:
        code = 0
        while self._children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            index = self._children.pop(pid, None)
            if index is None:
                continue
            exit_code = os.waitstatus_to_exitcode(status)
            if exit_code == 2 and not self._stopping:  # its configuration or port refused
                log.error("worker_refused_to_start", worker=index, pid=pid)
                self._stop(signal.SIGTERM, None)
                code = 2
                continue
            if self._stopping:
                code = code or (exit_code if exit_code > 0 else 0)
                continue
            log.warning("worker_died", worker=index, pid=pid, exit_code=exit_code)
            self._table.clear_row(index)
            self._spawn(index)
            if self._stopping:  # the stop came while it was being started
                self._send(signal.SIGTERM)
            log.info("worker_restarted", worker=index, pid=self._pid_of(index))
        return code

    def _pid_of(self, index: int) -> int | None:
        return next((p for p, i in self._children.items() if i == index), None)

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self._stopping = True
        self._send(signal.SIGTERM)

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        if self._hup_to_first and signum == signal.SIGHUP:
            first = self._pid_of(0)
            if first is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(first, signum)
            return
        self._send(signal.Signals(signum))

    def _send(self, sig: signal.Signals) -> None:
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

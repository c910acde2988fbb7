"""The fake vLLM as a process, answering as vLLM does (``vllm``), for the benchmarks: the peer
bench (``loadtest/peers``), ``scripts/proxy_cost`` and ``loadtest.bench.overhead``.

  python -m tools.fake_vllm --port 18001 --ttft-ms 20 --itl-ms 10 --model tiny

prints ``fake vLLM: serving 'tiny' on http://127.0.0.1:18001`` once it listens (``--port 0``:
a free port). It needs aiohttp (and uvloop, if there) and this package on the path, nothing
else of the repository: ``PYTHONPATH=<checkout> python -m tools.fake_vllm`` runs it under any
Python that has them.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from tools.fake_vllm.backend import FakeBackend, bound_socket
from tools.fake_vllm.vllm import vllm


def create_app(
    model: str = "tiny", ttft_ms: float = 0.0, itl_ms: float = 0.0, *, log_unknown: bool = False
) -> web.Application:
    """The benchmarks' fake as an app: vLLM's answers, nothing recorded."""
    fake = FakeBackend(
        models=[model],
        behaviour=vllm(ttft_ms / 1e3, itl_ms / 1e3),
        record=False,
        log_unknown=log_unknown,
    )
    return fake.app()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.fake_vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument(
        "--itl-ms", type=float, default=0.0, help="gap between tokens (0: as fast as it can)"
    )
    p.add_argument("--log-unknown", action="store_true", help="log requests to unknown paths")
    p.add_argument("--no-uvloop", action="store_true", help="asyncio's own event loop")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Serve until the process is stopped."""
    app = create_app(args.model, args.ttft_ms, args.itl_ms, log_unknown=args.log_unknown)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = bound_socket(args.host, args.port)
    await web.SockSite(runner, sock, backlog=4096).start()
    host, port = sock.getsockname()[:2]
    print(f"fake vLLM: serving {args.model!r} on http://{host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - a bench Python without it
            pass
        else:
            uvloop.run(serve(args))
            return 0
    asyncio.run(serve(args))
    return 0

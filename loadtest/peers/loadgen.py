"""Closed-loop streaming load generator for OpenAI-style SSE endpoints (the peer bench's).

C workers each keep exactly one streaming request in flight, for either a fixed number of
requests (--num-requests) or a fixed time (--duration; requests in flight at the deadline are
allowed to finish until --grace seconds later, then cancelled and counted as timeouts).

Per request it records TTFT (time to the first SSE event that carries content), the gaps
between successive content events (ITL), E2E time and errors. Prints one JSON object (and
writes it to --out if given).

Built not to be the bottleneck: one ClientSession, unlimited connection pool, uvloop, and SSE
handled on raw byte chunks (no per-event JSON parsing; events arriving in the same read share
its timestamp, which shows up as 0 ms gaps). ``loadtest.stream`` applies the same definitions
event by event for the repository's own benchmarks; this one is kept as the peer runs since
2026-11-29 measured with it, so that their figures stay comparable. Self-contained (aiohttp
and, optionally, uvloop): the driver runs it as a file.

Usage:
  python -m loadtest.peers.loadgen --url http://127.0.0.1:8000 -c 64 -d 10 -t 64
  python -m loadtest.peers.loadgen --url http://127.0.0.1:18001,http://127.0.0.1:18002 ...
  (workers alternate between the URLs)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from typing import Any, Final

import aiohttp

# an event carries content if "text" or "content" is a non-empty string
CONTENT_RE: Final = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')


def pct(sorted_vals: list[float], p: float, zeros: int = 0) -> float | None:
    """Percentile (nearest-rank on the merged list of `zeros` zeros + sorted_vals)."""
    n = len(sorted_vals) + zeros
    if n == 0:
        return None
    k = min(n - 1, max(0, math.ceil(p / 100.0 * n) - 1))
    if k < zeros:
        return 0.0
    return sorted_vals[k - zeros]


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.gaps: list[float] = []  # non-zero ITL gaps (seconds)
        self.zero_gaps = 0  # content events that arrived in the same read as the previous one
        self.gap_sum = 0.0
        self.ok = 0
        self.errors = 0
        self.timeouts = 0
        self.error_samples: dict[str, int] = {}
        self.events = 0  # content events (tokens) received, including unfinished requests
        self.all_events = 0  # every data: event
        self.token_mismatch = 0
        self.bytes = 0

    def err(self, key: str) -> None:
        self.errors += 1
        key = key[:200]
        self.error_samples[key] = self.error_samples.get(key, 0) + 1


class _Failed(Exception):
    """A request that got an answer, and the answer was an error."""


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    *,
    payload_bytes: bytes,
    headers: dict[str, str],
    max_tokens: int,
    st: Stats,
    req_timeout: aiohttp.ClientTimeout,
) -> None:
    t0 = time.perf_counter()
    gaps_local: list[float] = []
    try:
        done, first, n_content = await _read(
            session, url, payload_bytes, headers, req_timeout, st=st, gaps=gaps_local
        )
    except asyncio.CancelledError:
        st.timeouts += 1
        raise
    except _Failed as e:
        st.err(str(e))
        return
    except TimeoutError:
        st.err("client timeout")
        return
    except Exception as e:  # connection errors etc.
        st.err(f"{type(e).__name__}: {e}")
        return
    finally:
        st.gaps.extend(gaps_local)
    t_end = time.perf_counter()
    if not done:
        st.err("stream ended without [DONE]")
        return
    if first is None:
        st.err("no content events")
        return
    st.ok += 1
    st.ttft.append(first - t0)
    st.e2e.append(t_end - t0)
    st.gap_sum += sum(gaps_local)
    if n_content != max_tokens:
        st.token_mismatch += 1


async def _read(
    session: aiohttp.ClientSession,
    url: str,
    payload_bytes: bytes,
    headers: dict[str, str],
    req_timeout: aiohttp.ClientTimeout,
    *,
    st: Stats,
    gaps: list[float],
) -> tuple[bool, float | None, int]:
    """One request's stream, read to its end: (saw [DONE], time of the first content event,
    content events). Appends the gaps between reads that brought content to ``gaps``."""
    first: float | None = None
    last = 0.0
    n_content = 0
    done = False
    buf = b""
    async with session.post(url, data=payload_bytes, headers=headers, timeout=req_timeout) as resp:
        if resp.status != 200:
            body = (await resp.read())[:200]
            raise _Failed(f"HTTP {resp.status}: {body!r}")
        content = resp.content
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            now = time.perf_counter()
            st.bytes += len(chunk)
            buf += chunk
            idx = buf.rfind(b"\n\n")
            if idx < 0:
                continue
            complete = buf[: idx + 2]
            buf = buf[idx + 2 :]
            st.all_events += complete.count(b"data:")
            k = len(CONTENT_RE.findall(complete))
            if k:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                st.zero_gaps += k - 1
                last = now
                n_content += k
                st.events += k
            if b"[DONE]" in complete:
                done = True
            if b'"error"' in complete and not k:
                raise _Failed("SSE error event: " + complete[:160].decode("utf-8", "replace"))
    return done, first, n_content


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One load run as the arguments say; the result as the JSON object the CLI prints."""
    urls = [u.rstrip("/") for u in args.url.split(",") if u]
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    body: dict[str, Any]
    if args.endpoint == "chat":
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "stream": True,
        }
    else:
        body = {
            "model": args.model,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "stream": True,
        }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.include_usage:
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if args.api_key:
        headers["Authorization"] = "Bearer " + args.api_key

    st = Stats()
    conn = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        force_close=False,
        enable_cleanup_closed=False,
        ttl_dns_cache=None,
    )
    req_timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30)
    async with aiohttp.ClientSession(
        connector=conn, auto_decompress=False, skip_auto_headers=("User-Agent",)
    ) as session:
        remaining = [args.num_requests] if args.num_requests else None
        t_start = time.perf_counter()
        deadline = t_start + args.duration

        async def worker(i: int) -> None:
            url = urls[i % len(urls)] + path
            while True:
                if remaining is not None:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                elif time.perf_counter() >= deadline:
                    return
                await one_request(
                    session,
                    url,
                    payload_bytes=payload,
                    headers=headers,
                    max_tokens=args.max_tokens,
                    st=st,
                    req_timeout=req_timeout,
                )

        tasks = [asyncio.ensure_future(worker(i)) for i in range(args.concurrency)]
        hard = None
        if remaining is None:
            hard = deadline + args.grace - time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=hard)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        t_end = time.perf_counter()

    wall = t_end - t_start
    ttft = sorted(st.ttft)
    e2e = sorted(st.e2e)
    gaps = sorted(st.gaps)
    n_gaps = len(gaps) + st.zero_gaps
    return {
        "label": args.label,
        "url": args.url,
        "endpoint": path,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "duration_s": round(wall, 3),
        "requests_ok": st.ok,
        "errors": st.errors,
        "timeouts": st.timeouts,
        "token_mismatch": st.token_mismatch,
        "error_samples": dict(sorted(st.error_samples.items(), key=lambda kv: -kv[1])[:5]),
        "req_per_s": round(st.ok / wall, 2) if wall > 0 else None,
        "events_per_s": round(st.events / wall, 1) if wall > 0 else None,
        "all_events_per_s": round(st.all_events / wall, 1) if wall > 0 else None,
        "mb_per_s": round(st.bytes / wall / 1e6, 2) if wall > 0 else None,
        "ttft_ms": {
            "p50": _ms(pct(ttft, 50)),
            "p90": _ms(pct(ttft, 90)),
            "p99": _ms(pct(ttft, 99)),
            "mean": _ms(sum(ttft) / len(ttft)) if ttft else None,
        },
        "itl_ms": {
            "mean": _ms((sum(gaps) / n_gaps) if n_gaps else None),
            "p50": _ms(pct(gaps, 50, st.zero_gaps)),
            "p99": _ms(pct(gaps, 99, st.zero_gaps)),
            "max": _ms(gaps[-1]) if gaps else None,
            "zero_gap_fraction": round(st.zero_gaps / n_gaps, 4) if n_gaps else None,
        },
        "e2e_ms": {"p50": _ms(pct(e2e, 50)), "p99": _ms(pct(e2e, 99))},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", required=True, help="base URL(s), comma-separated; workers alternate")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", default="Tell me a story about a fox and a dog.")
    ap.add_argument("--concurrency", "-c", type=int, default=1)
    ap.add_argument(
        "--num-requests", "-n", type=int, default=0, help="total requests (0 = use --duration)"
    )
    ap.add_argument(
        "--duration", "-d", type=float, default=10.0, help="seconds to keep starting requests"
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds after --duration before in-flight requests are cancelled",
    )
    ap.add_argument("--max-tokens", "-t", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument(
        "--include-usage",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send stream_options.include_usage (default on)",
    )
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-uvloop", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            print("loadgen: uvloop not available, using asyncio loop", file=sys.stderr)
    res = asyncio.run(run(args))
    txt = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(txt + "\n")
    print(txt)


if __name__ == "__main__":
    main()

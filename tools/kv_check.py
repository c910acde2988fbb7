"""``llm-gateway kv-events check URL``: does this backend publish KV events the gateway can use?

It finds the backend's publishers (``GET /kv_event_sources``, or ``--endpoint``), subscribes,
sends one probe prompt of fresh random words (so nothing of it is cached yet) as a
completion with ``max_tokens: 1``, and waits for the ``BlockStored`` events of its blocks.
Then it reports, in words an operator can act on:

- whether events arrive at all, in which wire form, with which hash type;
- the block size, and whether the tokens in the events are the prompt's own tokens as the
  backend's ``/tokenize`` gives them (and as the gateway's tokenizer for the model gives
  them, with ``--tokenizer``): if they differ, precise routing cannot match prompts;
- sequence health (gaps while listening) and whether the replay socket answers;
- the lag from the engine's timestamp to the gateway's receipt.

Exit status 0 when the gateway can route on this backend's events, 1 when it cannot, 2 when
the backend itself cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import zmq
import zmq.asyncio

from backends.kv.sources import Source, parse_sources, reach
from backends.kv.wire import END_SEQ, decode, seq_of
from policies.kv_index import Stored

_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "gecko", "harbor", "iris", "jade")


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)  # (PASS/WARN/FAIL, text)

    def add(self, level: str, text: str) -> None:
        self.lines.append((level, text))

    @property
    def ok(self) -> bool:
        return not any(level == "FAIL" for level, _ in self.lines)

    def render(self) -> str:
        return "\n".join(f"{level:4}  {text}" for level, text in self.lines)


@dataclass(frozen=True)
class Probe:
    url: str
    model: str
    prompt: str
    expected: list[int] | None  # the prompt's tokens, by the backend's own /tokenize
    args: argparse.Namespace


@dataclass
class Heard:
    stored: list[Stored] = field(default_factory=list)
    forms: set[str] = field(default_factory=set)
    lags: list[float] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    problems: dict[str, int] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the backend's HTTP URL, e.g. http://10.0.0.7:8000")
    p.add_argument("--endpoint", help="the publisher (else GET /kv_event_sources)")
    p.add_argument("--replay-endpoint", help="its replay socket")
    p.add_argument("--model", help="model to probe with (default: the backend's first)")
    p.add_argument(
        "--tokenizer", help="also compare with the gateway's tokenizer: a model dir or `sim`"
    )
    p.add_argument("--api-key", help="bearer token for the backend")
    p.add_argument(
        "--tokens", type=int, default=400, help="probe prompt length in tokens (a few blocks)"
    )
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for events")


def run(args: argparse.Namespace) -> int:
    try:
        report = asyncio.run(check(args))
    except aiohttp.ClientError as exc:
        print(f"kv-events check: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    print(report.render())
    print(
        "=> the gateway can route on this backend's KV events"
        if report.ok
        else "=> the gateway cannot route on this backend's KV events: see FAIL above"
    )
    return 0 if report.ok else 1


async def check(args: argparse.Namespace) -> Report:
    report = Report()
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=max(10.0, args.timeout))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        sources = await _sources(http, url, args, report)
        if not sources:
            return report
        model = args.model or await _first_model(http, url)
        if model is None:
            report.add("FAIL", f"{url}/v1/models names no model: pass --model")
            return report
        prompt, expected = await _probe_prompt(http, url, model, args.tokens)
        probe = Probe(url, model, prompt, expected, args)
        ctx = zmq.asyncio.Context()
        try:
            await _listen(ctx, http, probe, sources[0], report)
            if len(sources) > 1:
                report.add("PASS", f"{len(sources)} data-parallel ranks publish; rank 0 probed")
        finally:
            ctx.destroy(linger=0)
    return report


async def _sources(
    http: aiohttp.ClientSession, url: str, args: argparse.Namespace, report: Report
) -> list[Source]:
    if args.endpoint:
        replay = reach(args.replay_endpoint, url) if args.replay_endpoint else None
        report.add("PASS", f"publisher given: {args.endpoint}")
        return [Source(0, reach(args.endpoint, url), replay)]
    async with http.get(f"{url}/kv_event_sources") as resp:
        if resp.status != 200:
            report.add(
                "FAIL",
                f"GET /kv_event_sources answered {resp.status}: vLLM older than 0.12, or not "
                "vLLM; pass --endpoint tcp://HOST:PORT",
            )
            return []
        found = parse_sources(await resp.json(content_type=None), url)
    if isinstance(found, str):
        report.add("FAIL", f"{url}: {found}")
        return []
    for s in found:
        replay = s.replay or "none (gaps cannot be repaired: add replay_endpoint)"
        report.add("PASS", f"rank {s.rank} publishes at {s.endpoint}, replay {replay}")
    return found


async def _first_model(http: aiohttp.ClientSession, url: str) -> str | None:
    async with http.get(f"{url}/v1/models") as resp:
        doc = await resp.json(content_type=None)
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return str(data[0].get("id"))
    return None


async def _probe_prompt(
    http: aiohttp.ClientSession, url: str, model: str, target: int
) -> tuple[str, list[int] | None]:
    """Fresh random words, about ``target`` tokens long (by the backend's /tokenize): enough
    for a few full blocks whatever the block size (vLLM's CPU backend uses 128)."""
    words = max(8, target // 2)
    for _ in range(6):
        prompt = " ".join(random.choice(_WORDS) for _ in range(words))
        tokens = await _tokenize(http, url, model, prompt)
        if tokens is None:
            return prompt, None
        if len(tokens) >= target:
            return prompt, tokens
        words = words * target // max(1, len(tokens)) + 1
    return prompt, tokens


async def _tokenize(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str
) -> list[int] | None:
    async with http.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}) as resp:
        if resp.status != 200:
            return None
        doc = await resp.json(content_type=None)
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    return [int(t) for t in tokens] if isinstance(tokens, list) else None


async def _listen(
    ctx: zmq.asyncio.Context,
    http: aiohttp.ClientSession,
    probe: Probe,
    src: Source,
    report: Report,
) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
    sub.connect(src.endpoint)
    await asyncio.sleep(0.5)  # sleep-ok: ZMQ's slow joiner: let the subscription reach the PUB
    body = {"model": probe.model, "prompt": probe.prompt, "max_tokens": 1}
    async with http.post(f"{probe.url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            detail = (await resp.text())[:300]
            report.add("FAIL", f"the probe completion answered {resp.status}: {detail}")
            return
        await resp.read()
    deadline = time.monotonic() + probe.args.timeout
    heard = Heard()
    expected = probe.expected
    try:
        while time.monotonic() < deadline:
            if not await sub.poll(timeout=200):
                if heard.stored and expected and _covered(heard.stored) >= len(expected) // 2:
                    break  # the probe's blocks have arrived; nothing more is coming
                continue
            frames = await sub.recv_multipart()
            if len(frames) != 3:
                heard.problems["bad_frames"] = heard.problems.get("bad_frames", 0) + 1
                continue
            heard.seqs.append(seq_of(frames[1]))
            batch = decode(frames[2])
            for k, n in batch.problems.items():
                heard.problems[k] = heard.problems.get(k, 0) + n
            if batch.form:
                heard.forms.add(batch.form)
            if batch.ts is not None:
                heard.lags.append(time.time() - batch.ts)
            heard.stored += [ev for ev in batch.events if isinstance(ev, Stored)]
    finally:
        sub.close(linger=0)
    _judge(report, heard, expected)
    await _tokenizer_agreement(report, probe, heard.stored)
    if src.replay:
        await _replay_health(ctx, src.replay, report)


def _covered(stored: list[Stored]) -> int:
    return sum(len(ev.tokens) for ev in stored)


def _judge(report: Report, heard: Heard, expected: list[int] | None) -> None:
    stored, forms, lags, seqs, problems = (
        heard.stored,
        heard.forms,
        heard.lags,
        heard.seqs,
        heard.problems,
    )
    if problems:
        report.add(
            "FAIL",
            f"messages that cannot be read: {problems} (a vLLM release we "
            "do not know? report it with the vLLM version)",
        )
    if not stored:
        report.add(
            "FAIL",
            "no BlockStored event arrived for the probe: prefix caching off "
            "(--no-enable-prefix-caching), a probe shorter than one block, or the publisher's "
            "port not reachable from here",
        )
        return
    sizes = sorted({ev.block_size for ev in stored})
    hashes = sorted({type(h).__name__ for ev in stored for h in ev.hashes})
    report.add(
        "PASS",
        f"{len(stored)} BlockStored event(s) received, wire form {'/'.join(sorted(forms))}, "
        f"hashes {'/'.join(hashes)}, block size {'/'.join(map(str, sizes))}",
    )
    gaps = sum(1 for a, b in itertools.pairwise(seqs) if b != a + 1)
    if gaps:
        report.add("WARN", f"{gaps} sequence gap(s) while listening (dropped messages)")
    else:
        report.add("PASS", f"sequence numbers {seqs[0]}..{seqs[-1]} without gaps")
    if lags:
        worst = max(lags)
        level = "PASS" if worst < 1.0 else "WARN"
        report.add(
            level,
            f"lag from the engine to here: max {worst * 1000:.1f} ms "
            "(clocks of both hosts included)",
        )
    if expected is not None:
        seen = _event_tokens(stored)
        if _is_prefix(seen, expected):
            report.add(
                "PASS",
                f"the events carry the prompt's tokens ({len(seen)} of "
                f"{len(expected)}) as the backend's /tokenize gives them",
            )
        else:
            report.add(
                "FAIL",
                "the events' tokens are not the prompt's: they cannot be matched "
                "to prompts (a cache salt, a LoRA, or multimodal inputs?)",
            )


def _event_tokens(stored: list[Stored]) -> list[int]:
    """The probe's blocks in order: each run follows the run whose last hash is its parent."""
    runs = {ev.parent: ev for ev in stored}
    out: list[int] = []
    ev = runs.get(None)
    while ev is not None:
        out += list(ev.tokens)
        ev = runs.get(ev.hashes[-1]) if ev.hashes else None
    return out


def _is_prefix(seen: list[int], expected: list[int]) -> bool:
    return bool(seen) and expected[: len(seen)] == seen


async def _tokenizer_agreement(report: Report, probe: Probe, stored: list[Stored]) -> None:
    args, expected = probe.args, probe.expected
    if not args.tokenizer:
        if expected is None:
            report.add("WARN", "the backend has no /tokenize: token agreement not checked")
        return
    from gateway.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(args.tokenizer)
    except ValueError as exc:
        report.add("FAIL", f"the gateway's tokenizer: {exc}")
        return
    mine = tok.prompt_tokens("completions", {"model": probe.model, "prompt": probe.prompt})
    seen = _event_tokens(stored)
    if mine is not None and (mine == expected or (seen and _is_prefix(seen, mine))):
        report.add("PASS", f"the gateway's tokenizer ({args.tokenizer}) agrees with the engine")
    else:
        report.add(
            "FAIL",
            f"the gateway's tokenizer ({args.tokenizer}) gives other tokens than "
            "the engine: configure [tokenizers] with the model's own directory",
        )


async def _replay_health(ctx: zmq.asyncio.Context, endpoint: str, report: Report) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    got = 0
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        async with asyncio.timeout(5.0):
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and seq_of(frames[2]) == END_SEQ:
                    break
                got += 1
        report.add("PASS", f"the replay socket answers ({got} batch(es) buffered)")
    except TimeoutError:
        report.add(
            "WARN",
            f"the replay socket at {endpoint} did not answer in 5 s: gaps "
            "will clear the backend's entries instead of being repaired",
        )
    finally:
        dealer.close(linger=0)


def main() -> None:  # pragma: no cover - for `python -m tools.kv_check`
    p = argparse.ArgumentParser(prog="kv-events check")
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":  # pragma: no cover
    main()

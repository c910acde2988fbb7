"""What KV-event routing costs the gateway's one core: ingesting events, keying prompts, lookups.

``python -m loadtest.bench.kv_events`` prints, for one process on one core:

- **ingestion**: KV-event batches as vLLM publishes them (msgpack, tagged form) decoded and
  applied to the index, in events per second, for stores of one and of four blocks and for
  removals, with the index filled to a realistic size (8 backends x 30,000 blocks);
- **keying**: ``chain_keys`` of a prompt, in µs per 1,000 tokens (block size 16);
- **lookup**: ``KvIndex.match`` of a 6,000-token prompt over 8 backends, in µs, for a prompt
  that is fully cached on one backend and for one that nobody holds;
- **memory**: the index's size in entries and the process's RSS growth per 100,000 entries.

Figures, not asserts: a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import time
from collections.abc import Callable, Sequence

import msgspec

from backends.kv.wire import decode
from policies.kv_index import KvIndex, chain_keys

BS = 16


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _batch(events: Sequence[object]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, 0])


def _stored(rng: random.Random, parent: int | None, blocks: int, first: int) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [first + i for i in range(blocks)],
        "parent_block_hash": parent,
        "token_ids": [rng.randrange(32_000) for _ in range(blocks * BS)],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _timed(fn: Callable[[], int], min_s: float = 1.0) -> float:
    """Units per second of ``fn`` (which returns how many units it did), over >= min_s."""
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s:
        done += fn()
    return done / elapsed


def ingestion(backends: int, per_backend: int) -> None:
    rng = random.Random(1)
    index = KvIndex(capacity=per_backend * 2)
    names = [f"b{i}" for i in range(backends)]
    before = _rss_kib()
    next_hash = 1
    for b in names:  # fill: runs of 8 blocks chained from the root
        while index.blocks(b) < per_backend:
            index.apply(b, decode(_batch([_stored(rng, None, 8, next_hash)])).events)
            next_hash += 8
    gc.collect()
    grown = _rss_kib() - before
    print(
        f"index filled: {index.size:,} entries over {backends} backends, RSS +{grown / 1024:.1f}"
        f" MiB ({grown * 1024 / index.size:.0f} B per entry, maxrss-based)"
    )
    one = [_batch([_stored(rng, None, 1, 10_000_000 + i)]) for i in range(2000)]
    four = [_batch([_stored(rng, None, 4, 20_000_000 + 4 * i)]) for i in range(2000)]
    removed = [
        _batch([{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}])
        for h in range(1, 2001)
    ]
    mixed = [
        _batch(
            [_stored(rng, None, 1, 30_000_000 + 4 * i + j) for j in range(3)]
            + [{"type": "BlockRemoved", "block_hashes": [10_000_000 + i], "medium": "GPU"}]
        )
        for i in range(2000)
    ]

    def run(payloads: list[bytes], per: int) -> Callable[[], int]:
        def go() -> int:
            for p in payloads:
                index.apply("b0", decode(p).events)
            return len(payloads) * per

        return go

    for label, payloads, per in (
        ("BlockStored, 1 block per event, 1 event per batch", one, 1),
        ("BlockStored, 4 blocks per event, 1 event per batch", four, 1),
        ("BlockRemoved, 1 event per batch", removed, 1),
        ("4 events per batch (3 stores, 1 removal)", mixed, 4),
    ):
        rate = _timed(run(payloads, per))
        print(f"ingest {label}: {rate:,.0f} events/s ({1e6 / rate:.1f} µs per event)")


def keying_and_lookup(backends: int) -> None:
    rng = random.Random(2)
    tokens = [rng.randrange(32_000) for _ in range(6000)]
    rate = _timed(lambda: (chain_keys(tokens, BS), 6)[1])
    print(f"chain_keys, block size {BS}: {1e6 / rate:.1f} µs per 1,000 tokens")
    index = KvIndex()
    names = [f"b{i}" for i in range(backends)]
    keys = chain_keys(tokens, BS)
    # Backend 0 holds the whole prompt; the others its first quarter.
    from policies.kv_index import Stored

    stored = Stored(list(range(len(keys))), None, tokens[: len(keys) * BS], BS)
    index.apply("b0", [stored])
    quarter = Stored(list(range(len(keys) // 4)), None, tokens[: len(keys) // 4 * BS], BS)
    for b in names[1:]:
        index.apply(b, [quarter])
    held = index.match(keys, names)
    assert held["b0"] == len(keys)
    rate = _timed(lambda: (index.match(keys, names), 1)[1])
    print(
        f"match, 6,000 tokens ({len(keys)} blocks) over {backends} backends, held whole by "
        f"one: {1e6 / rate:.1f} µs"
    )
    other = chain_keys([t + 1 for t in tokens], BS)
    rate = _timed(lambda: (index.match(other, names), 1)[1])
    print(f"match, a prompt nobody holds: {1e6 / rate:.2f} µs")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.kv_events")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--blocks", type=int, default=30_000, help="blocks held per backend")
    args = p.parse_args()
    ingestion(args.backends, args.blocks)
    keying_and_lookup(args.backends)


if __name__ == "__main__":
    main()

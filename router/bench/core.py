"""Micro-benchmark of the routing core: hashing, lookup + decision, index memory.

``python -m router.bench.core [--output FILE]`` (``make bench-core``) prints a table and
writes the numbers as JSON (default ``bench-results/core.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.config import PolicyConfig
from router.core import RoutingCore
from router.events.ingest import EventIngestor, StreamState
from router.events.types import BlockStored, EventBatch
from router.fleet.load import LoadTracker
from router.hashing import block_keys, seed_for
from router.index import MemoryIndex
from router.policy import make_policy
from router.policy.base import RouteRequest
from router.types import EngineKey

PROMPT_TOKENS = 8192
BLOCK = 16


def _time_us(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median and p99 in microseconds."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def bench_hashing(repeat: int) -> dict[str, float]:
    rng = random.Random(1)
    tokens = [rng.randrange(1024, 131_072) for _ in range(PROMPT_TOKENS)]
    seed = seed_for("bench-model")
    p50, p99 = _time_us(lambda: block_keys(tokens, BLOCK, seed), repeat)
    return {"p50_us": p50, "p99_us": p99}


def bench_decision(engines: int, repeat: int) -> dict[str, float]:
    """A fleet whose every engine holds unrelated blocks, and a few the query's prefix."""
    rng = random.Random(engines)
    fleet = [EngineKey(f"10.0.{i // 250}.{i % 250}:8000") for i in range(engines)]
    index = MemoryIndex()
    seed = seed_for("bench-model")
    prompt = [rng.randrange(1024, 131_072) for _ in range(PROMPT_TOKENS)]
    keys = block_keys(prompt, BLOCK, seed)
    for i, engine in enumerate(fleet):
        other = [rng.getrandbits(64) for _ in range(2000)]
        index.add_now(engine, other)
        if i % 4 == 0:  # a quarter hold a prefix of the query, of varying depth
            index.add_now(engine, keys[: len(keys) * (i % 16 + 1) // 16])
    cfg = PolicyConfig()
    loads = LoadTracker(BLOCK)
    for i, engine in enumerate(fleet):
        loads.begin(engine, 1000 + 37 * i, 0, 100)
    core = RoutingCore(index, make_policy(cfg), cfg, loads)
    request = RouteRequest("bench", keys, PROMPT_TOKENS, BLOCK, 256)

    def decide() -> None:
        matches = index.lookup_now(keys, fleet)
        core.policy.choose(request, fleet, matches, loads.view)

    lookup = _time_us(lambda: index.lookup_now(keys, fleet), repeat)
    decision = _time_us(decide, repeat)
    loop = asyncio.new_event_loop()
    try:
        routed = _time_us(lambda: loop.run_until_complete(core.route(request, fleet)), repeat)
    finally:
        loop.close()
    return {
        "engines": engines,
        "lookup_p50_us": lookup[0],
        "lookup_decision_p50_us": decision[0],
        "lookup_decision_p99_us": decision[1],
        "route_with_provisional_p50_us": routed[0],
    }


def bench_memory(engines: int, blocks_per_engine: int, shared: bool) -> dict[str, float]:
    """Bytes per (block, engine) entry, index plus the ingestor's engine-hash map."""
    rng = random.Random(3)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    loop = asyncio.new_event_loop()
    tokens_pool = [rng.randrange(1024, 131_072) for _ in range(blocks_per_engine * BLOCK)]
    states = []
    for e in range(engines):
        state = StreamState(EngineKey(f"10.0.0.{e}:8000"), "bench-model", BLOCK)
        states.append(state)
        toks = tokens_pool if shared else [t ^ (e + 1) for t in tokens_pool]
        hashes = [rng.getrandbits(64) for _ in range(blocks_per_engine)]
        event = BlockStored(hashes, None, toks, BLOCK)
        loop.run_until_complete(ingestor.apply(state, EventBatch(0.0, [event])))
        del toks, hashes, event  # the last engine's event is no part of the index
    del tokens_pool
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    loop.close()
    entries = engines * blocks_per_engine
    return {
        "engines": engines,
        "blocks_per_engine": blocks_per_engine,
        "shared_blocks": shared,
        "bytes_per_entry": used / entries,
    }


BOUNDED_BLOCKS = 256_000
BOUNDED_CAP = 32_768


def bench_bounded(rounds: int = 3) -> dict[str, float]:
    """Ingest with the index's memory bounds: blocks/s of one engine stream storing
    ``BOUNDED_BLOCKS`` new blocks (events of 64) into an index with no cap, one whose
    per-engine cap is the default (never reached here: the cost of keeping the order),
    and one capped at ``BOUNDED_CAP`` (evicting as it stores, the hash map alike);
    interleaved rounds, the best of each."""
    rng = random.Random(5)
    events = []
    for first in range(0, BOUNDED_BLOCKS, 64):
        tokens = [rng.randrange(1024, 131_072) for _ in range(64 * BLOCK)]
        events.append(BlockStored(list(range(first + 1, first + 65)), None, tokens, BLOCK))
    kinds = {"no cap": 0, "default per-engine cap": 1_048_576, "at its cap": BOUNDED_CAP}
    best: dict[str, float] = {}
    loop = asyncio.new_event_loop()
    try:
        for _ in range(rounds):
            for name, cap in kinds.items():
                index = MemoryIndex(max_entries_per_engine=cap)
                ingestor = EventIngestor(index, max_blocks_per_engine=cap)
                state = StreamState(EngineKey("10.0.0.1:8000"), "bench-model", BLOCK)
                gc.collect()
                t0 = time.perf_counter()
                for event in events:
                    loop.run_until_complete(ingestor.apply(state, EventBatch(0.0, [event])))
                rate = BOUNDED_BLOCKS / (time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), rate)
                if cap == BOUNDED_CAP:
                    assert index.stats_now().entries <= BOUNDED_CAP
    finally:
        loop.close()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default="bench-results/core.json")
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args(argv)

    results: dict[str, Any] = {"prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK}
    results["hashing"] = bench_hashing(args.repeat)
    results["decision"] = [bench_decision(n, args.repeat // 2) for n in (16, 64, 256)]
    results["bounded_ingest_blocks_per_s"] = bench_bounded()
    results["memory"] = [
        bench_memory(16, 20_000, shared=False),
        bench_memory(16, 20_000, shared=True),
    ]

    h = results["hashing"]
    print(
        f"block keys, {PROMPT_TOKENS} tokens / block {BLOCK}: "
        f"p50 {h['p50_us']:.0f} us, p99 {h['p99_us']:.0f} us"
    )
    header = ("engines", "lookup p50", "lookup+decision p50", "p99", "route+record p50")
    print("  ".join(f"{h:>{len(h) + 2}}" for h in header))
    for d in results["decision"]:
        cells = [
            f"{d['engines']}",
            f"{d['lookup_p50_us']:.1f} us",
            f"{d['lookup_decision_p50_us']:.1f} us",
            f"{d['lookup_decision_p99_us']:.1f} us",
            f"{d['route_with_provisional_p50_us']:.1f} us",
        ]
        print("  ".join(f"{c:>{len(h) + 2}}" for c, h in zip(cells, header, strict=True)))
    for m in results["memory"]:
        kind = (
            "every engine holds the same blocks"
            if m["shared_blocks"]
            else "distinct blocks per engine"
        )
        print(f"memory: {m['bytes_per_entry']:.0f} bytes per (block, engine) entry ({kind})")
    print(f"ingest of {BOUNDED_BLOCKS:,} new blocks from one engine stream, best of 3:")
    for name, rate in results["bounded_ingest_blocks_per_s"].items():
        print(f"  {name}: {rate / 1e6:.2f}M blocks/s")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a routing decision costs with the Redis index, beside the memory index.

``python -m router.bench.redis_decisions [--redis-url URL] [--output FILE]`` routes the
same 8,192-token prompt (512 block keys) through :class:`~router.core.RoutingCore`
with the ``kv_cost`` policy, one decision after another, against 16 and 64 engines
filled as in ``router.bench.redis_index`` (a quarter of them hold a prefix of the
prompt, so every lookup walks hundreds of blocks). Each decision is a lookup, the
policy, and the record of the chosen engine as a provisional holder of the prompt's
512 blocks. Three ways:

* ``memory``: the embedded index;
* ``redis, record awaited``: a bare :class:`~router.index.redis.RedisIndex`, so the
  request waits for the record's script call too (two round trips);
* ``redis, record off-path``: the router's :class:`~router.index.shadow.ShadowedIndex`,
  which queues the record and writes it in the background (one round trip).

It reports:

* the request path's latency per decision (p50/p99) with decisions paced at
  ``--rate`` per second, below what Redis can take, as in a router that is not
  saturating it (back to back, the next lookup would queue in Redis behind the
  previous record, whoever waits for it);
* decisions per second back to back (everything the process and Redis do, background
  writes included): the throughput one router gets from one Redis;
* Redis's own time per decision (``INFO commandstats``: the lookup and the record
  scripts), which bounds what one Redis serves across all replicas; back to back, and
  in bursts of 8 concurrent decisions for the prompt (where off-path records of a
  shared prefix are written once).

It starts a throw-away ``redis-server`` unless ``--redis-url`` names one. On uvloop,
like ``kvroute serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from router.bench.redis_index import Fleet
from router.bench.throwaway_redis import RedisServer
from router.config import PolicyConfig
from router.core import RoutingCore
from router.engines.load import LoadTracker
from router.index.base import KVIndex
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex
from router.index.shadow import ShadowedIndex
from router.policy.base import RouteRequest
from router.policy.kv_cost import KVCostPolicy

PROMPT_TOKENS = 8192
BLOCK = 16
MODES = ("memory", "redis_awaited", "redis_offpath")


async def _redis_usec(index: RedisIndex) -> float:
    """Microseconds Redis has spent in scripts so far (every EVALSHA)."""
    stats = await index.client.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def _drop(index: RedisIndex) -> None:
    keys = [k async for k in index.client.scan_iter(match=f"{{{index.namespace}}}:*", count=1000)]
    for start in range(0, len(keys), 1000):
        await index.client.delete(*keys[start : start + 1000])


async def bench_mode(
    url: str, engines: int, mode: str, decisions: int, rate: float
) -> dict[str, Any]:
    fleet = Fleet(engines)
    redis = None
    index: KVIndex
    if mode == "memory":
        index = MemoryIndex()
        await fleet.fill(index)
    else:
        redis = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000)
        await fleet.fill(redis)
        index = redis if mode == "redis_awaited" else ShadowedIndex(redis)
    config = PolicyConfig()
    core = RoutingCore(index, KVCostPolicy(config), config, LoadTracker(BLOCK))

    def request(i: int) -> RouteRequest:
        return RouteRequest(f"r-{i}", fleet.query, PROMPT_TOKENS, BLOCK)

    try:
        for i in range(min(decisions // 10, 200)):  # scripts, connections, candidate ids
            await core.route(request(i), fleet.engines)
        await _settle(index)
        # Paced: the request path's latency.
        loop = asyncio.get_running_loop()
        samples = []
        next_at = loop.time()
        for i in range(decisions):
            next_at += 1 / rate
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
            t0 = time.perf_counter()
            await core.route(request(i), fleet.engines)
            samples.append((time.perf_counter() - t0) * 1e6)
        await _settle(index)
        # Back to back: throughput, and Redis's time per decision.
        usec = await _redis_usec(redis) if redis is not None else 0.0
        started = time.perf_counter()
        for i in range(decisions):
            await core.route(request(i), fleet.engines)
        await _settle(index)
        elapsed = time.perf_counter() - started
        samples.sort()
        row: dict[str, Any] = {
            "engines": engines,
            "mode": mode,
            "paced_per_s": rate,
            "decision_p50_us": statistics.median(samples),
            "decision_p99_us": samples[int(len(samples) * 0.99) - 1],
            "back_to_back_decisions_per_s": decisions / elapsed,
        }
        if redis is not None:
            row["redis_us_per_decision"] = (await _redis_usec(redis) - usec) / decisions
            # Bursts of 8 concurrent decisions for one prompt (a group sharing a prefix).
            usec = await _redis_usec(redis)
            bursts = decisions // 8
            for b in range(bursts):
                await asyncio.gather(
                    *(core.route(request(b * 8 + j), fleet.engines) for j in range(8))
                )
            await _settle(index)
            row["redis_us_per_decision_in_bursts"] = (await _redis_usec(redis) - usec) / (
                bursts * 8
            )
            await _drop(redis)
        return row
    finally:
        await index.close()


async def _settle(index: KVIndex) -> None:
    """Wait until the off-path records queued so far are written."""
    if isinstance(index, ShadowedIndex):
        await index.drain()


async def run(url: str, decisions: int, rate: float) -> dict[str, Any]:
    rows = [
        await bench_mode(url, engines, mode, decisions, rate)
        for engines in (16, 64)
        for mode in MODES
    ]
    return {"prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK, "decisions": rows}


def report(results: dict[str, Any]) -> None:
    print(
        f"one routing decision (lookup, kv_cost, provisional record) for a "
        f"{results['prompt_tokens']}-token prompt:"
    )
    header = ("engines", "mode", "paced p50/p99 us", "back-to-back /s", "Redis us", "in bursts")
    print("  ".join(f"{h:>18}" for h in header))
    for r in results["decisions"]:
        redis = r.get("redis_us_per_decision")
        burst = r.get("redis_us_per_decision_in_bursts")
        cells = (
            str(r["engines"]),
            r["mode"],
            f"{r['decision_p50_us']:.0f} / {r['decision_p99_us']:.0f}",
            f"{r['back_to_back_decisions_per_s']:,.0f}",
            "-" if redis is None else f"{redis:.0f}",
            "-" if burst is None else f"{burst:.0f}",
        )
        print("  ".join(f"{c:>18}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of a throw-away one")
    parser.add_argument("--output", default="bench-results/redis_decisions.json")
    parser.add_argument("--decisions", type=int, default=3000, help="decisions per mode")
    parser.add_argument("--rate", type=float, default=500, help="paced decisions per second")
    args = parser.parse_args(argv)
    server = None if args.redis_url else RedisServer()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    try:
        try:
            import uvloop
        except ImportError:
            results = asyncio.run(run(url, args.decisions, args.rate))
        else:
            results = uvloop.run(run(url, args.decisions, args.rate))
    finally:
        if server is not None:
            server.kill()
    report(results)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
  which queues the record and writes it in the background (one round trip);
* ``replicated xN``: the replicated mode (``index.backend: replicated``) with N = 1, 2
  and 4 replicas in this process, each a :class:`~router.index.replicated.ReplicatedIndex`
  with its own Redis connection, filled alike (as every replica's KV events would fill
  it); decisions go to the replicas in turn, each publishes its decisions to the stream
  and reads the others'. Lookups never leave the process; Redis's time is the stream's
  (``XADD`` and every replica's blocking ``XREAD``), and the run waits until every
  replica has recorded every peer decision before it reads the counters.

It reports:

* the request path's latency per decision (p50/p99) with decisions paced at
  ``--rate`` per second, below what Redis can take, as in a router that is not
  saturating it (back to back, the next lookup would queue in Redis behind the
  previous record, whoever waits for it);
* decisions per second back to back (everything the process and Redis do, background
  writes included): the throughput one router gets from one Redis;
* Redis's own time per decision (``INFO commandstats``: every command, so the lookup
  and record scripts, or the stream's appends and reads), which bounds what one Redis
  serves across all replicas: paced, back to back, and in bursts of 8 concurrent
  decisions for the prompt (where off-path records of a shared prefix are written once);
  ``decisions/s per Redis`` is one second of Redis time over the paced figure;
* the process's CPU time per decision back to back (all replicas, with the background
  writes, reads and peers' records), and the Redis server's (``INFO cpu``: its commands
  and its network I/O, which ``commandstats`` leaves out; it includes Redis's own
  housekeeping, so it is an upper bound).

The replicated rows also fit Redis time per decision to ``a + b x N`` (one append, one
read per replica) and print the decisions per second one Redis sustains at larger N.

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
from router.config import PolicyConfig, ReplicatedIndexConfig
from router.core import RoutingCore
from router.engines.load import LoadTracker
from router.index.base import KVIndex
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex
from router.index.replicated import ReplicatedIndex
from router.index.shadow import ShadowedIndex
from router.policy.base import RouteRequest
from router.policy.kv_cost import KVCostPolicy

PROMPT_TOKENS = 8192
BLOCK = 16
MODES = ("memory", "redis_awaited", "redis_offpath")
REPLICAS = (1, 2, 4)
"""Replica counts of the replicated mode's rows."""


async def _redis_usec(index: RedisIndex) -> float:
    """Microseconds Redis has spent in commands so far (every command: scripts, stream
    appends and reads)."""
    stats = await index.client.info("commandstats")
    return float(sum(v.get("usec", 0) for k, v in stats.items() if k.startswith("cmdstat_")))


async def _redis_cpu_us(index: RedisIndex) -> float:
    """Microseconds of CPU the Redis server process has used so far (``INFO cpu``: its
    commands and its network I/O, which ``commandstats`` leaves out)."""
    cpu = await index.client.info("cpu")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6


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
        usec = await _redis_usec(redis) if redis is not None else 0.0
        for i in range(decisions):
            next_at += 1 / rate
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
            t0 = time.perf_counter()
            await core.route(request(i), fleet.engines)
            samples.append((time.perf_counter() - t0) * 1e6)
        await _settle(index)
        paced_usec = (await _redis_usec(redis) - usec) / decisions if redis is not None else None
        # Back to back: throughput, and Redis's time per decision.
        usec = await _redis_usec(redis) if redis is not None else 0.0
        redis_cpu = await _redis_cpu_us(redis) if redis is not None else 0.0
        started = time.perf_counter()
        cpu = time.process_time()
        for i in range(decisions):
            await core.route(request(i), fleet.engines)
        await _settle(index)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        samples.sort()
        row: dict[str, Any] = {
            "engines": engines,
            "mode": mode,
            "paced_per_s": rate,
            "decision_p50_us": statistics.median(samples),
            "decision_p99_us": samples[int(len(samples) * 0.99) - 1],
            "back_to_back_decisions_per_s": decisions / elapsed,
            "cpu_us_per_decision": cpu / decisions * 1e6,
        }
        if redis is not None:
            row["redis_us_per_decision_paced"] = paced_usec
            row["redis_us_per_decision"] = (await _redis_usec(redis) - usec) / decisions
            row["redis_cpu_us_per_decision"] = (await _redis_cpu_us(redis) - redis_cpu) / decisions
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


class _Replicas:
    """N replicated-mode replicas in this process, one routing core each."""

    def __init__(self, url: str, n: int, fleet: Fleet) -> None:
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        config = ReplicatedIndexConfig()
        self.indexes = [
            ReplicatedIndex(
                RedisIndex(url, namespace, budget_ms=1000), config, f"bench-replica-{i}"
            )
            for i in range(n)
        ]
        policy = PolicyConfig()
        self.cores = [
            RoutingCore(index, KVCostPolicy(policy), policy, LoadTracker(BLOCK))
            for index in self.indexes
        ]
        self.fleet = fleet
        self.turn = 0

    async def start(self) -> None:
        for index in self.indexes:
            await self.fleet.fill(index)
            await index.sync.start()

    async def route(self, request: RouteRequest, engines: list[Any]) -> Any:
        core = self.cores[self.turn % len(self.cores)]
        self.turn += 1
        return await core.route(request, engines)

    async def settle(self, timeout: float = 30.0) -> None:
        """Until every decision is published and every replica recorded its peers'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            syncs = [index.sync for index in self.indexes]
            published = sum(s.counters.published for s in syncs)
            done = all(s.pending == 0 for s in syncs) and all(
                s.counters.applied == published - s.counters.published for s in syncs
            )
            if done:
                return
            await asyncio.sleep(0.001)
        raise TimeoutError("replicas did not catch up with the decision stream")

    async def close(self) -> None:
        for index in self.indexes:
            await index.close()


async def bench_replicated(
    url: str, engines: int, replicas: int, decisions: int, rate: float
) -> dict[str, Any]:
    fleet = Fleet(engines)
    group = _Replicas(url, replicas, fleet)
    await group.start()
    redis = group.indexes[0].redis

    def request(i: int) -> RouteRequest:
        return RouteRequest(f"r-{i}", fleet.query, PROMPT_TOKENS, BLOCK)

    try:
        for i in range(min(decisions // 10, 200)):
            await group.route(request(i), fleet.engines)
        await group.settle()
        loop = asyncio.get_running_loop()
        samples = []
        usec = await _redis_usec(redis)
        next_at = loop.time()
        for i in range(decisions):
            next_at += 1 / rate
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
            t0 = time.perf_counter()
            await group.route(request(i), fleet.engines)
            samples.append((time.perf_counter() - t0) * 1e6)
        await group.settle()
        paced_usec = (await _redis_usec(redis) - usec) / decisions
        usec = await _redis_usec(redis)
        redis_cpu = await _redis_cpu_us(redis)
        started = time.perf_counter()
        cpu = time.process_time()
        for i in range(decisions):
            await group.route(request(i), fleet.engines)
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the background tasks run, as a server would
        await group.settle()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        back_usec = (await _redis_usec(redis) - usec) / decisions
        back_cpu = (await _redis_cpu_us(redis) - redis_cpu) / decisions
        usec = await _redis_usec(redis)
        bursts = decisions // 8
        for b in range(bursts):
            await asyncio.gather(
                *(group.route(request(b * 8 + j), fleet.engines) for j in range(8))
            )
        await group.settle()
        burst_usec = (await _redis_usec(redis) - usec) / (bursts * 8)
        entries = sum(index.sync.counters.entries for index in group.indexes)
        published = sum(index.sync.counters.published for index in group.indexes)
        samples.sort()
        await _drop(redis)
        return {
            "engines": engines,
            "mode": f"replicated_x{replicas}",
            "replicas": replicas,
            "paced_per_s": rate,
            "decision_p50_us": statistics.median(samples),
            "decision_p99_us": samples[int(len(samples) * 0.99) - 1],
            "back_to_back_decisions_per_s": decisions / elapsed,
            "cpu_us_per_decision": cpu / decisions * 1e6,
            "redis_us_per_decision_paced": paced_usec,
            "redis_us_per_decision": back_usec,
            "redis_cpu_us_per_decision": back_cpu,
            "redis_us_per_decision_in_bursts": burst_usec,
            "decisions_per_entry": published / max(entries, 1),
        }
    finally:
        await group.close()


async def bench_idle_append(url: str, count: int = 1000) -> dict[str, float]:
    """Redis's time for one 4 KB stream append (an 8,192-token decision's entry), no
    reader: back to back, and 2 ms apart (Redis idle in between, as at 500 decisions/s).
    The difference is what an idle server costs per command, not work."""
    index = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000)
    payload = bytes(8 * PROMPT_TOKENS // BLOCK)
    key = index.key("decisions")
    row: dict[str, float] = {}
    try:
        for label, pause in (("back_to_back", 0.0), ("paced_2ms", 0.002)):
            await index.client.delete(key)
            before = await _redis_usec(index)
            for _ in range(count):
                await index.client.xadd(key, {"r": "bench", "d": payload})
                if pause:
                    await asyncio.sleep(pause)
            row[label] = (await _redis_usec(index) - before) / count
        await index.client.delete(key)
    finally:
        await index.close()
    return row


def fit_replicas(rows: list[dict[str, Any]], measure: str) -> dict[str, Any] | None:
    """Least-squares ``a + b x N`` of one Redis time per decision (``measure``) over the
    replica counts measured, and the decisions per second one Redis sustains at larger N."""
    points = [(r["replicas"], r[measure]) for r in rows if "replicas" in r]
    if len(points) < 2:
        return None
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {
        "measure": measure,
        "append_us": a,
        "read_us_per_replica": b,
        "decisions_per_s": {n: 1e6 / max(a + b * n, 1e-3) for n in (1, 2, 4, 8, 16, 32)},
    }


async def run(url: str, decisions: int, rate: float) -> dict[str, Any]:
    rows = []
    for engines in (16, 64):
        rows += [await bench_mode(url, engines, mode, decisions, rate) for mode in MODES]
        rows += [await bench_replicated(url, engines, n, decisions, rate) for n in REPLICAS]
    fits = {
        f"{engines} engines, {label}": fit_replicas(
            [r for r in rows if r["engines"] == engines], measure
        )
        for engines in (16, 64)
        for label, measure in (
            ("back to back", "redis_us_per_decision"),
            ("paced", "redis_us_per_decision_paced"),
        )
    }
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK,
        "decisions": rows,
        "replicated_fit": fits,
        "idle_append_us": await bench_idle_append(url),
    }


def report(results: dict[str, Any]) -> None:
    print(
        f"one routing decision (lookup, kv_cost, provisional record) for a "
        f"{results['prompt_tokens']}-token prompt:"
    )
    header = (
        "engines",
        "mode",
        "paced p50/p99 us",
        "back-to-back /s",
        "CPU us",
        "Redis us paced",
        "back to back",
        "Redis CPU",
        "in bursts",
        "decisions/s/Redis",
    )
    print("  ".join(f"{h:>17}" for h in header))

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in results["decisions"]:
        paced = r.get("redis_us_per_decision_paced")
        cells = (
            str(r["engines"]),
            r["mode"],
            f"{r['decision_p50_us']:.0f} / {r['decision_p99_us']:.0f}",
            f"{r['back_to_back_decisions_per_s']:,.0f}",
            f"{r['cpu_us_per_decision']:.0f}",
            us(paced),
            us(r.get("redis_us_per_decision")),
            us(r.get("redis_cpu_us_per_decision")),
            us(r.get("redis_us_per_decision_in_bursts")),
            "-" if not paced else f"{1e6 / paced:,.0f}",
        )
        print("  ".join(f"{c:>17}" for c in cells))
    idle = results.get("idle_append_us")
    if idle:
        print(
            f"one 4 KB stream append alone: {idle['back_to_back']:.1f} us of Redis time back "
            f"to back, {idle['paced_2ms']:.1f} us when 2 ms apart (an idle Redis is slower "
            "per command; the paced rows pay that)"
        )
    for r in results["decisions"]:
        if "decisions_per_entry" in r:
            print(
                f"{r['mode']}, {r['engines']} engines: {r['decisions_per_entry']:.1f} "
                "decisions per stream entry (all three runs)"
            )
    for what, fit in results.get("replicated_fit", {}).items():
        if fit is None:
            continue
        sustained = ", ".join(f"N={n}: {v:,.0f}" for n, v in fit["decisions_per_s"].items())
        print(
            f"replicated, {what}: Redis us per decision ~ "
            f"{fit['append_us']:.1f} + {fit['read_us_per_replica']:.1f} x N replicas; "
            f"decisions/s one Redis sustains: {sustained}"
        )


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

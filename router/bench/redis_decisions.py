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

The replicated rows also split the back-to-back Redis time into one append's share
``a`` and one read's share ``b`` per replica (every replica reads every entry), and
print the decisions per second one Redis sustains at larger N from ``a + b x N``.

It starts a throw-away ``redis-server`` unless ``--redis-url`` names one. On uvloop,
like ``kvroute serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.bench.redis_index import Fleet
from router.bench.report import save_results
from router.bench.throwaway_redis import run_on_redis
from router.config import PolicyConfig, ReplicatedIndexConfig
from router.core import RoutingCore
from router.fleet.load import LoadTracker
from router.index.base import KVIndex
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex
from router.index.replicated import DecisionSync, ReplicatedIndex
from router.index.shadow import ShadowedIndex
from router.policy.base import RouteRequest
from router.policy.kv_cost import KVCostPolicy
from router.redis.client import RedisClient
from router.types import EngineKey

PROMPT_TOKENS = 8192
BLOCK = 16
MODES = ("memory", "redis_awaited", "redis_offpath")
REPLICAS = (1, 2, 4)
"""Replica counts of the replicated mode's rows."""
STREAM_RUNS = ((1, 2_000), (1, 10_000), (1, 50_000), (2, 2_000), (2, 10_000), (2, 50_000))
STREAM_RUNS += ((4, 2_000), (4, 10_000), (4, 25_000))
"""(replicas, total decisions per second) of the decision stream's capacity rows. Four
readers of 50,000 decisions a second (800 MB/s of entries) are more than this one
Python process can decode; in a fleet each replica is a process of its own."""


async def _redis_usec(redis: RedisClient) -> float:
    """Microseconds Redis has spent in commands so far (every command: scripts, stream
    appends and reads)."""
    stats = await redis.client.info("commandstats")
    return float(sum(v.get("usec", 0) for k, v in stats.items() if k.startswith("cmdstat_")))


async def _redis_stream_usec(redis: RedisClient) -> tuple[float, float]:
    """Microseconds Redis has spent so far in stream appends and in stream reads."""
    stats = await redis.client.info("commandstats")
    return (
        float(stats.get("cmdstat_xadd", {}).get("usec", 0)),
        float(stats.get("cmdstat_xread", {}).get("usec", 0)),
    )


async def _redis_cpu_us(redis: RedisClient) -> float:
    """Microseconds of CPU the Redis server process has used so far (``INFO cpu``: its
    commands and its network I/O, which ``commandstats`` leaves out)."""
    cpu = await redis.client.info("cpu")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6


async def _drop(redis: RedisClient) -> None:
    keys = [k async for k in redis.client.scan_iter(match=f"{{{redis.namespace}}}:*", count=1000)]
    for start in range(0, len(keys), 1000):
        await redis.client.delete(*keys[start : start + 1000])


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
        shared = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000)
        await fleet.fill(shared)
        index = shared if mode == "redis_awaited" else ShadowedIndex(shared)
        redis = shared.redis
    config = PolicyConfig()
    core = RoutingCore(index, KVCostPolicy(config), config, LoadTracker(BLOCK))

    def request(i: int) -> RouteRequest:
        return RouteRequest(f"r-{i}", fleet.query, PROMPT_TOKENS, BLOCK)

    try:
        for i in range(min(decisions // 10, 200)):  # scripts, connections, candidate ids
            await core.route(request(i), fleet.engines)
        await _settle(index)
        # Paced: the request path's latency.
        usec = await _redis_usec(redis) if redis is not None else 0.0
        samples = await _paced(lambda i: core.route(request(i), fleet.engines), decisions, rate)
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


async def _paced(
    route: Callable[[int], Awaitable[object]], decisions: int, rate: float
) -> list[float]:
    """``route(i)`` for ``decisions`` decisions at ``rate`` a second; each one's
    microseconds."""
    loop = asyncio.get_running_loop()
    samples = []
    next_at = loop.time()
    for i in range(decisions):
        next_at += 1 / rate
        await asyncio.sleep(max(next_at - loop.time(), 0.0))
        t0 = time.perf_counter()
        await route(i)
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


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
                RedisClient(url, namespace, budget_ms=1000), config, f"bench-replica-{i}"
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
        usec = await _redis_usec(redis)
        samples = await _paced(lambda i: group.route(request(i), fleet.engines), decisions, rate)
        await group.settle()
        paced_usec = (await _redis_usec(redis) - usec) / decisions
        usec = await _redis_usec(redis)
        stream = await _redis_stream_usec(redis)
        redis_cpu = await _redis_cpu_us(redis)
        started = time.perf_counter()
        cpu = time.process_time()
        for i in range(decisions):
            await group.route(request(i), fleet.engines)
            # Let the background tasks run between decisions, as a server's event loop
            # does between requests: entries then carry the decisions made during one
            # append's round trip, not a backlog (the least batching a busy Redis sees).
            await asyncio.sleep(0)
        await group.settle()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        back_usec = (await _redis_usec(redis) - usec) / decisions
        back_cpu = (await _redis_cpu_us(redis) - redis_cpu) / decisions
        after = await _redis_stream_usec(redis)
        appends, reads = (b - a for a, b in zip(stream, after, strict=True))
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
            # Back to back, split by command: one append's share and one read's share
            # per replica (every replica reads every entry).
            "append_us_per_decision": appends / decisions,
            "read_us_per_decision_per_replica": reads / decisions / replicas,
        }
    finally:
        await group.close()


async def bench_stream_capacity(
    url: str, replicas: int, rate: float, seconds: float = 2.0
) -> dict[str, Any]:
    """The decision stream alone at a fixed total decision rate: ``replicas``
    :class:`DecisionSync` instances (each with its own connection and blocking reader)
    publish the 8,192-token prompt's 512 keys at ``rate`` decisions per second in all for
    ``seconds``, with the default ``sync_interval_s``, and read each other's. Readers
    decode every entry but record nothing (the engine is not theirs): Redis's work is
    the same, and this process could not record tens of thousands of 512-block
    decisions a second. Redis's share is both ``commandstats`` and its process's CPU
    (``INFO cpu``: with the network I/O that moving the entries costs)."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    config = ReplicatedIndexConfig()
    syncs = [
        DecisionSync(
            MemoryIndex(),
            RedisClient(url, namespace, budget_ms=1000),
            config,
            f"capacity-{i}",
            known=lambda engine: False,
        )
        for i in range(replicas)
    ]
    keys = Fleet(16).query
    engine = EngineKey("10.0.0.1:8000")
    redis = syncs[0].redis
    try:
        for sync in syncs:
            await sync.start()
        loop = asyncio.get_running_loop()
        usec = await _redis_usec(redis)
        cpu = await _redis_cpu_us(redis)
        started = loop.time()
        sent = 0
        credit = 0.0
        tick = 0.001
        while (now := loop.time()) < started + seconds:
            credit = rate * (now - started) - sent
            for n in range(int(credit)):
                syncs[n % replicas].publish(engine, keys, ttl=5.0)
                sent += 1
            await asyncio.sleep(tick)
        elapsed = loop.time() - started

        def settled() -> bool:
            published = sum(s.counters.published for s in syncs)
            return all(s.pending == 0 for s in syncs) and all(
                s.counters.foreign == published - s.counters.published for s in syncs
            )

        for _ in range(3000):  # 30 s at most
            if settled():
                break
            await asyncio.sleep(0.01)
        drained = loop.time() - started
        entries = sum(s.counters.entries for s in syncs)
        row = {
            "replicas": replicas,
            "target_per_s": rate,
            "sent_per_s": sent / elapsed,
            "drained_s": drained,
            "decisions_per_entry": sent / max(entries, 1),
            "redis_us_per_decision": (await _redis_usec(redis) - usec) / max(sent, 1),
            "redis_cpu_us_per_decision": (await _redis_cpu_us(redis) - cpu) / max(sent, 1),
            "settled": settled(),
        }
        await _drop(redis)
        return row
    finally:
        for sync in syncs:
            await sync.stop()
            await sync.redis.close()


async def bench_idle_append(url: str, count: int = 1000) -> dict[str, float]:
    """Redis's time for one 4 KB stream append (an 8,192-token decision's entry), no
    reader: back to back, and 2 ms apart (Redis idle in between, as at 500 decisions/s).
    The difference is what an idle server costs per command, not work."""
    redis = RedisClient(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000)
    payload = bytes(8 * PROMPT_TOKENS // BLOCK)
    key = redis.key("decisions")
    row: dict[str, float] = {}
    try:
        for label, pause in (("back_to_back", 0.0), ("paced_2ms", 0.002)):
            await redis.client.delete(key)
            before = await _redis_usec(redis)
            for _ in range(count):
                await redis.client.xadd(key, {"r": "bench", "d": payload})
                if pause:
                    await asyncio.sleep(pause)
            row[label] = (await _redis_usec(redis) - before) / count
        await redis.client.delete(key)
    finally:
        await redis.close()
    return row


def capacity(
    row: dict[str, Any], replicas: Sequence[int] = (1, 2, 4, 8, 16, 32)
) -> dict[int, float]:
    """Decisions per second one Redis sustains for N replicas, from one run's back-to-back
    split of Redis time: one append's share plus N reads' shares per decision (every
    replica reads every entry), and the rest of the commands (the load exchange) as
    measured."""
    a = row["append_us_per_decision"]
    b = row["read_us_per_decision_per_replica"]
    rest = max(row["redis_us_per_decision"] - a - b * row["replicas"], 0.0)
    return {n: 1e6 / max(a + b * n + rest, 1e-3) for n in replicas}


async def run(url: str, decisions: int, rate: float) -> dict[str, Any]:
    rows = []
    for engines in (16, 64):
        rows += [await bench_mode(url, engines, mode, decisions, rate) for mode in MODES]
        rows += [await bench_replicated(url, engines, n, decisions, rate) for n in REPLICAS]
    for row in rows:
        if "replicas" in row:
            row["decisions_per_s_per_redis"] = capacity(row)
    stream = [await bench_stream_capacity(url, n, rate) for n, rate in STREAM_RUNS]
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK,
        "decisions": rows,
        "idle_append_us": await bench_idle_append(url),
        "stream_capacity": stream,
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
    stream = results.get("stream_capacity")
    if stream:
        print(
            "the decision stream alone, 512 keys a decision, at a fixed rate for 2 s "
            "(Redis time and Redis process CPU per decision):"
        )
        for r in stream:
            print(
                f"  {r['replicas']} replica(s), {r['target_per_s']:>6,.0f}/s "
                f"(sent {r['sent_per_s']:,.0f}/s, read by all after {r['drained_s']:.2f} s): "
                f"{r['decisions_per_entry']:.1f} decisions per entry, "
                f"{r['redis_us_per_decision']:.1f} us commandstats, "
                f"{r['redis_cpu_us_per_decision']:.1f} us Redis CPU"
                + ("" if r["settled"] else " (readers did not catch up)")
            )
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
    for r in results["decisions"]:
        sustained = r.get("decisions_per_s_per_redis")
        if sustained:
            print(
                f"{r['mode']}, {r['engines']} engines, back to back: Redis us per decision "
                f"{r['append_us_per_decision']:.2f} (append) + "
                f"{r['read_us_per_decision_per_replica']:.2f} x N (reads); one Redis "
                "sustains " + ", ".join(f"N={n}: {v:,.0f}/s" for n, v in sustained.items())
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of a throw-away one")
    parser.add_argument("--output", default="bench-results/redis_decisions.json")
    parser.add_argument("--decisions", type=int, default=3000, help="decisions per mode")
    parser.add_argument("--rate", type=float, default=500, help="paced decisions per second")
    args = parser.parse_args(argv)
    results = run_on_redis(args.redis_url, lambda url: run(url, args.decisions, args.rate))
    report(results)
    save_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark of the Redis index beside the memory index.

``python -m router.bench.redis_index [--redis-url URL] [--output FILE]``
(``make bench-redis``) measures, on one machine and in one run:

* lookup latency (p50/p99) of an 8,192-token prompt (512 block keys) against 16 and 64
  engines, memory and Redis side by side, for a prompt the fleet holds (the walk goes
  hundreds of blocks deep) and one it does not (the walk stops at block 0);
* client commands per lookup, counted with ``MONITOR`` (the target is exactly one);
* the alternative to the Lua walk: one pipeline of ``HMGET`` calls and the walk in
  Python;
* event ingest into Redis: block events per second through the fenced event writer
  (the indexer's path), keys computed from token ids included;
* Redis memory per (block, engine) entry, from ``INFO memory`` deltas: blocks distinct
  per engine, a quarter held by every engine (16 and 256 engines), all shared.

It starts a throw-away ``redis-server`` unless ``--redis-url`` names one (it then uses
a random namespace and deletes it). Lookups run on uvloop, like ``kvroute serve``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.bench.report import save_results
from router.bench.throwaway_redis import monitored_commands, run_on_redis
from router.events.ingest import StreamState
from router.events.types import BlockRemoved, BlockStored, EventBatch
from router.events.writer import RemoteEventWriter
from router.hashing import block_keys, seed_for
from router.index import MemoryIndex
from router.index.base import KVIndex, Match
from router.index.redis import RedisIndex
from router.index.remote import AddOp, ExpireOp, WriteBatch
from router.redis.schema import pack_keys
from router.types import EngineKey, Tier

PROMPT_TOKENS = 8192
BLOCK = 16
OTHER_BLOCKS = 2000
"""Unrelated blocks every engine holds besides the query's prefix."""


def _pct(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[max(int(len(samples) * 0.99) - 1, 0)]


async def _time_us(fn: Callable[[], Awaitable[object]], repeat: int) -> tuple[float, float]:
    """Median and p99 in microseconds of sequential calls."""
    for _ in range(min(repeat // 10, 200)):  # warm caches, connections, scripts
        await fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _pct(samples)


class Fleet:
    """Engines that each hold unrelated blocks, a quarter of them a prefix of the query
    of varying depth (up to 13/16 of it), as in ``router.bench.core``."""

    def __init__(self, engines: int) -> None:
        rng = random.Random(engines)
        self.engines = [EngineKey(f"10.0.{i // 250}.{i % 250}:8000") for i in range(engines)]
        prompt = [rng.randrange(1024, 131_072) for _ in range(PROMPT_TOKENS)]
        self.query = block_keys(prompt, BLOCK, seed_for("bench-model"))
        self.miss = [rng.getrandbits(64) for _ in range(len(self.query))]
        self.holdings: list[tuple[EngineKey, list[int]]] = []
        for i, engine in enumerate(self.engines):
            self.holdings.append((engine, [rng.getrandbits(64) for _ in range(OTHER_BLOCKS)]))
            if i % 4 == 0:
                self.holdings.append((engine, self.query[: len(self.query) * (i % 16 + 1) // 16]))

    async def fill(self, index: KVIndex) -> None:
        if isinstance(index, RedisIndex):  # pipelined: filling is not what is measured
            await index.write([WriteBatch(e, [AddOp(keys)]) for e, keys in self.holdings])
        else:
            for engine, keys in self.holdings:
                await index.add(engine, keys)


# --------------------------------------------------------------------------- lookups


async def bench_lookups(url: str, engines: int, repeat: int) -> dict[str, Any]:
    fleet = Fleet(engines)
    memory = MemoryIndex()
    redis_index = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000)
    try:
        await fleet.fill(memory)
        await fleet.fill(redis_index)
        expected = memory.lookup_now(fleet.query, fleet.engines)
        if await redis_index.lookup(fleet.query, fleet.engines) != expected:
            raise AssertionError("the Redis and memory indexes disagree")
        depth = max(m.blocks for m in expected.values())
        row: dict[str, Any] = {"engines": engines, "walk_depth_blocks": depth}
        for name, idx in (("memory", memory), ("redis", redis_index)):
            for case, keys in (("hit", fleet.query), ("miss", fleet.miss)):
                p50, p99 = await _time_us(lambda i=idx, k=keys: i.lookup(k, fleet.engines), repeat)
                row[f"{name}_{case}_p50_us"] = p50
                row[f"{name}_{case}_p99_us"] = p99
        p50, p99 = await _time_us(
            lambda: _hmget_pipeline_lookup(redis_index, fleet.query, fleet.engines), repeat // 4
        )
        row["redis_hmget_pipeline_hit_p50_us"] = p50
        row["redis_hmget_pipeline_hit_p99_us"] = p99
        row["redis_commands_per_lookup"] = await _commands_per_lookup(url, redis_index, fleet)
        await _drop(redis_index)
        return row
    finally:
        await redis_index.close()


async def _commands_per_lookup(url: str, index: RedisIndex, fleet: Fleet, n: int = 50) -> float:
    async def lookups() -> None:
        for i in range(n):
            await index.lookup(fleet.query if i % 2 else fleet.miss, fleet.engines)

    return len(await monitored_commands(url, lookups)) / n


async def _hmget_pipeline_lookup(
    index: RedisIndex, keys: Sequence[int], candidates: Sequence[EngineKey]
) -> dict[EngineKey, Match]:
    """The measured alternative: fetch every block in one pipeline, walk in Python."""
    prefix = f"{{{index.redis.namespace}}}:"
    pipe = index.redis.client.pipeline(transaction=False)
    pipe.hmget(f"{prefix}engines", [c.label for c in candidates])
    packed = pack_keys(keys)
    pipe.hmget(f"{prefix}blocks", [packed[i : i + 8] for i in range(0, len(packed), 8)])
    ids, values = await pipe.execute()
    now = time.time()
    alive = {int(i): c for i, c in zip(ids, candidates, strict=True) if i is not None}
    depth: dict[EngineKey, Match] = {}
    offloaded = dict.fromkeys(alive.values(), 0)
    disk = dict.fromkeys(alive.values(), 0)
    pos = 0
    for pos, value in enumerate(values):
        holders = _holders(value, now)
        for engine_id in [i for i in alive if i not in holders]:
            engine = alive.pop(engine_id)
            if pos:
                depth[engine] = Match(pos, offloaded[engine], disk[engine])
        for engine_id, engine in alive.items():
            if holders[engine_id] >= 2:
                offloaded[engine] += 1
                if holders[engine_id] == 3:
                    disk[engine] += 1
        if not alive:
            return depth
    else:
        pos = len(values)
    for engine in alive.values():
        depth[engine] = Match(pos, offloaded[engine], disk[engine])
    return depth


def _holders(value: bytes | None, now: float) -> dict[int, int]:
    """Engine id -> 1 (GPU or live expiring), 2 (CPU at best) or 3 (disk only) of one
    block value."""
    if not value:
        return {}
    (n,) = struct.unpack_from("<H", value)
    holders = {}
    for (entry,) in struct.iter_unpack("<H", value[2 : 2 + 2 * n]):
        holders[entry >> 3] = 1 if entry & 1 else (2 if entry & 2 else 3)
    for engine_id, deadline in struct.iter_unpack("<Hd", value[2 + 2 * n :]):
        if deadline > now:
            holders[engine_id] = 1
    return holders


# --------------------------------------------------------------------------- ingest


def _ingest_workload(streams: int, blocks: int, per_event: int) -> list[tuple[int, EventBatch]]:
    """Batches from ``streams`` engines, interleaved: each stores ``per_event`` blocks
    chained to its previous ones; every fourth also evicts the oldest ``per_event``."""
    rng = random.Random(7)
    batches = []
    events_per_stream = blocks // streams // per_event
    for step in range(events_per_stream):
        for s in range(streams):
            base = step * per_event
            hashes = [(s << 40) | (base + j + 1) for j in range(per_event)]
            tokens = [rng.randrange(1024, 131_072) for _ in range(per_event * BLOCK)]
            parent = None if step == 0 else (s << 40) | base
            events: list[Any] = [BlockStored(hashes, parent, tokens, BLOCK, medium="GPU")]
            if step % 4 == 3 and step >= 8:
                old = (step - 8) * per_event
                events.append(BlockRemoved([(s << 40) | (old + j + 1) for j in range(per_event)]))
            batches.append((s, EventBatch(time.time(), events)))
    return batches


async def bench_ingest(url: str, streams: int, blocks: int, per_event: int) -> dict[str, Any]:
    workload = _ingest_workload(streams, blocks, per_event)
    block_events = sum(
        len(e.block_hashes)
        for _, b in workload
        for e in b.events  # type: ignore[union-attr]
    )
    index = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000, admin_timeout=30)
    writer = RemoteEventWriter(index, token="bench", write_timeout=30)
    states = []
    try:
        for s in range(streams):
            engine = EngineKey(f"10.1.0.{s}:8000")
            await index.lease(engine, "bench", 600_000, "acquire")
            states.append(StreamState(engine, "bench-model", BLOCK))
        t0 = time.perf_counter()
        for seq, (s, batch) in enumerate(workload):
            states[s].last_seq = seq
            await writer.apply(states[s], batch)
        await writer.drain()
        elapsed = time.perf_counter() - t0
        if writer.stats.batches != len(workload):
            raise AssertionError(f"only {writer.stats.batches} of {len(workload)} batches applied")
        await _drop(index)
        return {
            "streams": streams,
            "blocks_per_event": per_event,
            "batches": len(workload),
            "block_events": block_events,
            "seconds": elapsed,
            "block_events_per_s": block_events / elapsed,
            "pipelines": writer.stats.flushes,
        }
    finally:
        await writer.close()
        await index.close()


# --------------------------------------------------------------------------- memory


async def _used_memory(index: RedisIndex) -> int:
    info = await index.redis.client.info("memory")
    return int(info["used_memory"])


async def bench_memory(url: str, engines: int, blocks: int, shared: float) -> dict[str, Any]:
    """Bytes per (block, engine) entry as the indexer writes them (with engine hashes),
    and per expiring record (a routing decision's provisional holder). A ``shared``
    fraction of each engine's blocks is held by every engine, the rest by it alone."""
    rng = random.Random(11)
    index = RedisIndex(url, f"bench-{uuid.uuid4().hex[:8]}", budget_ms=1000, admin_timeout=60)
    try:
        common = [rng.getrandbits(64) for _ in range(int(blocks * shared))]
        before = await _used_memory(index)
        for e in range(engines):
            engine = EngineKey(f"10.2.{e // 250}.{e % 250}:8000")
            keys = common + [rng.getrandbits(64) for _ in range(blocks - len(common))]
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            for start in range(0, blocks, 4096):
                op = AddOp(keys[start : start + 4096], Tier.GPU, hashes[start : start + 4096])
                await index.write([WriteBatch(engine, [op])])
        firm = await _used_memory(index)
        for e in range(engines):
            engine = EngineKey(f"10.3.{e // 250}.{e % 250}:8000")
            keys = common + [rng.getrandbits(64) for _ in range(blocks - len(common))]
            for start in range(0, blocks, 4096):
                op = ExpireOp(keys[start : start + 4096], 3600.0)
                await index.write([WriteBatch(engine, [op])])
        expiring = await _used_memory(index)
        entries = engines * blocks
        await _drop(index)
        return {
            "engines": engines,
            "blocks_per_engine": blocks,
            "shared_blocks": shared == 1.0,
            "shared_fraction": shared,
            "firm_bytes_per_entry": (firm - before) / entries,
            "expiring_bytes_per_entry": (expiring - firm) / entries,
        }
    finally:
        await index.close()


async def _drop(index: RedisIndex) -> None:
    redis = index.redis
    keys = [k async for k in redis.client.scan_iter(match=f"{{{redis.namespace}}}:*", count=1000)]
    for start in range(0, len(keys), 1000):
        await redis.client.delete(*keys[start : start + 1000])


# --------------------------------------------------------------------------- main


async def run(url: str, repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK,
        "lookup": [await bench_lookups(url, n, repeat) for n in (16, 64)],
        "ingest": await bench_ingest(url, streams=16, blocks=160_000, per_event=16),
        "memory": [
            await bench_memory(url, 16, 20_000, shared=0.0),
            await bench_memory(url, 16, 20_000, shared=0.25),
            await bench_memory(url, 16, 20_000, shared=1.0),
            await bench_memory(url, 256, 4_000, shared=0.25),
        ],
    }
    return results


def report(results: dict[str, Any]) -> None:
    print(
        f"lookup of a {results['prompt_tokens']}-token prompt (block {results['block_size']}), "
        "microseconds, p50 / p99:"
    )
    header = ("engines", "memory hit", "redis hit", "memory miss", "redis miss", "hmget pipe")
    print("  ".join(f"{h:>16}" for h in header))
    for r in results["lookup"]:
        cells = [
            str(r["engines"]),
            *(
                f"{r[f'{k}_p50_us']:.0f} / {r[f'{k}_p99_us']:.0f}"
                for k in ("memory_hit", "redis_hit", "memory_miss", "redis_miss")
            ),
            "{:.0f} / {:.0f}".format(
                r["redis_hmget_pipeline_hit_p50_us"], r["redis_hmget_pipeline_hit_p99_us"]
            ),
        ]
        print("  ".join(f"{c:>16}" for c in cells))
    for r in results["lookup"]:
        print(
            f"{r['engines']} engines: {r['redis_commands_per_lookup']:.2f} Redis commands per "
            f"lookup, walk {r['walk_depth_blocks']} blocks deep on a hit"
        )
    i = results["ingest"]
    print(
        f"ingest: {i['block_events_per_s']:,.0f} block events/s ({i['block_events']:,} block "
        f"events in {i['batches']:,} batches from {i['streams']} streams, "
        f"{i['pipelines']:,} pipelines)"
    )
    for m in results["memory"]:
        share = m.get("shared_fraction", 1.0 if m["shared_blocks"] else 0.0)
        kind = {0.0: "distinct per engine", 1.0: "shared by every engine"}.get(
            share, f"{share:.0%} held by every engine, the rest distinct"
        )
        print(
            f"memory: {m['firm_bytes_per_entry']:.0f} bytes per firm entry, "
            f"{m['expiring_bytes_per_entry']:.0f} per expiring record "
            f"({m['engines']} engines x {m['blocks_per_engine']:,} blocks, {kind})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of a throw-away one")
    parser.add_argument("--output", default="bench-results/redis_index.json")
    parser.add_argument("--repeat", type=int, default=3000, help="lookups per measurement")
    args = parser.parse_args(argv)

    results = run_on_redis(args.redis_url, lambda url: run(url, args.repeat))
    report(results)
    save_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

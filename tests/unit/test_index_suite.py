"""The KV-block index contract. Every backend runs this suite.

Backends are built by factories in ``INDEX_FACTORIES`` that take a clock, so expiry is
tested without sleeping, and the test's fixture request, so a backend that needs a
server (Redis) gets it from a fixture that starts one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from router.index import KVIndex, Match, MemoryIndex
from router.index.redis import RedisIndex
from router.types import EngineKey, Tier

A, B, C = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000"), EngineKey("10.0.0.3:8000")
KEYS = [101, 102, 103, 104, 105, 106]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


IndexFactory = Callable[[FakeClock, pytest.FixtureRequest], Awaitable[KVIndex]]


async def _memory(clock: FakeClock, request: pytest.FixtureRequest) -> KVIndex:
    return MemoryIndex(clock=clock)  # the compiled holder table where it is built


async def _memory_pure(clock: FakeClock, request: pytest.FixtureRequest) -> KVIndex:
    return MemoryIndex(clock=clock, compact=False)


async def _redis(clock: FakeClock, request: pytest.FixtureRequest) -> KVIndex:
    # A generous budget: this suite tests semantics, not latency, on a shared machine.
    url = request.getfixturevalue("redis_url")
    return RedisIndex(url, request.getfixturevalue("redis_namespace"), clock=clock, budget_ms=5000)


INDEX_FACTORIES: dict[str, IndexFactory] = {
    "memory": _memory,
    "memory-pure": _memory_pure,
    "redis": _redis,
}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=sorted(INDEX_FACTORIES))
async def index(request: pytest.FixtureRequest, clock: FakeClock):
    idx = await INDEX_FACTORIES[request.param](clock, request)
    yield idx
    await idx.close()


async def test_empty_index_matches_nothing(index: KVIndex) -> None:
    assert await index.lookup(KEYS, [A, B]) == {}


async def test_depth_counts_leading_blocks_until_each_engines_first_miss(index: KVIndex) -> None:
    await index.add(A, KEYS[:4])
    await index.add(B, KEYS[:2])
    await index.add(B, KEYS[3:5])  # a hole at block 2: later blocks do not count
    got = await index.lookup(KEYS, [A, B])
    assert got == {A: Match(4), B: Match(2)}


async def test_walk_stops_where_no_candidate_holds_a_block(index: KVIndex) -> None:
    await index.add(A, [KEYS[0], KEYS[2]])
    assert await index.lookup(KEYS, [A]) == {A: Match(1)}


async def test_only_candidates_are_reported(index: KVIndex) -> None:
    await index.add(A, KEYS)
    await index.add(B, KEYS)
    assert await index.lookup(KEYS, [B, C]) == {B: Match(len(KEYS))}


async def test_remove_drops_blocks_of_one_engine(index: KVIndex) -> None:
    await index.add(A, KEYS)
    await index.add(B, KEYS)
    await index.remove(A, KEYS[3:])
    assert await index.lookup(KEYS, [A, B]) == {A: Match(3), B: Match(6)}


async def test_offloaded_blocks_count_toward_depth_and_are_marked(index: KVIndex) -> None:
    await index.add(A, KEYS[:2])
    await index.add(A, KEYS[2:4], tier=Tier.OFFLOADED)
    got = await index.lookup(KEYS, [A])
    assert got == {A: Match(4, offloaded=2)}
    assert got[A].weighted(0.8) == pytest.approx(3.6)


async def test_removing_one_tier_keeps_the_other(index: KVIndex) -> None:
    await index.add(A, KEYS[:3])
    await index.add(A, KEYS[:3], tier=Tier.OFFLOADED)
    await index.remove(A, KEYS[:3], tier=Tier.GPU)
    assert await index.lookup(KEYS, [A]) == {A: Match(3, offloaded=3)}
    await index.remove(A, KEYS[:3], tier=Tier.OFFLOADED)
    assert await index.lookup(KEYS, [A]) == {}


async def test_clear_drops_one_engine_entirely(index: KVIndex) -> None:
    await index.add(A, KEYS)
    await index.add(A, KEYS, tier=Tier.OFFLOADED)
    await index.add(B, KEYS[:2])
    await index.clear(A)
    assert await index.lookup(KEYS, [A, B]) == {B: Match(2)}


async def test_engine_added_after_a_clear_inherits_nothing(index: KVIndex) -> None:
    await index.add(A, KEYS)
    await index.clear(A)
    await index.add(C, KEYS[:1])
    assert await index.lookup(KEYS, [A, C]) == {C: Match(1)}


async def test_expiring_holder_counts_until_its_deadline(index: KVIndex, clock: FakeClock) -> None:
    await index.add(A, KEYS[:3], ttl=2.0)
    assert await index.lookup(KEYS, [A]) == {A: Match(3)}
    clock.now += 1.9
    assert await index.lookup(KEYS, [A]) == {A: Match(3)}
    clock.now += 0.2
    assert await index.lookup(KEYS, [A]) == {}


async def test_later_expiring_record_extends_the_deadline(index: KVIndex, clock: FakeClock) -> None:
    await index.add(A, KEYS[:2], ttl=2.0)
    clock.now += 1.5
    await index.add(A, KEYS[:2], ttl=2.0)
    clock.now += 1.5
    assert await index.lookup(KEYS, [A]) == {A: Match(2)}


async def test_firm_record_outlives_an_expiring_one(index: KVIndex, clock: FakeClock) -> None:
    await index.add(A, KEYS[:3], ttl=1.0)
    await index.add(A, KEYS[:2])
    clock.now += 5
    assert await index.lookup(KEYS, [A]) == {A: Match(2)}


async def test_expiring_record_never_downgrades_a_firm_one(
    index: KVIndex, clock: FakeClock
) -> None:
    await index.add(A, KEYS[:2])
    await index.add(A, KEYS[:4], ttl=1.0)
    clock.now += 5
    assert await index.lookup(KEYS, [A]) == {A: Match(2)}


async def test_remove_and_clear_drop_expiring_records(index: KVIndex) -> None:
    await index.add(A, KEYS, ttl=60)
    await index.add(B, KEYS, ttl=60)
    await index.remove(A, KEYS[2:])
    await index.clear(B)
    assert await index.lookup(KEYS, [A, B]) == {A: Match(2)}


async def test_an_offloaded_copy_does_not_keep_an_expired_gpu_record(
    index: KVIndex, clock: FakeClock
) -> None:
    await index.add(A, KEYS[:2], ttl=1.0)
    await index.add(A, KEYS[:2], tier=Tier.OFFLOADED)
    clock.now += 2
    assert await index.lookup(KEYS, [A]) == {A: Match(2, offloaded=2)}


async def test_a_block_in_both_tiers_is_two_records(index: KVIndex) -> None:
    await index.add(A, KEYS[:2])
    await index.add(A, KEYS[:2], tier=Tier.OFFLOADED)
    assert (await index.stats()).entries == 4


async def test_firm_and_expiring_holders_combine_across_engines(index: KVIndex) -> None:
    await index.add(A, KEYS[:2])
    await index.add(B, KEYS[:5], ttl=10)
    assert await index.lookup(KEYS, [A, B]) == {A: Match(2), B: Match(5)}


async def test_many_engines_are_tracked_independently(index: KVIndex) -> None:
    engines = [EngineKey(f"10.1.{i // 250}.{i % 250}:8000") for i in range(300)]
    for depth, engine in enumerate(engines):
        await index.add(engine, KEYS[: depth % 7])
    got = await index.lookup(KEYS, engines)
    assert got == {e: Match(d % 7) for d, e in enumerate(engines) if d % 7}


async def test_stats_count_blocks_and_entries(index: KVIndex, clock: FakeClock) -> None:
    await index.add(A, KEYS[:4])
    await index.add(B, KEYS[:2])
    await index.add(C, [999], ttl=1.0)
    stats = await index.stats()
    assert (stats.blocks, stats.entries, stats.engines) == (5, 7, 2)
    clock.now += 2
    stats = await index.stats()
    assert (stats.blocks, stats.entries) == (4, 6)


# --------------------------------------------------------------------------- three tiers


async def test_each_block_counts_at_its_best_tier(index: KVIndex) -> None:
    # Blocks 0-1 on GPU (and disk), 2-3 on CPU and disk, 4-5 on disk alone.
    await index.add(A, KEYS[:2])
    await index.add(A, KEYS[2:4], tier=Tier.CPU)
    await index.add(A, KEYS, tier=Tier.DISK)
    assert await index.lookup(KEYS, [A]) == {A: Match(6, offloaded=4, disk=2)}


async def test_the_cpu_tier_is_the_offloaded_tier() -> None:
    assert Tier.OFFLOADED is Tier.CPU
    assert list(Tier) == [Tier.GPU, Tier.CPU, Tier.DISK]


async def test_removal_from_gpu_keeps_the_cpu_and_disk_copies(index: KVIndex) -> None:
    await index.add(A, KEYS[:3])
    await index.add(A, KEYS[:3], tier=Tier.CPU)
    await index.add(A, KEYS[:3], tier=Tier.DISK)
    await index.remove(A, KEYS[:3], tier=Tier.GPU)
    assert await index.lookup(KEYS, [A]) == {A: Match(3, offloaded=3, disk=0)}
    await index.remove(A, KEYS[:3], tier=Tier.CPU)
    assert await index.lookup(KEYS, [A]) == {A: Match(3, offloaded=3, disk=3)}
    await index.remove(A, KEYS[:1], tier=Tier.DISK)
    assert await index.lookup(KEYS, [A]) == {}


async def test_remove_without_a_tier_drops_all_three(index: KVIndex) -> None:
    for tier in Tier:
        await index.add(A, KEYS[:2], tier=tier)
    await index.add(B, KEYS[:2], tier=Tier.DISK)
    await index.remove(A, KEYS[:2])
    assert await index.lookup(KEYS, [A, B]) == {B: Match(2, offloaded=2, disk=2)}


async def test_clear_drops_the_disk_tier_too(index: KVIndex) -> None:
    await index.add(A, KEYS[:2], tier=Tier.DISK)
    await index.add(B, KEYS[:1], tier=Tier.DISK)
    await index.clear(A)
    assert await index.lookup(KEYS, [A, B]) == {B: Match(1, offloaded=1, disk=1)}
    stats = await index.stats()
    assert (stats.blocks, stats.engines) == (1, 1)


async def test_an_engine_holding_deeper_on_disk_matches_deeper(index: KVIndex) -> None:
    await index.add(A, KEYS[:2])
    await index.add(B, KEYS[:5], tier=Tier.DISK)
    got = await index.lookup(KEYS, [A, B])
    assert got == {A: Match(2), B: Match(5, offloaded=5, disk=5)}

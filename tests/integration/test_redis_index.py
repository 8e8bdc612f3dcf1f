"""The Redis index beyond the shared contract: round trips, budgets, outages, TLS,
garbage collection, fenced writes. A real ``redis-server``; time from a fake clock."""

from __future__ import annotations

import asyncio
import random
import shutil
import struct
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from redis.crc import key_slot
from support.redis import RedisServer, monitored_commands, random_namespace, redis_cluster

from router.config import IndexConfig, RedisIndexConfig
from router.index import Match, MemoryIndex, index_from_config
from router.index.base import IndexUnavailable
from router.index.redis import RedisIndex, bucket_key, bucket_name
from router.index.remote import (
    AddOp,
    ClearOp,
    ExpireOp,
    Fence,
    RemoveOp,
    WriteBatch,
    WriteResult,
)
from router.redis.client import client_from_url
from router.types import EngineKey, Tier

A, B, C = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000"), EngineKey("10.0.0.3:8000", 1)
KEYS = list(range(1001, 1013))


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.02)


async def table_fields(index: RedisIndex, table: str) -> int:
    """Fields in every bucket of a bucketed table, counted by scanning its keys."""
    total = 0
    async for name in index.redis.client.scan_iter(match=index.redis.key(table) + ":*", count=1000):
        total += await index.redis.client.hlen(name)
    return total


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def index(redis_url: str, redis_namespace: str, clock: Clock):
    idx = RedisIndex(redis_url, redis_namespace, clock=clock, budget_ms=5000)
    yield idx
    await idx.close()


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of this test alone, for tests that freeze or kill it."""
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not on the PATH")
    yield server
    server.kill()


# --------------------------------------------------------------------------- round trips


async def test_a_lookup_is_exactly_one_round_trip(index: RedisIndex, redis_url: str) -> None:
    keys = list(range(5000, 5512))  # an 8,192-token prompt in blocks of 16
    await index.add(A, keys)
    await index.add(B, keys[:300], ttl=60)
    fleet = [A, B, C]
    await index.lookup(keys, fleet)  # loads the script and caches the fleet's engine ids

    async def lookups() -> None:
        assert await index.lookup(keys, fleet) == {A: Match(512), B: Match(300)}

    sent = await monitored_commands(redis_url, lookups)
    assert [c.split()[0] for c in sent] == ["EVALSHA"]


async def test_a_lookup_after_the_engine_map_changed_is_still_one_round_trip(
    index: RedisIndex, redis_url: str
) -> None:
    await index.add(A, KEYS)
    await index.lookup(KEYS, [A, B])
    await index.add(B, KEYS[:3])  # B gets an engine id: the cached ids are stale

    async def lookup() -> None:
        assert await index.lookup(KEYS, [A, B]) == {A: Match(12), B: Match(3)}

    sent = await monitored_commands(redis_url, lookup)
    assert [c.split()[0] for c in sent] == ["EVALSHA"]


async def test_scripts_are_reloaded_when_redis_forgot_them(index: RedisIndex) -> None:
    await index.add(A, KEYS)
    await index.redis.client.script_flush()
    assert await index.lookup(KEYS, [A]) == {A: Match(12)}


# --------------------------------------------------------------------------- semantics


async def test_random_operations_match_the_memory_index(index: RedisIndex, clock: Clock) -> None:
    """Both backends see the same random writes; every lookup must agree."""
    rng = random.Random(8)
    memory = MemoryIndex(clock=clock)
    engines = [A, B, C, EngineKey("10.0.0.4:8000")]
    trunk = list(range(1, 9))
    # Prompts sharing prefixes. Offloaded records go to their own prompts: the memory
    # index keeps a GPU bit when a firm offloaded record follows a live expiring one.
    shared = [[*trunk, 100 + i, 110 + i, 120 + i, 130 + i] for i in range(3)]
    offloaded = [[900 + i for i in range(10)], [900, 901, 902, 950, 951]]
    for _ in range(250):
        engine = rng.choice(engines)
        kind = rng.random()
        prompt = rng.choice(shared)
        lo = rng.randrange(0, 4)
        hi = rng.randrange(lo + 1, len(prompt) + 1)
        if kind < 0.3:
            await _both(memory, index, "add", engine, prompt[lo:hi])
        elif kind < 0.45:
            await _both(memory, index, "add", engine, prompt[:hi], ttl=rng.choice([1.0, 3.0]))
        elif kind < 0.55:
            await _both(memory, index, "add", engine, rng.choice(offloaded), Tier.OFFLOADED)
        elif kind < 0.75:
            tier = rng.choice([None, Tier.GPU, Tier.OFFLOADED])
            target = rng.choice([*shared, *offloaded])
            await _both(memory, index, "remove", engine, target[lo:hi], tier)
        elif kind < 0.8:
            await _both(memory, index, "clear", engine)
        else:
            clock.now += rng.choice([0.5, 1.0, 2.5])
        for prompt in [*shared, *offloaded]:
            candidates = rng.sample(engines, rng.randrange(1, len(engines) + 1))
            assert await index.lookup(prompt, candidates) == memory.lookup_now(prompt, candidates)


async def _both(memory: MemoryIndex, redis_index: RedisIndex, op: str, *args, **kwargs) -> None:
    await getattr(memory, op)(*args, **kwargs)
    await getattr(redis_index, op)(*args, **kwargs)


async def test_random_operations_on_a_growing_index_match_the_memory_index(
    index: RedisIndex, clock: Clock
) -> None:
    """Random 64-bit keys, so blocks spread over many buckets, and enough of them that
    the bucketed tables split many times while blocks move between one holder (their
    bucket) and several (the shared hash): firm adds in three tiers, expiring adds,
    removals, clears, time passing. Every lookup agrees with the memory index, and the
    firm entries the stats count equal the memory index's."""
    rng = random.Random(21)
    memory = MemoryIndex(clock=clock)
    engines = [EngineKey(f"10.0.3.{i}:8000") for i in range(6)]
    trunks = [[rng.getrandbits(64) for _ in range(40)] for _ in range(3)]
    prompts = [
        trunk[: rng.randrange(10, 41)] + [rng.getrandbits(64) for _ in range(rng.randrange(5, 60))]
        for trunk in trunks
        for _ in range(4)
    ]
    for step in range(160):
        engine = rng.choice(engines)
        prompt = rng.choice(prompts)
        kind = rng.random()
        hi = rng.randrange(1, len(prompt) + 1)
        if kind < 0.35:
            tier = rng.choice([Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK])
            await _both(memory, index, "add", engine, prompt[:hi], tier)
        elif kind < 0.5:
            await _both(memory, index, "add", engine, prompt[:hi], ttl=rng.choice([1.0, 4.0]))
        elif kind < 0.6:  # unrelated blocks: the tables grow
            await _both(memory, index, "add", engine, [rng.getrandbits(64) for _ in range(400)])
        elif kind < 0.8:
            lo = rng.randrange(0, hi)
            tier = rng.choice([None, Tier.GPU, Tier.CPU, Tier.DISK])
            await _both(memory, index, "remove", engine, prompt[lo:hi], tier)
        elif kind < 0.85:
            await _both(memory, index, "clear", engine)
        else:
            clock.now += rng.choice([0.5, 2.0, 5.0])
        for prompt in prompts:
            candidates = rng.sample(engines, rng.randrange(1, len(engines) + 1))
            assert await index.lookup(prompt, candidates) == memory.lookup_now(prompt, candidates)
        if step % 40 == 39:
            clock.now += 10  # every record expired: firm entries alone remain
            assert (await index.stats()).entries == (await memory.stats()).entries
    level = int(await index.redis.client.hget(index.redis.key("blocks"), "L"))
    assert level >= 5  # the blocks table split into dozens of buckets on the way


async def test_prompts_longer_than_a_script_chunk_are_walked_whole(index: RedisIndex) -> None:
    keys = list(range(10_000, 12_500))
    await index.add(A, keys)
    await index.add(B, keys[:1700])
    await index.add(C, keys[:2100], ttl=60)
    await index.remove(A, keys[2400:2401])
    assert await index.lookup(keys, [A, B, C]) == {A: Match(2400), B: Match(1700), C: Match(2100)}


async def test_expiring_records_count_once_per_block_and_engine(
    index: RedisIndex, clock: Clock
) -> None:
    await index.add(A, KEYS, ttl=2.0)
    await index.add(A, KEYS[:6], ttl=5.0)  # replaces six records, adds none
    await index.remove(A, KEYS[:2])
    stats = await index.stats()
    assert (stats.blocks, stats.entries, stats.engines) == (10, 10, 0)
    clock.now += 3
    stats = await index.stats()
    assert (stats.blocks, stats.entries) == (4, 4)
    clock.now += 3
    stats = await index.stats()
    assert (stats.blocks, stats.entries) == (0, 0)
    assert await table_fields(index, "blocks") == 0  # memory reclaimed
    assert await index.redis.client.hget(index.redis.key("blocks"), "n") == b"0"


async def test_a_cleared_engine_is_collected_and_its_id_reused_without_inheritance(
    index: RedisIndex, clock: Clock
) -> None:
    engines = index.redis.key("engines")
    many = list(range(20_000, 23_000))  # more than one collection step
    await index.add(A, many)
    await index.add(A, KEYS, ttl=10.0)
    old_id = await index.redis.client.hget(engines, A.label)
    await index.clear(A)
    stats = await index.stats()  # collects all garbage
    assert (stats.engines, stats.entries) == (0, 0)
    # The id waits until the cleared engine's expiring records have expired.
    await index.add(B, [1])
    assert await index.redis.client.hget(engines, B.label) != old_id
    clock.now += 11
    await index.add(C, [2])
    assert await index.redis.client.hget(engines, C.label) == old_id
    assert await index.lookup(many[:10], [C]) == {}
    assert await index.lookup(KEYS, [C]) == {}


async def test_namespaces_do_not_see_each_other(redis_url: str, clock: Clock) -> None:
    one = RedisIndex(redis_url, random_namespace(), clock=clock, budget_ms=5000)
    two = RedisIndex(redis_url, random_namespace(), clock=clock, budget_ms=5000)
    try:
        await one.add(A, KEYS)
        assert await two.lookup(KEYS, [A]) == {}
        await one.redis.client.delete(
            *[k async for k in one.redis.client.scan_iter(f"{{{one.redis.namespace}}}:*")]
        )
    finally:
        await one.close()
        await two.close()


def test_a_namespace_with_braces_is_refused() -> None:
    with pytest.raises(ValueError, match="braces"):
        RedisIndex("redis://127.0.0.1:1/0", "bad{ns}")


# --------------------------------------------------------------------------- outages


async def test_a_frozen_redis_fails_calls_within_the_budget_then_recovers(
    own_server: RedisServer,
) -> None:
    idx = RedisIndex(own_server.url, "outage", budget_ms=200, retry_interval=0.05)
    try:
        await idx.add(A, KEYS)
        own_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await idx.lookup(KEYS, [A])
            # Bounded by the budget; the slack only guards against a busy machine.
            assert time.monotonic() - started < 2.0
            with pytest.raises(IndexUnavailable):  # refused at once while Redis is down
                await idx.add(B, KEYS)
            assert idx.counters.fast_failures == 1 and not idx.available
        finally:
            own_server.resume()

        async def answers() -> bool:
            try:
                return await idx.lookup(KEYS, [A]) == {A: Match(12)}
            except IndexUnavailable:
                return False

        await until(answers)
        assert idx.available and idx.counters.outages == 1
    finally:
        await idx.close()


async def test_a_restarted_redis_is_reconnected_and_scripts_reloaded(
    own_server: RedisServer,
) -> None:
    idx = RedisIndex(own_server.url, "restart", budget_ms=500, retry_interval=0.05)
    replacement = None
    try:
        await idx.add(A, KEYS)
        own_server.kill()
        with pytest.raises(IndexUnavailable):
            await idx.lookup(KEYS, [A])
        replacement = RedisServer(port=own_server.port)  # empty: a restart without persistence

        async def answers() -> bool:
            try:
                await idx.add(A, KEYS[:2])
                return await idx.lookup(KEYS, [A]) == {A: Match(2)}
            except IndexUnavailable:
                return False

        await until(answers)
    finally:
        await idx.close()
        if replacement is not None:
            replacement.kill()


async def test_rediss_urls_pass_tls_parameters_through() -> None:
    try:
        server = RedisServer(tls=True)
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"no TLS-capable redis-server or openssl: {exc}")
    except Exception as exc:  # a redis-server built without TLS refuses the options
        pytest.skip(f"redis-server did not start with TLS: {exc}")
    url = f"{server.url}?ssl_ca_certs={server.tls_files['ca']}"
    idx = RedisIndex(url, "tls", budget_ms=5000)
    try:
        await idx.add(A, KEYS)
        assert await idx.lookup(KEYS, [A]) == {A: Match(12)}
    finally:
        await idx.close()
        server.kill()


# --------------------------------------------------------------------------- fenced writes


async def test_a_lease_admits_one_writer_until_it_lapses(index: RedisIndex) -> None:
    assert await index.lease(A, "one", 150, "acquire")
    assert not await index.lease(A, "two", 150, "acquire")
    assert await index.lease(A, "one", 150, "renew")
    assert await index.lease(B, "two", 150, "acquire")  # leases are per engine stream

    async def two_takes_over() -> bool:
        return await index.lease(A, "two", 10_000, "acquire")

    await until(two_takes_over)  # "one" stopped renewing
    assert not await index.lease(A, "one", 150, "renew")
    assert not await index.lease(A, "one", 150, "release")
    assert await index.lease(A, "two", 150, "release")
    assert await index.lease(A, "one", 150, "acquire")


async def test_fenced_writes_reject_stale_tokens_and_applied_sequences(index: RedisIndex) -> None:
    assert await index.lease(A, "one", 10_000, "acquire")
    first = WriteBatch(A, [AddOp(KEYS[:4], Tier.GPU, [11, 12, 13, 14])], Fence("one", 7, 1.5))
    assert await index.write([first]) == [WriteResult.APPLIED]
    again = WriteBatch(A, [RemoveOp(KEYS[:4])], Fence("one", 7, 1.5))
    older = WriteBatch(A, [RemoveOp(KEYS[:4])], Fence("one", 3, 1.0))
    stale = WriteBatch(A, [ClearOp()], Fence("two", 8, 2.0))
    assert await index.write([again, older, stale]) == [
        WriteResult.OLD_SEQ,
        WriteResult.OLD_SEQ,
        WriteResult.STALE_TOKEN,
    ]
    assert await index.lookup(KEYS, [A]) == {A: Match(4)}  # none of them wrote anything
    position = await index.stream_position(A)
    assert (position.seq, position.ts) == (7, 1.5)
    assert position.hashes == ({11: KEYS[0], 12: KEYS[1], 13: KEYS[2], 14: KEYS[3]}, {}, {})


async def test_a_fence_without_sequence_restarts_the_stream(index: RedisIndex) -> None:
    assert await index.lease(A, "one", 10_000, "acquire")
    batches = [
        WriteBatch(A, [AddOp(KEYS[:2], Tier.GPU, [1, 2])], Fence("one", 40, 9.0)),
        WriteBatch(A, [ClearOp()], Fence("one", None)),  # the engine restarted
        WriteBatch(A, [AddOp(KEYS[:1], Tier.OFFLOADED, [5])], Fence("one", 0, 10.0)),
        WriteBatch(A, [AddOp(KEYS[:2], Tier.DISK, [5, 6])], Fence("one", 1, 10.5)),
    ]
    assert await index.write(batches) == [WriteResult.APPLIED] * 4
    position = await index.stream_position(A)
    # A writer taking the stream over reloads every tier's engine hashes, disk too.
    assert (position.seq, position.hashes) == (1, ({}, {5: KEYS[0]}, {5: KEYS[0], 6: KEYS[1]}))
    assert await index.lookup(KEYS, [A]) == {A: Match(2, offloaded=2, disk=1)}


async def test_one_pipelined_write_applies_many_batches_in_order(index: RedisIndex) -> None:
    batches = [WriteBatch(A, [AddOp([k])]) for k in KEYS]
    batches += [
        WriteBatch(B, [ExpireOp(KEYS[:5], 30.0)]),
        WriteBatch(A, [RemoveOp(KEYS[8:9], Tier.GPU)]),
    ]
    assert await index.write(batches) == [WriteResult.APPLIED] * len(batches)
    assert await index.lookup(KEYS, [A, B]) == {A: Match(8), B: Match(5)}


# --------------------------------------------------------------------------- cluster


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_the_index_works_on_redis_cluster(clock: Clock) -> None:
    """One namespace lives in one slot; here it is on another node than the one the URL
    names, so scripts and write pipelines must be routed to it."""
    namespace = next(
        ns
        for ns in (f"cluster-{i}" for i in range(100))
        if key_slot(f"{{{ns}}}:blocks".encode()) >= 16384 // 3
    )
    with redis_cluster(3) as servers:
        url = f"redis://127.0.0.1:{servers[0].port}/0?cluster=true"
        idx = RedisIndex(url, namespace, clock=clock, budget_ms=5000)
        try:
            await idx.add(A, KEYS)
            await idx.add(B, KEYS[:4], ttl=10)
            assert await idx.lease(C, "t", 10_000, "acquire")
            batches = [
                WriteBatch(C, [AddOp(KEYS[:6], Tier.GPU, list(range(6)))], Fence("t", 1, 1.0)),
                WriteBatch(A, [RemoveOp(KEYS[8:9])]),
            ]
            assert await idx.write(batches) == [WriteResult.APPLIED] * 2
            assert await idx.lookup(KEYS, [A, B, C]) == {A: Match(8), B: Match(4), C: Match(6)}
            assert (await idx.stream_position(C)).seq == 1
            await idx.clear(A)
            stats = await idx.stats()
            # Blocks: C's 6 firm ones, and B's 4 with records (counted in each table).
            assert (stats.blocks, stats.entries, stats.engines) == (10, 10, 1)
        finally:
            await idx.close()


def test_the_index_section_selects_the_backend() -> None:
    assert isinstance(index_from_config(IndexConfig()), MemoryIndex)
    redis = RedisIndexConfig(url="rediss://h:1/0", namespace="n", budget_ms=3)
    redis_config = IndexConfig(backend="redis", redis=redis)
    chosen = index_from_config(redis_config)
    assert isinstance(chosen, RedisIndex)
    redis = chosen.redis
    assert (redis.url, redis.namespace, redis.budget) == ("rediss://h:1/0", "n", 0.003)


async def test_one_slow_answer_is_not_an_outage_but_slow_answers_in_a_row_are(
    own_server: RedisServer,
) -> None:
    idx = RedisIndex(
        own_server.url, "slow", budget_ms=200, retry_interval=0.05, slow_calls_to_outage=3
    )
    try:
        await idx.add(A, KEYS)
        own_server.pause()
        try:
            for _ in range(2):
                with pytest.raises(IndexUnavailable):
                    await idx.lookup(KEYS, [A])
            assert idx.available and idx.counters.slow_calls == 2
        finally:
            own_server.resume()
        # A good answer resets the run of slow ones.
        assert await idx.lookup(KEYS, [A]) == {A: Match(12)}
        own_server.pause()
        try:
            for _ in range(2):
                with pytest.raises(IndexUnavailable):
                    await idx.lookup(KEYS, [A])
            assert idx.available and idx.counters.outages == 0
            with pytest.raises(IndexUnavailable):  # the third in a row
                await idx.lookup(KEYS, [A])
            assert not idx.available and idx.counters.outages == 1
        finally:
            own_server.resume()
    finally:
        await idx.close()


async def test_calls_beyond_the_connection_pool_wait_for_a_connection(
    redis_url: str, redis_namespace: str
) -> None:
    # redis-py's default pool fails the call past its size ("Too many connections"),
    # which would read as an outage; kvroute's pool makes it wait within the budget.
    client = client_from_url(redis_url, max_connections=1)
    idx = RedisIndex(redis_url, redis_namespace, budget_ms=5000, client=client)
    try:
        await idx.add(A, KEYS)
        answers = await asyncio.gather(*(idx.lookup(KEYS, [A]) for _ in range(20)))
        assert answers == [{A: Match(12)}] * 20
        assert idx.available and idx.counters.outages == 0
    finally:
        await idx.close()


# --------------------------------------------------------------------------- layout


async def test_an_index_of_an_old_layout_is_never_read_and_the_new_one_is_built_beside_it(
    index: RedisIndex, redis_namespace: str
) -> None:
    """Keys written by releases of older layouts stay as they are and are never read:
    layout 1 (no version in key names, ``engine id x 4 + tier bits``) and layout 2
    (``{ns}:v2:blocks``, one big hash). This release's keys carry their layout
    (``{ns}:v3:...``), so it starts empty and learns from events instead of misreading
    an engine id, a tier or a table."""
    import struct

    from router.index.redis import bucket_key

    tag = f"{{{redis_namespace}}}:"
    field = struct.pack("<Q", KEYS[0])
    # Engine id 1 on GPU in layout 1 (1 x 4 + 1) would read as id 0, disk tier.
    await index.redis.client.hset(f"{tag}engines", mapping={A.label: 1, B.label: 0})
    await index.redis.client.hset(f"{tag}blocks", field, struct.pack("<HH", 1, 1 * 4 + 1))
    # Layout 2: A (id 0) on GPU.
    await index.redis.client.hset(f"{tag}v2:engines", mapping={A.label: 0})
    await index.redis.client.hset(f"{tag}v2:blocks", field, struct.pack("<HH", 1, 0 * 8 + 1))
    assert await index.lookup(KEYS[:1], [A, B]) == {}
    await index.add(B, KEYS[:2])
    found = await index.lookup(KEYS[:2], [A, B])
    assert found == {B: Match(2)}
    assert index.redis.key("blocks") == f"{tag}v3:blocks"
    assert await table_fields(index, "blocks") == 2
    assert await index.redis.client.hexists(
        bucket_key(index.redis.key("blocks"), KEYS[0], 0, 0), field
    )
    assert await index.redis.client.hget(f"{tag}blocks", field) == struct.pack("<HH", 1, 5)
    assert await index.redis.client.hget(f"{tag}v2:blocks", field) == struct.pack("<HH", 1, 1)


# --------------------------------------------------------------------------- bucketed tables


async def test_tables_grow_by_splitting_buckets_that_stay_listpacks(
    index: RedisIndex, clock: Clock
) -> None:
    """20,000 blocks of one engine (with its hashes), a quarter of them held by a second
    too: the bucketed tables (blocks with one holder, the engine's holdings) split
    bucket by bucket as they fill, every bucket stays a listpack under 128 fields, every
    key sits where Python's copy of the bucket function says, blocks with two holders
    move to the shared hash, the counts are exact, and lookups and the resume map see
    every block."""
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    hashes = [k ^ 0x5EED for k in keys]
    for start in range(0, len(keys), 2_500):  # several writes: geometry saved and reread
        part = slice(start, start + 2_500)
        await index.write([WriteBatch(A, [AddOp(keys[part], Tier.GPU, hashes[part])])])
    await index.add(B, keys[:5_000])
    client, key = index.redis.client, index.redis.key
    blocks = key("blocks")
    held = f"{key('held')}:{int(await client.hget(key('engines'), A.label))}:0"
    for table, held_keys in ((blocks, keys[5_000:]), (held, keys)):
        level, split, n = (int(v) for v in await client.hmget(table, ["L", "s", "n"]))
        buckets = (1 << level) + split
        assert n == len(held_keys)
        assert n <= 48 * buckets < 2 * n  # grown with the data, not far ahead of it
        sizes = []
        for b in range(buckets):
            name = bucket_name(table, b)
            sizes.append(await client.hlen(name))
            assert await client.object("encoding", name) == b"listpack"
        assert sum(sizes) == n and max(sizes) < 128
        for k in held_keys[:200]:
            assert await client.hexists(bucket_key(table, k, level, split), struct.pack("<Q", k))
    shared = index.redis.key("shared")
    assert await client.hlen(shared) == 5_000 + 1  # and the field keeping it a hash table
    assert await client.object("encoding", shared) == b"hashtable"
    stats = await index.stats()
    assert (stats.blocks, stats.entries, stats.engines) == (20_000, 25_000, 2)
    prompt = keys[:3_000] + keys[12_000:14_000]  # not a chain, but a walk is a walk
    assert await index.lookup(prompt, [A, B]) == {A: Match(5_000), B: Match(3_000)}
    position = await index.stream_position(A)
    assert position.hashes[Tier.GPU] == dict(zip(hashes, keys, strict=True))
    await index.remove(A, keys[2_500:])  # blocks B shares go back to one holder
    stats = await index.stats()
    assert (stats.blocks, stats.entries) == (5_000, 7_500)
    assert await client.hlen(shared) == 2_500 + 1
    assert int(await client.hget(blocks, "n")) == 2_500
    assert await index.lookup(keys[:5_000], [A, B]) == {A: Match(2_500), B: Match(5_000)}
    assert len((await index.stream_position(A)).hashes[Tier.GPU]) == 2_500


async def test_a_block_of_one_holder_is_read_from_its_bucket_only_when_it_can_matter(
    index: RedisIndex, redis_url: str, clock: Clock
) -> None:
    """A block one engine holds lives in its bucket, and a lookup reads it there (one
    ``HGET``) when it reaches it. While the block has expiring records it lives in the
    shared hash, read a chunk at a time: the add that records it moves it there, the
    sweep of its last record moves it back. And where every candidate still matching
    has a live record the bucket is not read at all: a record counts at the best tier."""
    rng = random.Random(4)
    history = [rng.getrandbits(64) for _ in range(200)]
    await index.add(A, history)
    await index.lookup(history, [A])  # loads the script and the candidates' ids
    blocks, shared = index.redis.key("blocks"), index.redis.key("shared")

    async def walk(candidates: list[EngineKey], expected: dict[EngineKey, Match]) -> int:
        async def lookup() -> None:
            assert await index.lookup(history, candidates) == expected

        commands = await monitored_commands(redis_url, lookup, scripts=True)
        return [c.split()[0] for c in commands].count("HGET")

    async def in_buckets() -> int:
        return int(await index.redis.client.hget(blocks, "n"))

    assert await walk([A], {A: Match(200)}) == 200
    await index.add(B, history, ttl=5)  # a routing decision: B is recorded
    assert (await in_buckets(), await index.redis.client.hlen(shared)) == (0, 200 + 1)
    assert await walk([A, B], {A: Match(200), B: Match(200)}) == 0
    clock.now += 6
    await index.stats()  # sweeps the expired records
    assert (await in_buckets(), await index.redis.client.hlen(shared)) == (200, 1)
    assert await walk([A], {A: Match(200)}) == 200
    # Records on blocks already recorded move nothing; a firm change can move a block
    # back to its bucket while it has records.
    await index.add(A, history, ttl=60)
    await index.add(C, history[:100], Tier.CPU)  # two holders: shared either way
    await index.remove(C, history[:100])  # one again: back to the bucket
    assert await in_buckets() == 100
    assert await walk([A], {A: Match(200)}) == 0  # A's records count: no bucket read
    # C has no record at block 0: it is read there for C, which holds nothing.
    assert await walk([A, C], {A: Match(200)}) == 1


async def test_a_firm_entry_costs_under_64_bytes_of_redis_memory(own_server: RedisServer) -> None:
    """The layout's point (issue "The index at fleet scale"): 16 engines x 5,000 blocks
    with their engine hashes, a quarter of the blocks held by every engine, the rest by
    one, cost at most 64 bytes of ``used_memory`` per (block, engine) entry. A server of
    this test alone, so nothing else moves the figure."""
    idx = RedisIndex(own_server.url, random_namespace(), budget_ms=5000)
    try:
        rng = random.Random(5)
        shared = [rng.getrandbits(64) for _ in range(1_250)]
        engines = [EngineKey(f"10.1.0.{i}:8000") for i in range(16)]
        await idx.add(A, KEYS)  # scripts loaded, first keys made: not part of the figure
        before = int((await idx.redis.client.info("memory"))["used_memory"])
        for engine in engines:
            own = shared + [rng.getrandbits(64) for _ in range(3_750)]
            await idx.write([WriteBatch(engine, [AddOp(own, Tier.GPU, [k ^ 1 for k in own])])])
        used = int((await idx.redis.client.info("memory"))["used_memory"]) - before
        assert (await idx.stats()).entries == 16 * 5_000 + len(KEYS)
        assert used / (16 * 5_000) <= 64
    finally:
        await idx.close()

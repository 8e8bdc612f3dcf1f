"""A router's side of the Redis index: records off the request path, the shadow it
falls back to, reconciliation after outages, and load shared between replicas.
A real ``redis-server``; outages by SIGSTOP and by killing it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from support.redis import RedisServer, monitored_commands

from router.fleet.load import InFlight, LoadTracker, load_of
from router.fleet.shared_load import SharedLoad, encode_load
from router.index import Match
from router.index.base import IndexUnavailable
from router.index.redis import RedisIndex
from router.index.shadow import ShadowedIndex
from router.redis.client import RedisClient
from router.types import EngineKey

A, B, C = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000"), EngineKey("10.0.0.3:8000")
FLEET = [A, B, C]
KEYS = list(range(7001, 7041))


async def until(check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = check()
        if not isinstance(done, bool):
            done = await done
        if done:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.02)


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of this test alone, for tests that freeze or kill it."""
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not on the PATH")
    yield server
    server.kill()


@pytest.fixture
async def shadowed(redis_url: str, redis_namespace: str):
    index = ShadowedIndex(RedisIndex(redis_url, redis_namespace, budget_ms=2000))
    yield index
    await index.close()


async def redis_sees(url: str, namespace: str, keys: list[int], expected: dict) -> bool:
    """Whether Redis itself (another client, no shadow) answers ``expected``."""
    plain = RedisIndex(url, namespace, budget_ms=2000)
    try:
        return await plain.lookup(keys, FLEET) == expected
    except IndexUnavailable:
        return False
    finally:
        await plain.close()


# --------------------------------------------------------------------------- records


async def test_a_decision_record_costs_the_request_no_round_trip(
    shadowed: ShadowedIndex, redis_url: str, redis_namespace: str
) -> None:
    record = shadowed.add(A, KEYS, ttl=30)
    with pytest.raises(StopIteration):
        record.send(None)  # done without suspending once: nothing awaited Redis
    await until(lambda: redis_sees(redis_url, redis_namespace, KEYS, {A: Match(40)}))


async def test_a_lookup_sees_this_routers_records_still_on_their_way(
    shadowed: ShadowedIndex,
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    # Same loop iteration: the record is queued, not yet written.
    assert await shadowed.lookup([*KEYS, 99], FLEET) == {A: Match(40)}
    assert await shadowed.lookup(KEYS[:10], FLEET) == {A: Match(10)}


async def test_a_burst_sharing_a_prefix_writes_it_once(
    shadowed: ShadowedIndex, redis_url: str, redis_namespace: str
) -> None:
    prefix = list(range(9001, 9101))
    for i in range(8):  # no await suspends between them: one flush takes all eight
        await shadowed.add(A, [*prefix, 20_000 + i], ttl=30)
    await shadowed.drain()
    redis = shadowed.remote.redis
    adds = await redis.client.zrange(redis.key("expiring-adds"), 0, -1)
    # The newest decision records all 101 blocks, each older one only its last block.
    assert sorted(len(member) // 8 for member in adds) == [1] * 7 + [101]
    for i in range(8):
        expected = {A: Match(101)}
        assert await redis_sees(redis_url, redis_namespace, [*prefix, 20_000 + i], expected)


async def test_closing_writes_the_records_still_queued(
    redis_url: str, redis_namespace: str
) -> None:
    index = ShadowedIndex(RedisIndex(redis_url, redis_namespace, budget_ms=2000))
    await index.lookup(KEYS, FLEET)  # connected, scripts loaded
    await index.add(C, KEYS, ttl=30)
    await index.close()
    assert await redis_sees(redis_url, redis_namespace, KEYS, {C: Match(40)})


async def test_firm_records_are_written_before_add_returns(
    shadowed: ShadowedIndex, redis_url: str, redis_namespace: str
) -> None:
    await shadowed.add(B, KEYS)
    assert await redis_sees(redis_url, redis_namespace, KEYS, {B: Match(40)})


# --------------------------------------------------------------------------- outages


async def test_a_frozen_redis_is_routed_around_with_the_shadow_and_reconciled(
    own_server: RedisServer,
) -> None:
    remote = RedisIndex(own_server.url, "frozen", budget_ms=100, retry_interval=0.05)
    index = ShadowedIndex(remote)
    events: list[tuple[bool, bool]] = []
    remote.listeners.append(lambda up, lost: events.append((up, lost)))
    try:
        await remote.redis.check_incarnation()
        await index.add(A, KEYS, ttl=30)
        await until(lambda: redis_sees(own_server.url, "frozen", KEYS, {A: Match(40)}))
        own_server.pause()
        try:
            started = time.monotonic()
            # Over budget: answered from the shadow, no exception.
            assert await index.lookup(KEYS, FLEET) == {A: Match(40)}
            assert time.monotonic() - started < 2.0  # a budget, with slack for busy machines
            assert not index.available and events == [(False, False)]
            later = list(range(8001, 8033))
            await index.add(B, later, ttl=30)  # made while Redis is away
            assert await index.lookup(later, FLEET) == {B: Match(32)}
            assert index.counters.fallbacks >= 2 and index.counters.unwritten >= 1
        finally:
            own_server.resume()
        await until(lambda: index.available)
        assert events == [(False, False), (True, False)]  # it kept its data
        # The decision Redis never got is replayed into it.
        await until(lambda: redis_sees(own_server.url, "frozen", later, {B: Match(32)}))
        assert index.counters.replayed == 1
    finally:
        await index.close()


async def test_a_redis_that_restarted_empty_gets_every_live_decision_back(
    own_server: RedisServer,
) -> None:
    remote = RedisIndex(own_server.url, "restarted", budget_ms=200, retry_interval=0.05)
    index = ShadowedIndex(remote)
    events: list[tuple[bool, bool]] = []
    remote.listeners.append(lambda up, lost: events.append((up, lost)))
    replacement = None
    try:
        await remote.redis.check_incarnation()
        await index.add(A, KEYS, ttl=30)
        await index.add(C, KEYS[:5], ttl=0.01)  # expires before Redis returns
        await until(lambda: redis_sees(own_server.url, "restarted", KEYS, {A: Match(40)}))
        own_server.kill()
        assert await index.lookup(KEYS, FLEET) == {A: Match(40)}  # from the shadow
        replacement = RedisServer(port=own_server.port)  # no persistence: empty
        await until(lambda: index.available)
        assert events[-1] == (True, True)
        await until(lambda: redis_sees(own_server.url, "restarted", KEYS, {A: Match(40)}))
        assert index.counters.replayed == 1
    finally:
        await index.close()
        if replacement is not None:
            replacement.kill()


async def test_no_call_after_a_restart_trips_on_a_connection_to_the_old_server(
    own_server: RedisServer,
) -> None:
    redis = RedisIndex(own_server.url, "pool", budget_ms=500, retry_interval=0.05)
    replacement = None
    try:
        await redis.add(A, KEYS)
        # Eight connections in the pool, all to the server about to die.
        await asyncio.gather(*(redis.lookup(KEYS, FLEET) for _ in range(8)))
        own_server.kill()
        with pytest.raises(IndexUnavailable):
            await redis.lookup(KEYS, FLEET)
        replacement = RedisServer(port=own_server.port)
        await until(lambda: redis.available)
        await asyncio.gather(*(redis.lookup(KEYS, FLEET) for _ in range(8)))
        assert redis.available and redis.counters.outages == 1
    finally:
        await redis.close()
        if replacement is not None:
            replacement.kill()


async def test_the_incarnation_tells_a_fresh_redis_from_the_same_one(
    redis_url: str, redis_namespace: str
) -> None:
    one = RedisClient(redis_url, redis_namespace)
    two = RedisClient(redis_url, redis_namespace)
    try:
        assert await one.check_incarnation()  # nothing seen before
        assert await two.check_incarnation()
        assert not await one.check_incarnation()  # the same Redis, data kept
        await one.client.delete(f"{{{redis_namespace}}}:incarnation")  # as after a restart
        assert await two.check_incarnation()  # starts a new incarnation...
        assert await one.check_incarnation()  # ...which the other sees as new
        assert not await two.check_incarnation()
    finally:
        await one.close()
        await two.close()


# --------------------------------------------------------------------------- shared load


async def test_replicas_exchange_load_in_one_round_trip_and_withdraw_it(
    redis_url: str, redis_namespace: str
) -> None:
    redis = RedisClient(redis_url, redis_namespace)
    trackers = [LoadTracker(16), LoadTracker(16)]
    shared = [
        SharedLoad(redis, t, lambda engine: engine != C, replica=f"r{i}")
        for i, t in enumerate(trackers)
    ]
    try:
        trackers[0].begin(A, 320, 0, 8)
        trackers[0].begin(C, 320, 0, 8)  # an engine replica 1 does not serve
        await shared[0].exchange()

        async def exchange() -> None:
            await shared[1].exchange()

        sent = await monitored_commands(redis_url, exchange)
        assert [c.split()[0] for c in sent] == ["EVALSHA"]
        assert shared[1].peers == 1
        assert trackers[1].view[A].peer_requests == 1
        assert trackers[1].view[A].prefill_tokens == 320
        assert C not in trackers[1].view
        assert trackers[1].own() == {}  # what it publishes stays its own
        await shared[0].stop()
        await shared[1].exchange()
        assert shared[1].peers == 0 and trackers[1].view[A].requests == 0
    finally:
        await redis.close()


async def test_a_dead_replicas_load_stops_counting_after_its_ttl(
    redis_url: str, redis_namespace: str
) -> None:
    redis = RedisClient(redis_url, redis_namespace)
    dead, alive = LoadTracker(16), LoadTracker(16)
    try:
        dead.begin(A, 160, 0, 1)
        await SharedLoad(redis, dead, lambda e: True, replica="dead", ttl=0.2).exchange()
        watcher = SharedLoad(redis, alive, lambda e: True, replica="alive", ttl=0.2)
        await watcher.exchange()
        assert alive.view[A].peer_requests == 1

        async def forgotten() -> bool:
            await watcher.exchange()
            return alive.view[A].peer_requests == 0

        await until(forgotten)
    finally:
        await redis.close()


async def test_peers_load_is_dropped_when_redis_is_gone_longer_than_the_ttl(
    own_server: RedisServer,
) -> None:
    redis = RedisClient(own_server.url, "load", budget_ms=100, retry_interval=0.05)
    other, mine = LoadTracker(16), LoadTracker(16)
    try:
        other.begin(A, 160, 0, 1)
        await SharedLoad(redis, other, lambda e: True, replica="other").exchange()
        shared = SharedLoad(redis, mine, lambda e: True, replica="mine", ttl=0.3)
        await shared.exchange()
        assert mine.view[A].peer_requests == 1
        own_server.kill()

        async def dropped() -> bool:
            await shared.exchange()
            return mine.view[A].peer_requests == 0

        await until(dropped)
        assert shared.peers == 0
        # A change from the stream now (were it still answering) cannot bring a peer
        # back: only an exchange could tell whether that peer is alive.
        shared.apply_changes("other", encode_load({A: InFlight(3, 0, 0, 0)}, time.time_ns()))
        assert mine.view[A].peer_requests == 0
    finally:
        await redis.close()


async def test_load_changes_reach_a_peer_on_the_stream_between_exchanges(
    redis_url: str, redis_namespace: str
) -> None:
    """``index.redis.load_push``: a request's start, first token and end reach the other
    replica through the decision stream, with no exchange in between; and an exchange
    that reads an entry written before the end does not bring the ended request back."""
    from router.config import ReplicatedIndexConfig
    from router.index.replicated import DecisionSync

    redis = RedisClient(redis_url, redis_namespace)
    trackers = [LoadTracker(16), LoadTracker(16)]
    # A long ttl: a busy machine's stall must not age the figures out of the test.
    shared = [
        SharedLoad(redis, t, lambda e: e != C, replica=f"p{i}", ttl=30.0)
        for i, t in enumerate(trackers)
    ]
    syncs = [
        DecisionSync(None, redis, ReplicatedIndexConfig(), f"p{i}", known=lambda e: e != C)
        for i in range(2)
    ]
    for tracker, load, sync in zip(trackers, shared, syncs, strict=True):
        sync.load = load
        load.on_change = sync.wake
        tracker.on_change = load.changed
    one, two = trackers
    try:
        for sync in syncs:
            await sync.start()
        for _ in range(2):  # each finds the other (a replica alone sends no changes)
            for load in shared:
                await load.exchange()
        assert [load.peers for load in shared] == [1, 1]
        ticket = one.begin(A, 320, 0, 8)
        one.begin(C, 320, 0, 8)  # an engine the peer does not serve
        await until(lambda: load_of(two.view, A).peer_requests == 1)
        assert two.view[A].prefill_tokens == 320 and C not in two.view
        one.prefilled(ticket)
        await until(lambda: two.view[A].prefill_tokens == 0)
        assert two.view[A].decode_blocks == 21  # 20 prompt blocks + 1 output block
        await shared[0].exchange()  # Redis now holds an entry with the request in it
        one.end(ticket)
        await until(lambda: two.view[A].requests == 0)
        await shared[1].exchange()  # reads that older entry: the end stands
        assert two.view[A].requests == 0 and two.view[A].decode_blocks == 0
        assert two.own() == {}  # what it publishes stays its own
        assert shared[0].pushed >= 3 and shared[1].applied >= 3
        # A new request, sent with the stream detached: the next exchange's entry is
        # newer than the stream's last change and replaces it.
        syncs[0].load = None
        one.begin(A, 160, 0, 1)
        await asyncio.sleep(0.05)
        assert two.view[A].requests == 0  # nothing came on the stream
        await shared[0].exchange()
        await shared[1].exchange()
        assert two.view[A].requests == 1 and two.view[A].prefill_tokens == 160
    finally:
        for sync in syncs:
            await sync.stop()
        await redis.close()


async def test_stale_or_malformed_load_changes_are_left_to_the_exchange(
    redis_url: str, redis_namespace: str
) -> None:
    """Figures older than the load's ttl (a stream replayed at start, a clock far
    behind) and payloads that do not decode change nothing; a replica's own are ignored."""
    redis = RedisClient(redis_url, redis_namespace)
    tracker = LoadTracker(16)
    shared = SharedLoad(redis, tracker, lambda e: True, replica="me", ttl=1.0)
    try:
        now = time.time_ns()
        shared.apply_changes("peer", encode_load({A: InFlight(1, 10, 1, 0)}, now))
        assert A not in tracker.view  # no exchange has succeeded yet: nothing is taken
        await shared.exchange()
        old = time.time_ns() - 2_000_000_000
        shared.apply_changes("peer", encode_load({A: InFlight(1, 10, 1, 0)}, old))
        shared.apply_changes("peer", encode_load({A: InFlight(1, 10, 1, 0)}))  # no version
        shared.apply_changes("me", encode_load({A: InFlight(1, 10, 1, 0)}, time.time_ns()))
        assert A not in tracker.view or tracker.view[A].requests == 0
        with pytest.raises(ValueError):
            shared.apply_changes("peer", b"\xc1")
        shared.apply_changes("peer", encode_load({A: InFlight(2, 10, 1, 0)}, time.time_ns()))
        assert tracker.view[A].peer_requests == 2 and shared.applied == 1
    finally:
        await redis.close()

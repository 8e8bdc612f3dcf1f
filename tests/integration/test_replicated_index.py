"""The replicated mode (``index.backend: replicated``): an index in each replica's memory,
decisions shared through a Redis stream, engine snapshots for a warm start.

Routers and engines run in this process (a killed replica runs as a ``kvroute serve``
process of its own); Redis is the session's throw-away server. Everything is on
loopback; every wait is a poll with a deadline. test_router_replicas.py runs the tests
both sharing modes have in common.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support.clients import post
from support.engines import poll, start_test_engine
from support.redis import RedisServer
from support.routers import StartRouter

from router.app import RouterApp
from router.config import ReplicatedIndexConfig
from router.emulator import EmulatedEngine
from router.engine_model import EngineParams
from router.events.ingest import StreamState
from router.events.snapshots import (
    STALE_MIN_S,
    SnapshotWriter,
    decode_snapshot,
    encode_snapshot,
    load_snapshots,
)
from router.hashing import block_keys, seed_for
from router.index import Match
from router.index.base import IndexUnavailable
from router.index.memory import MemoryIndex
from router.index.replicated import DecisionSync, decode_decisions, encode_decisions, unpack_keys
from router.redis.client import RedisClient
from router.redis.schema import pack_keys
from router.sessions import SessionMap
from router.tokenization.words import WordTokenizer
from router.types import EngineKey

MODEL = "kvroute-emulated"
SMALL = EngineParams(num_gpu_blocks=400, max_model_len=4096)


def replicated(url: str, namespace: str, **section: Any) -> dict[str, Any]:
    return {
        "backend": "replicated",
        "redis": {"url": url, "namespace": namespace, "budget_ms": 1000},
        "replicated": section,
    }


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def keys_of(prompt: str) -> list[int]:
    return block_keys(WordTokenizer().encode(prompt), 16, seed_for(MODEL))


def key_of(engine: EmulatedEngine) -> EngineKey:
    return EngineKey(f"127.0.0.1:{engine.port}")


async def routed(http: aiohttp.ClientSession, app: RouterApp, prompt: str) -> tuple[str, str]:
    async with http.post(
        f"{app.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}
    ) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvroute-engine"], resp.headers["x-kvroute-reason"]


# --------------------------------------------------------------------------- decisions


async def test_a_decision_of_one_replica_is_in_the_others_index_within_milliseconds(
    http: aiohttp.ClientSession,
    routers: StartRouter,
    redis_url: str,
    redis_namespace: str,
) -> None:
    engines = [await start_test_engine(engine_id=f"sync{i}", params=SMALL) for i in range(4)]
    try:
        urls = [e.url for e in engines]
        # No KV events at all: B can learn where A sent a prompt only from the stream.
        settings = {
            "index": replicated(redis_url, redis_namespace),
            "events": {"enabled": False},
        }
        a = await routers(urls, **settings)
        b = await routers(urls, **settings)
        assert a.replicated is not None and b.replicated is not None
        fleet = [key_of(e) for e in engines]
        for n in range(6):
            prompt = words(f"burst{n}-", 160)
            applied = b.replicated.sync.counters.applied
            engine, _ = await routed(http, a, prompt)
            await poll(lambda: b.replicated.sync.counters.applied > applied)  # noqa: B023
            # The record is in B's own memory: no Redis call answers this lookup.
            found = b.index.lookup_now(keys_of(prompt), fleet)
            assert found == {EngineKey.parse(engine): Match(10)}
            again, reason = await routed(http, b, prompt + " and more")
            assert again == engine, reason
            assert "prefix_hit" in reason
        delay = b.replicated.sync.counters.delay_s
        assert 0 <= delay < 1.0
        # One stream entry per gathering interval, each decision's keys in it.
        redis = RedisClient(redis_url, redis_namespace, budget_ms=2000)
        try:
            entries = await redis.client.xrange(redis.key("decisions"))
        finally:
            await redis.close()
        assert entries
        decisions = [d for _, fields in entries for d in decode_decisions(fields[b"d"])]
        assert len(decisions) == 12  # six through A, six through B
        endpoint, rank, ttl_ms, _, packed = decisions[0]
        assert (endpoint, rank) == (EngineKey.parse(engine).endpoint, 0) or ttl_ms > 0
        assert list(unpack_keys(packed)) == keys_of(words("burst0-", 160))
    finally:
        for engine in engines:
            await engine.stop()


async def test_decisions_made_while_redis_is_away_reach_the_peer_when_it_returns(
    http: aiohttp.ClientSession, routers: StartRouter, tmp_path: Path
) -> None:
    server = RedisServer()
    engines = [await start_test_engine(engine_id=f"away{i}", params=SMALL) for i in range(2)]
    try:
        urls = [e.url for e in engines]
        settings = {"index": replicated(server.url, "away"), "events": {"enabled": False}}
        a = await routers(urls, **settings)
        b = await routers(urls, **settings)
        assert a.replicated is not None and b.replicated is not None
        server.pause()
        await poll(lambda: not a.redis.available, timeout=5)  # type: ignore[union-attr]
        prompt = words("partition", 160)
        engine, _ = await routed(http, a, prompt)  # routed without Redis
        assert a.replicated.sync.pending >= 1
        assert b.index.lookup_now(keys_of(prompt), [EngineKey.parse(engine)]) == {}
        server.resume()
        # A publishes what it decided meanwhile (still live), B reads it on.
        await poll(
            lambda: (
                b.index.lookup_now(keys_of(prompt), [EngineKey.parse(engine)])
                == {EngineKey.parse(engine): Match(10)}
            ),
            timeout=10,
        )
        assert a.replicated.sync.pending == 0
    finally:
        for engine in engines:
            await engine.stop()
        server.kill()


# --------------------------------------------------------------------------- warm start


async def test_a_starting_replica_routes_on_the_engines_caches_from_a_snapshot(
    http: aiohttp.ClientSession,
    routers: StartRouter,
    redis_url: str,
    redis_namespace: str,
    ipc_dir: Path,
) -> None:
    # Engines that keep only their last 4 batches for replay, as a long-running engine
    # keeps only its last buffer_steps: a replica starting now cannot replay its history.
    engines = [
        await start_test_engine(
            engine_id=f"warm{i}",
            params=SMALL,
            kv_events_endpoint=f"ipc://{ipc_dir}/warm{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            kv_events_buffer_steps=4,
        )
        for i in range(2)
    ]
    try:
        urls = [e.url for e in engines]
        index = replicated(redis_url, redis_namespace, snapshot_interval_s=0.05)
        a = await routers(urls, index=index)
        assert a.subscriber is not None and a.snapshots is not None
        await poll(lambda: a.subscriber.stats.replays["ok"] == 2)  # type: ignore[union-attr]
        prompts = [words(f"warm{n}-", 320) for n in range(2)]
        for engine, prompt in zip(engines, prompts, strict=True):
            status, _ = await post(
                http, f"{engine.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
            )
            assert status == 200
        # Push the prompts' batches out of the engines' replay buffers.
        for engine in engines:
            for n in range(6):
                status, _ = await post(
                    http,
                    f"{engine.url}/v1/completions",
                    {"prompt": words(f"{engine.port}-filler{n}-", 40), "max_tokens": 1},
                )
                assert status == 200
        fleet = [key_of(e) for e in engines]
        expected = [{fleet[n]: Match(20)} for n in range(2)]
        await poll(lambda: [a.index.lookup_now(keys_of(p), fleet) for p in prompts] == expected)

        def snapshotted() -> bool:
            states = {s.engine: s.last_seq for s in a.subscriber.states()}  # type: ignore[union-attr]
            saved = a.snapshots._saved  # type: ignore[union-attr]
            return all(saved.get(k.label, (None,))[0] == states[k] for k in fleet)

        await poll(snapshotted)
        # A replica that starts now: warm from the snapshots at once.
        c = await routers(urls, index=index)
        assert [c.index.lookup_now(keys_of(p), fleet) for p in prompts] == expected
        assert c.subscriber is not None
        assert c.subscriber.stats.replays["uncovered"] == 0  # verified, nothing to rebuild
        engine, reason = await routed(http, c, prompts[1] + " again")
        assert engine == fleet[1].label and "prefix_hit" in reason
        # Without snapshots, the same start knows nothing of the engines' caches: the
        # replay cannot reach back far enough, and it rebuilds from new events. It knows
        # only C's decision, from the decision stream (read once its engines are
        # followed, so the rebuild did not erase it).
        cold = await routers(
            urls, index=replicated(redis_url, redis_namespace, snapshot_interval_s=0)
        )
        assert cold.index.lookup_now(keys_of(prompts[0]), fleet) == {}
        again = keys_of(prompts[1] + " again")
        assert cold.index.lookup_now(again, fleet) == {fleet[1]: Match(len(again))}
        assert cold.subscriber is not None and cold.subscriber.stats.replays["uncovered"] == 2
    finally:
        for engine in engines:
            await engine.stop()


def test_a_snapshot_round_trips_and_garbage_is_refused() -> None:
    state = StreamState(EngineKey("10.0.0.1:8000", 1), MODEL, 16)
    state.hashes[0].update({11: 101, 12: 102})
    state.hashes[1].update({13: 103})
    state.ignored_groups = {2}
    state.last_seq = 41
    raw = encode_snapshot(state, digest=7, saved_at=1.5)
    snap = decode_snapshot(raw)
    assert snap.digest == 7 and snap.saved_at == 1.5
    assert snap.state.engine == state.engine and snap.state.last_seq == 41
    assert [dict(t.items()) for t in snap.state.hashes] == [{11: 101, 12: 102}, {13: 103}, {}]
    assert snap.state.ignored_groups == {2} and snap.state.block_size == 16
    for bad in (b"", b"\xc1", raw[:-3]):
        with pytest.raises(ValueError):
            decode_snapshot(bad)


# --------------------------------------------------------------------------- a replica dies


async def test_a_killed_replica_stops_counting_and_its_peer_serves_on(
    http: aiohttp.ClientSession,
    routers: StartRouter,
    tmp_path: Path,
    redis_url: str,
    redis_namespace: str,
) -> None:
    engines = [
        await start_test_engine(engine_id=f"killed{i}", params=SMALL, time_scale=1.0)
        for i in range(2)
    ]
    urls = [e.url for e in engines]
    index = replicated(redis_url, redis_namespace)
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"index": index, "events": {"enabled": False}, "engines": [{"url": u} for u in urls]}
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "--config", str(config), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env=env, start_new_session=True,
    )  # fmt: skip
    streams: list[aiohttp.ClientResponse] = []
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("kvroute serve listening on"), line
        url = line.rsplit(" ", 1)[-1].strip()
        b = await routers(urls, index=index, events={"enabled": False})
        assert b.replicated is not None
        prompt = words("dying", 160)
        body = {"prompt": prompt, "max_tokens": 1500, "stream": True}
        resp = await http.post(f"{url}/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readany()
        streams.append(resp)
        engine = EngineKey.parse(resp.headers["x-kvroute-engine"])

        def peer_requests() -> int:
            return sum(load.peer_requests for load in b.loads.view.values())

        await poll(lambda: peer_requests() == 1)
        # B has the dying replica's decision in its own index.
        assert b.index.lookup_now(keys_of(prompt), [engine]) == {engine: Match(10)}
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        # Its published load lapses after index.redis.load_ttl_s; B routes on, alone.
        await poll(lambda: peer_requests() == 0, timeout=5)
        again, reason = await routed(http, b, prompt + " once more")
        assert again == engine.label and "prefix_hit" in reason
    finally:
        for resp in streams:
            resp.close()
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        for engine in engines:
            await engine.stop()


# --------------------------------------------------------------------------- the stream

PEER = EngineKey("10.0.0.9:8000")
"""The engine of the decisions these tests put on the stream."""


@contextlib.asynccontextmanager
async def decision_sync(
    url: str,
    namespace: str,
    replica: str,
    *,
    wall: Callable[[], float] | None = None,
    redis_options: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[DecisionSync]:
    """One replica's :class:`DecisionSync` over a fresh memory index (``sync.index``) and
    its own Redis client (``sync.redis``), stopped and closed afterwards; ``config``:
    ``index.replicated`` keys."""
    redis = RedisClient(url, namespace, **{"budget_ms": 2000, **(redis_options or {})})
    extra = {} if wall is None else {"wall": wall}
    sync = DecisionSync(MemoryIndex(), redis, ReplicatedIndexConfig(**config), replica, **extra)
    try:
        yield sync
    finally:
        await sync.stop()
        await redis.close()


def decision(keys: list[int], made_at: float, ttl_ms: int = 5000) -> tuple[Any, ...]:
    """A decision for :data:`PEER` as an entry carries it."""
    return (PEER.endpoint, PEER.rank, ttl_ms, made_at, pack_keys(keys))


async def test_a_malformed_stream_entry_is_counted_and_skipped(
    redis_url: str, redis_namespace: str
) -> None:
    async with decision_sync(redis_url, redis_namespace, "reader") as sync:
        stream, client = sync.redis.key("decisions"), sync.redis.client
        await client.xadd(stream, {"r": "peer", "d": b"\xc1 not msgpack"})
        await client.xadd(stream, {"r": "peer", "d": encode_decisions([("x", 0)])})  # type: ignore[list-item]
        await client.xadd(
            stream, {"r": "peer", "d": encode_decisions([decision([1, 2, 3], time.time())])}
        )
        stale = encode_decisions([decision([4], time.time() - 60)])
        await client.xadd(stream, {"r": "peer", "d": stale})
        await client.xadd(stream, {"r": "reader", "d": stale})
        assert await sync.catch_up() == 5
        assert sync.counters.malformed == 2
        assert sync.counters.applied == 1 and sync.counters.expired == 1  # own entry skipped
        assert sync.index.lookup_now([1, 2, 3], [PEER]) == {PEER: Match(3)}
        assert sync.index.lookup_now([4], [PEER]) == {}


async def test_session_pins_ride_the_decision_stream_and_bad_ones_are_skipped(
    redis_url: str, redis_namespace: str
) -> None:
    """The latency policy's session pins: an entry's ``s`` field beside its decisions
    (readers that know no ``s`` read the decisions alone); malformed pins never land."""
    async with (
        decision_sync(redis_url, redis_namespace, "writer") as writer,
        decision_sync(redis_url, redis_namespace, "reader") as reader,
    ):
        reader.sessions = SessionMap()
        writer.publish_session("conv-1", PEER, 60.0)
        writer.publish(PEER, [7, 8], 5.0)
        await writer.flush()
        stream, client = reader.redis.key("decisions"), reader.redis.client
        (entry,) = [fields for _, fields in await client.xrange(stream)]
        assert set(entry) == {b"r", b"d", b"s"}
        now = time.time()
        bad = encode_decisions(
            [  # type: ignore[list-item]
                ("nan", PEER.endpoint, PEER.rank, 5000, math.nan),
                ("forever", PEER.endpoint, PEER.rank, 10**12, now),
                ("stale", PEER.endpoint, PEER.rank, 1000, now - 60),
            ]
        )
        await client.xadd(stream, {"r": "peer", "d": encode_decisions([]), "s": bad})
        await client.xadd(stream, {"r": "peer", "d": encode_decisions([]), "s": b"\xc1"})
        assert await reader.catch_up() == 3
        assert reader.sessions.get("conv-1", time.monotonic()) == PEER
        assert reader.counters.sessions_applied == 1 and writer.counters.sessions_published == 1
        assert reader.index is not None and reader.index.lookup_now([7, 8], [PEER]) == {
            PEER: Match(2)
        }
        assert all(reader.sessions.get(s, 0.0) is None for s in ("nan", "forever", "stale"))
        assert reader.counters.malformed == 3 and reader.counters.expired == 1


async def test_decisions_queued_while_redis_is_away_are_bounded_newest_kept() -> None:
    server = RedisServer()
    try:
        options = {"budget_ms": 200, "slow_calls_to_outage": 1}
        async with decision_sync(
            server.url, "bounded", "writer", redis_options=options, max_pending=3
        ) as sync:
            server.pause()
            for n in range(5):
                sync.publish(PEER, [100 + n], ttl=30)
            assert sync.pending == 3 and sync.counters.dropped["queue_full"] == 2
            with pytest.raises(IndexUnavailable):
                await sync.flush()
            assert sync.pending == 3  # put back, in order
            server.resume()
            await poll(lambda: sync.redis.available, timeout=10)
            await sync.flush()
            assert sync.pending == 0 and sync.counters.published == 3
            entries = await sync.redis.client.xrange(sync.redis.key("decisions"))
            sent = [d for _, fields in entries for d in decode_decisions(fields[b"d"])]
            assert [list(unpack_keys(d[4])) for d in sent] == [[102], [103], [104]]
    finally:
        server.kill()


async def test_a_replica_appends_at_most_once_per_sync_interval(
    redis_url: str, redis_namespace: str
) -> None:
    async with decision_sync(redis_url, redis_namespace, "paced", sync_interval_s=0.5) as sync:
        await sync.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        sync.publish(PEER, [1], ttl=30)
        await poll(lambda: sync.counters.published == 1)
        first = loop.time() - started
        for n in range(9):  # within the interval: one entry for all of them, after it
            sync.publish(PEER, [2 + n], ttl=30)
        await poll(lambda: sync.counters.published == 10)
        second = loop.time() - started
        assert sync.counters.entries == 2
        assert first < 0.5 <= second  # the first went at once, the rest waited


async def test_under_steady_load_a_replica_appends_once_per_interval(
    redis_url: str, redis_namespace: str
) -> None:
    async with decision_sync(redis_url, redis_namespace, "busy", sync_interval_s=0.1) as sync:
        await sync.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        sent = 0
        while loop.time() - started < 0.5:  # a decision every 5 ms, appends far faster
            sync.publish(PEER, [sent + 1], ttl=30)
            sent += 1
            await asyncio.sleep(0.005)
        await poll(lambda: sync.counters.published == sent)
        elapsed = loop.time() - started
        # One append per 100 ms at most (the first at once), however fast Redis answers.
        assert sync.counters.entries <= elapsed / 0.1 + 1, (sync.counters.entries, elapsed)
        assert sync.counters.entries >= 2


async def test_a_malformed_decision_never_becomes_a_record(
    redis_url: str, redis_namespace: str
) -> None:
    now = time.time()
    async with decision_sync(redis_url, redis_namespace, "reader") as sync:
        bad = [
            decision([1], float("nan")),  # no age: no expiry
            decision([2], now, ttl_ms=10**12),  # a record for ever
            decision([3], now, ttl_ms=0),
            (PEER.endpoint, 0, 5000, now, b"\x01\x02"),  # not 8-byte keys
        ]
        await sync.redis.client.xadd(
            sync.redis.key("decisions"), {"r": b"\xff\xfe", "d": encode_decisions(bad)}
        )
        assert await sync.catch_up() == 1
        assert sync.counters.malformed == 4 and sync.counters.applied == 0
        assert sync.index.lookup_now([1], [PEER]) == sync.index.lookup_now([2], [PEER]) == {}


async def test_a_new_snapshot_writer_keeps_fresh_snapshots_and_drops_stale_ones(
    redis_url: str, redis_namespace: str
) -> None:
    redis = RedisClient(redis_url, redis_namespace, budget_ms=2000)
    clock = [1_000_000.0]
    states = []
    for n in range(2):
        state = StreamState(EngineKey(f"10.0.0.{n}:8000"), MODEL, 16)
        state.hashes[0].update({n + 1: n + 100})
        state.last_seq = 5
        states.append(state)
    following: list[tuple[StreamState, int | None]] = [(s, 9) for s in states]
    first = SnapshotWriter(redis, "first", 1.0, lambda: following, wall=lambda: clock[0])
    # The next writer follows nothing yet (it is starting, or its engines were not
    # discovered): it must not take the others' snapshots for engines that left.
    second = SnapshotWriter(redis, "second", 1.0, lambda: [], wall=lambda: clock[0])
    try:
        assert await first.write_once() == 2
        assert await first.write_once() == 0  # nothing moved
        await first.stop()  # releases the lease
        clock[0] += 60
        assert await second.write_once() == 0 and second.holder
        assert set(await load_snapshots(redis)) == {s.engine for s in states}
        clock[0] += STALE_MIN_S + 1  # nobody followed them for that long: gone
        await second.write_once()
        assert await load_snapshots(redis) == {}
    finally:
        await second.stop()
        await redis.close()


async def test_expired_decisions_are_dropped_and_the_live_ones_still_go_out(
    redis_url: str, redis_namespace: str
) -> None:
    clock = [1_000.0]
    async with decision_sync(
        redis_url, redis_namespace, "late", wall=lambda: clock[0], max_batch=2
    ) as sync:
        for n in range(2):
            sync.publish(PEER, [n + 1], ttl=1)  # queued while Redis was away, say
        for n in range(2):
            sync.publish(PEER, [n + 10], ttl=60)
        clock[0] += 5  # the first two have expired, a whole entry's worth
        await sync.flush()
        assert sync.pending == 0
        assert sync.counters.dropped["expired"] == 2 and sync.counters.published == 2
        assert sync.counters.entries == 1  # the expired ones took no room in the entry


async def test_entries_of_a_lost_stream_do_not_move_the_new_streams_position() -> None:
    # No Redis is contacted: the entries are handed over as a read would return them.
    async with decision_sync("redis://127.0.0.1:1/0", "unused", "me") as sync:
        payload = encode_decisions([decision([7], time.time())])
        entries = [(f"900000000000{n}-0", b"peer", payload) for n in range(3)]
        applying = asyncio.ensure_future(sync._apply_yielding(entries, sync._epoch))
        await asyncio.sleep(0)  # the first entry is applied, the task yields
        sync._on_availability(True, True)  # Redis is back, without its data
        await applying
        assert sync._last_id == "0-0"  # the new stream is read from its start
        assert sync.counters.applied == 1

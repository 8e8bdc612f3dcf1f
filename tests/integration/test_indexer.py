"""The standalone indexer: real ZMQ publishers speaking vLLM's protocol, a real Redis.

Indexers run in this process (two of them contend for one engine stream), except in
the end-to-end test of ``kvroute indexer --config``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import yaml
import zmq.asyncio
from support.redis import RedisServer
from support.vllm_publisher import Publisher

from router.events.indexer import Indexer
from router.events.ingest import StreamState
from router.events.subscriber import EventSource
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.events.writer import RemoteEventWriter
from router.hashing import block_keys, seed_for
from router.index import Match
from router.index.redis import RedisIndex
from router.types import EngineKey

MODEL = "m"
BS = 4
ENGINE = EngineKey("127.0.0.1:9300")


def tokens(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def stored(hashes: list[int], toks: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, toks, BS, medium="GPU")


async def until(check: Callable[[], Awaitable[bool] | bool], timeout: float = 30.0) -> None:
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


async def depth(index: RedisIndex, toks: list[int], engine: EngineKey = ENGINE) -> int:
    match = (await index.lookup(block_keys(toks, BS, seed_for(MODEL)), [engine])).get(engine)
    return match.blocks if match else 0


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["topic", "legacy"])
async def publisher(ctx, tmp_path, request):
    """vLLM 0.32's replay frames and older releases' (a takeover reads either)."""
    pub = Publisher(
        ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", replay_frames=request.param
    )
    yield pub
    await pub.close()


@pytest.fixture
def source(publisher: Publisher) -> EventSource:
    return EventSource(ENGINE, MODEL, publisher.pub_endpoint, publisher.replay_endpoint, "", BS)


@pytest.fixture
async def index(redis_url: str, redis_namespace: str):
    idx = RedisIndex(redis_url, redis_namespace, budget_ms=2000)
    yield idx
    await idx.close()


#: Bounds the tests do not exercise, far above what a loaded machine takes: a lease call
#: is bounded by the renewal interval, and one over it marks the indexer's Redis down
#: (an outage the test did not make); an unanswered replay leaves batches unapplied.
LEASE_MS, RENEW_MS, REPLAY_TIMEOUT = 20_000, 2_000, 10.0


@pytest.fixture
async def indexers(redis_url: str, redis_namespace: str, ctx):
    """Make indexers on the test's namespace, each with a Redis client of its own (as
    separate processes have: a slow call of one never fails another's, nor the test's
    reads through ``index``); they are stopped at the end."""
    made: list[tuple[Indexer, RedisIndex]] = []

    def make(sources: list[EventSource], token: str, **kwargs) -> Indexer:
        kwargs.setdefault("lease_ms", LEASE_MS)
        kwargs.setdefault("renew_ms", RENEW_MS)
        own = RedisIndex(redis_url, redis_namespace, budget_ms=2000)
        indexer = Indexer(
            own, sources, token=token, ctx=ctx, replay_timeout=REPLAY_TIMEOUT, **kwargs
        )
        made.append((indexer, own))
        return indexer

    yield make
    for indexer, own in made:
        await indexer.stop()
        await own.close()


async def test_engine_events_reach_redis(publisher, source, index, indexers) -> None:
    indexer = indexers([source], "one")
    await indexer.start()
    assert indexer.owned == {ENGINE}
    toks = tokens(100, 4)
    await publisher.publish([stored([1, 2], toks[: 2 * BS])])
    await publisher.publish([stored([3, 4], toks[2 * BS :], parent=2)])
    await until(lambda: _is(depth(index, toks), 4))
    await publisher.publish([BlockRemoved([3], "GPU")])
    await until(lambda: _is(depth(index, toks), 2))
    await publisher.publish([AllBlocksCleared()])
    await until(lambda: _is(depth(index, toks), 0))
    assert indexer.writer.stats.stale_token == indexer.writer.stats.old_seq == 0


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_a_standby_takes_over_and_resumes_where_the_writer_stopped(
    publisher, source, index, indexers
) -> None:
    one, two = indexers([source], "one"), indexers([source], "two")
    await one.start()
    await two.start()
    assert (one.owned, two.owned) == ({ENGINE}, set())
    toks = tokens(200, 4)
    await publisher.publish([stored([1, 2], toks[: 2 * BS])])
    await until(lambda: _is(depth(index, toks), 2))
    await one.stop()  # hands the lease back
    await until(lambda: two.owned == {ENGINE})
    assert (two.stats.resumed, two.stats.rebuilt) == (1, 0)
    # A child of a block stored before the takeover, then a removal of one such block:
    # both need the engine-hash map the new writer loaded from Redis.
    await publisher.publish([stored([3, 4], toks[2 * BS :], parent=2)])
    await until(lambda: _is(depth(index, toks), 4))
    await publisher.publish([BlockRemoved([2], "GPU")])
    await until(lambda: _is(depth(index, toks), 1))


async def test_an_engine_restarted_between_writers_is_rebuilt(
    publisher, source, index, indexers
) -> None:
    one = indexers([source], "one")
    await one.start()
    old, new = tokens(300, 2), tokens(400, 1)
    await publisher.publish([stored([1, 2], old)])
    await until(lambda: _is(depth(index, old), 2))
    await one.stop()
    publisher.restart()  # sequence numbers start over: same seq 0, another batch
    await publisher.publish([stored([7], new)])
    two = indexers([source], "two")
    await two.start()
    assert (two.stats.resumed, two.stats.rebuilt) == (0, 1)
    await until(lambda: _is(depth(index, new), 1))
    assert await depth(index, old) == 0


async def test_a_writer_whose_lease_was_taken_is_fenced_off(
    publisher, source, index, indexers
) -> None:
    # Renewing rarely, "one" learns of the takeover from its next write being refused.
    one = indexers([source], "one", lease_ms=30_000, renew_ms=10_000)
    await one.start()
    toks = tokens(500, 2)
    await publisher.publish([stored([1], toks[:BS])])
    await until(lambda: _is(depth(index, toks), 1))
    await index.redis.client.delete(index.redis.key(f"lease:{ENGINE.label}"))  # as if it lapsed
    two = indexers([source], "two")
    await two.start()
    assert two.owned == {ENGINE}
    await publisher.publish([stored([2], toks[BS:], parent=1)])
    await until(lambda: one.stats.lost == 1 and not one.owned)
    assert one.writer.stats.stale_token >= 1
    await until(lambda: _is(depth(index, toks), 2))


async def test_writes_lost_to_a_redis_outage_are_replayed_after_it(publisher, source, ctx) -> None:
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not on the PATH")
    # The outage is made (Redis frozen until the indexer gave up on it), not timed: every
    # bound is far above what a loaded machine takes, far below the deadlines here.
    index = RedisIndex(server.url, "outage", budget_ms=2000, retry_interval=0.05)
    reader = RedisIndex(server.url, "outage", budget_ms=2000)  # the test's, not the indexer's
    indexer = Indexer(
        index,
        [source],
        lease_ms=LEASE_MS,
        renew_ms=RENEW_MS,
        write_timeout=2.0,
        replay_timeout=REPLAY_TIMEOUT,
        token="one",
        ctx=ctx,
    )
    try:
        await indexer.start()
        assert indexer.owned == {ENGINE}
        toks = tokens(600, 3)
        await publisher.publish([stored([1], toks[:BS])])
        await until(lambda: _is(depth(reader, toks), 1))
        lost = indexer.stats.lost
        server.pause()
        try:
            await publisher.publish([stored([2], toks[BS : 2 * BS], parent=1)])
            await until(lambda: indexer.stats.lost > lost and not indexer.owned)
            await publisher.publish([stored([3], toks[2 * BS :], parent=2)])
        finally:
            server.resume()
        await until(lambda: _answers(reader, toks, 3), timeout=30)
        assert indexer.stats.resumed >= 1 and indexer.stats.rebuilt == 1  # only at the start
    finally:
        await indexer.stop()
        await index.close()
        await reader.close()
        server.kill()


async def _answers(index: RedisIndex, toks: list[int], expected: int) -> bool:
    try:
        return await depth(index, toks) == expected
    except Exception:
        return False


async def test_an_unfenced_writer_pipelines_event_batches(index: RedisIndex) -> None:
    writer = RemoteEventWriter(index)
    state = StreamState(ENGINE, MODEL, BS)
    toks = tokens(700, 40)
    for i in range(40):  # one block per batch, each chained to the previous one
        event = stored([i + 1], toks[i * BS : (i + 1) * BS], parent=i or None)
        await writer.apply(state, EventBatch(0.0, [event]))
    await writer.drain()
    assert writer.stats.flushes < 40  # batches queued while a flush ran went out together
    assert await index.lookup(block_keys(toks, BS, seed_for(MODEL)), [ENGINE]) == {
        ENGINE: Match(40)
    }
    await writer.close()


async def test_an_unfenced_writer_rewrites_an_engine_from_its_stream_state(
    index: RedisIndex,
) -> None:
    writer = RemoteEventWriter(index)
    state = StreamState(ENGINE, MODEL, BS)
    toks = tokens(900, 3)
    await writer.apply(state, EventBatch(0.0, [stored([1, 2, 3], toks)]))
    await writer.drain()
    await index.clear(ENGINE)  # as if the writes had never reached Redis
    assert await depth(index, toks) == 0
    writer.resnapshot(state, chunk=2)
    await writer.drain()
    assert await depth(index, toks) == 3
    # Later batches apply on top of the rewrite.
    await writer.apply(state, EventBatch(0.0, [BlockRemoved([2], "GPU")]))
    await writer.drain()
    assert await depth(index, toks) == 1
    assert writer.stats.resnapshots == 1
    await writer.close()


# --------------------------------------------------------------------------- the command


@pytest.fixture
def indexer_config(tmp_path: Path, redis_url: str, redis_namespace: str, source) -> Path:
    path = tmp_path / "indexer.yaml"
    config = {
        "block_size": BS,
        "index": {"backend": "redis", "redis": {"url": redis_url, "namespace": redis_namespace}},
        "indexer": {
            "lease_ms": LEASE_MS,
            "replay_timeout_s": REPLAY_TIMEOUT,
            "engines": [
                {
                    "endpoint": ENGINE.endpoint,
                    "model": MODEL,
                    "events": source.endpoint,
                    "replay": source.replay_endpoint,
                }
            ],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def clean_env() -> dict[str, str]:
    """This environment without ``KVROUTE_*`` overrides of the test's configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}


async def first_line(proc: asyncio.subprocess.Process, within: float) -> bytes:
    """The child's first line of output, waited for in short slices up to ``within`` s: a
    slice that ends while the line sits unread (this worker's loop held up elsewhere)
    only leads to another read, which returns it."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + within
    while True:
        try:
            return await asyncio.wait_for(proc.stdout.readline(), 1.0)
        except asyncio.TimeoutError:
            if proc.returncode is None and time.monotonic() < deadline:
                continue
        proc.kill()
        await proc.wait()
        err = (await proc.stderr.read()).decode(errors="replace")
        raise AssertionError(f"no line from the indexer within {within} s; stderr: {err}")


async def test_kvroute_indexer_command_follows_engines_and_stops_on_sigterm(
    publisher, index, indexer_config, clean_env
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "indexer",
        "--config",
        str(indexer_config),
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = await first_line(proc, 60)
        assert b"listening" in line and b"1 leased here" in line
        toks = tokens(800, 2)
        await publisher.publish([stored([1, 2], toks)])
        await until(lambda: _is(depth(index, toks), 2))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        lease = index.redis.key(f"lease:{ENGINE.label}")
        assert not await index.redis.client.exists(lease)  # handed back for a standby
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

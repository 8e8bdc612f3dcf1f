"""The KV-event subscriber over real ZMQ sockets on loopback.

The publisher (``tests/support/vllm_publisher.py``) speaks vLLM's protocol with knobs a
real engine lacks: forced gaps, forgotten batches, restarts, garbage. Tests against the
engine emulator live beside the emulator's tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio
from support.vllm_publisher import Publisher

from router.events import subscriber as subscriber_module
from router.events.ingest import EventIngestor
from router.events.subscriber import EventSource, KVEventSubscriber, parse_llmd_topic
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from router.events.vllm import REPLAY_FRAMES, ReplayFrames, encode_seq
from router.hashing import block_keys, seed_for
from router.index import MemoryIndex
from router.types import EngineKey

MODEL = "m"
BS = 4


def tokens(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def stored(hashes: list[int], toks: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, toks, BS, medium="GPU")


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def index() -> MemoryIndex:
    return MemoryIndex()


@pytest.fixture
async def subscriber(ctx, index):
    sub = KVEventSubscriber(EventIngestor(index), ctx=ctx, replay_timeout=1.0)
    yield sub
    await sub.close()


async def connected(
    ctx, subscriber, tmp_path, name: str = "e1", replay_frames: ReplayFrames = "topic"
) -> tuple[Publisher, EngineKey]:
    pub = Publisher(
        ctx,
        f"ipc://{tmp_path}/{name}-pub",
        f"ipc://{tmp_path}/{name}-replay",
        replay_frames=replay_frames,
    )
    engine = EngineKey(f"127.0.0.1:{9000 + len(name)}")
    await subscriber.add_source(
        EventSource(engine, MODEL, pub.pub_endpoint, pub.replay_endpoint, block_size=BS)
    )
    return pub, engine


def depth(index: MemoryIndex, toks: list[int], engine: EngineKey) -> int:
    match = index.lookup_now(block_keys(toks, BS, seed_for(MODEL)), [engine]).get(engine)
    return match.blocks if match else 0


@pytest.mark.parametrize("replay_frames", REPLAY_FRAMES)
async def test_batches_published_before_connecting_arrive_by_replay(
    ctx, subscriber, index, tmp_path, replay_frames: ReplayFrames
) -> None:
    pub = Publisher(
        ctx,
        f"ipc://{tmp_path}/early-pub",
        f"ipc://{tmp_path}/early-replay",
        replay_frames=replay_frames,
    )
    toks = tokens(100, 3)
    await pub.publish([stored([1, 2, 3], toks)])  # nobody listens yet
    engine = EngineKey("127.0.0.1:9100")
    await subscriber.add_source(EventSource(engine, MODEL, pub.pub_endpoint, pub.replay_endpoint))
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 3))
    # Both reply shapes (vLLM 0.32's with a topic frame, older without) and both end
    # markers are read as replies, never as garbage, and the replay ends as ok.
    await until(lambda: asyncio.sleep(0, subscriber.stats.replays["ok"] >= 1))
    assert subscriber.stats.garbage == 0 and subscriber.stats.replays["failed"] == 0
    await pub.close()


async def test_an_unanswered_replay_of_an_idle_engine_is_tried_again(ctx, index, tmp_path) -> None:
    """The engine publishes before the router listens, misses the first replay request
    (busy, still starting), then answers but publishes nothing more: the retry, not a
    live batch, brings its blocks into the index; removing the source ends the retries."""
    sub = KVEventSubscriber(EventIngestor(index), ctx=ctx, replay_timeout=0.2)
    pub = Publisher(ctx, f"ipc://{tmp_path}/idle-pub", f"ipc://{tmp_path}/idle-replay")
    try:
        pub.answer_replays = False
        toks = tokens(150, 3)
        await pub.publish([stored([1, 2, 3], toks)])  # nobody listens yet
        engine = EngineKey("127.0.0.1:9150")
        await sub.add_source(EventSource(engine, MODEL, pub.pub_endpoint, pub.replay_endpoint))
        stream = sub._streams[engine]
        await until(lambda: asyncio.sleep(0, sub.stats.replays["failed"] >= 1))
        await until(lambda: asyncio.sleep(0, stream.retry is not None))
        assert depth(index, toks, engine) == 0
        pub.answer_replays = True
        await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 3), timeout=10)
        # The replay applies each batch as it arrives; its end marker follows.
        await until(lambda: asyncio.sleep(0, not stream.replaying))
        assert sub.stats.replays["ok"] == 1 and stream.failed_replays == 0
        assert stream.retry is None  # caught up: nothing more to try

        pub.answer_replays = False
        stream.resync()  # a resync that goes unanswered schedules a retry too
        await until(lambda: asyncio.sleep(0, stream.retry is not None))
        retry = stream.retry
        await sub.remove_source(engine)
        assert retry is not None and retry.cancelled() and stream.retry is None
    finally:
        await sub.close()
        await pub.close()


async def test_stored_child_and_removed_events_update_the_index(
    ctx, subscriber, index, tmp_path
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    toks = tokens(200, 4)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([11, 12], toks[: 2 * BS])])
    await pub.publish([stored([13, 14], toks[2 * BS :], parent=12)])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 4))
    await pub.publish([BlockRemoved([13], "GPU")])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 2))
    await pub.publish([AllBlocksCleared()])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 0))
    await pub.close()


@pytest.mark.parametrize("replay_frames", REPLAY_FRAMES)
async def test_a_gap_is_repaired_by_replay(
    ctx, subscriber, index, tmp_path, replay_frames: ReplayFrames
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path, replay_frames=replay_frames)
    toks = tokens(300, 3)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([21], toks[:BS])])
    await pub.publish([stored([22], toks[BS : 2 * BS], parent=21)], send=False)  # lost on the wire
    await pub.publish([stored([23], toks[2 * BS :], parent=22)])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 3))
    assert subscriber.stats.gaps == 1 and subscriber.stats.replays["ok"] >= 2
    assert subscriber.stats.garbage == 0
    await pub.close()


async def test_a_gap_older_than_the_replay_buffer_clears_and_rebuilds(
    ctx, subscriber, index, tmp_path
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    stale, fresh = tokens(400, 2), tokens(500, 2)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([31, 32], stale)])
    await until(lambda: asyncio.sleep(0, depth(index, stale, engine) == 2))
    await pub.publish([BlockRemoved([31, 32], "GPU")], send=False)  # lost, and...
    pub.buffer.clear()  # ...already gone from the engine's replay buffer
    await pub.publish([stored([41, 42], fresh)], send=False)
    await pub.publish([stored([43], tokens(600, 1))])
    await until(lambda: asyncio.sleep(0, subscriber.stats.replays["uncovered"] == 1))
    await until(lambda: asyncio.sleep(0, depth(index, fresh, engine) == 2))
    assert depth(index, stale, engine) == 0  # the removal we never saw cannot leave stale entries
    await pub.close()


async def test_an_engine_restart_clears_what_it_held(ctx, subscriber, index, tmp_path) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    old, new = tokens(700, 2), tokens(800, 2)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    for i in range(3):
        await pub.publish([stored([51 + i], tokens(900 + 10 * i, 1))])
    await pub.publish([stored([61, 62], old)])
    await until(lambda: asyncio.sleep(0, depth(index, old, engine) == 2))
    pub.restart()
    await pub.publish([stored([71, 72], new)])
    await until(lambda: asyncio.sleep(0, depth(index, new, engine) == 2))
    assert depth(index, old, engine) == 0
    assert subscriber.stats.restarts == 1
    await pub.close()


async def test_a_reconnect_to_the_same_engine_keeps_its_entries(
    ctx, subscriber, index, tmp_path
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    toks, more = tokens(1500, 2), tokens(1600, 1)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([11, 12], toks)])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 2))
    # The publisher's socket goes away and comes back at the same endpoint (a network
    # blip, not a restart: same replay buffer, same sequence).
    endpoint = pub.pub_endpoint
    pub.pub.close(0)
    pub.pub = ctx.socket(zmq.PUB)
    pub.pub.setsockopt(zmq.LINGER, 0)
    pub.pub.bind(endpoint)
    await pub.publish([stored([13], more)], send=False)  # missed while reconnecting
    await until(lambda: asyncio.sleep(0, depth(index, more, engine) == 1))
    assert depth(index, toks, engine) == 2
    assert subscriber.stats.restarts == 0


async def test_a_restart_whose_first_batches_were_missed_is_found_on_reconnect(
    ctx, subscriber, index, tmp_path
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    old, new = tokens(1700, 2), tokens(1800, 2)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([21, 22], old)])
    await until(lambda: asyncio.sleep(0, depth(index, old, engine) == 2))
    endpoint = pub.pub_endpoint
    pub.pub.close(0)
    pub.restart()
    await pub.publish([stored([31, 32], new)], send=False)  # lost to the slow joiner
    pub.pub = ctx.socket(zmq.PUB)
    pub.pub.setsockopt(zmq.LINGER, 0)
    pub.pub.bind(endpoint)
    await until(lambda: asyncio.sleep(0, depth(index, new, engine) == 2))
    assert depth(index, old, engine) == 0
    assert subscriber.stats.restarts == 1


async def test_a_restart_is_found_when_the_verifying_replay_goes_unanswered(
    ctx, subscriber, index, tmp_path
) -> None:
    """Seen with real vLLM: right after a restart the engine's replay socket may not
    answer in time. Live batches numbered from 0 again, buffered meanwhile, still prove
    the restart: its old entries go, and the new ones apply."""
    pub, engine = await connected(ctx, subscriber, tmp_path)
    old, new = tokens(500, 2), tokens(600, 1)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.publish([stored([51], old[:BS])])
    await pub.publish([stored([52], old[BS:], parent=51)])
    await until(lambda: asyncio.sleep(0, depth(index, old, engine) == 2))
    pub.restart()
    pub.answer_replays = False
    subscriber.resync(engine)  # what a reconnect or a re-admission does
    await pub.publish([stored([61], new)])
    await until(lambda: asyncio.sleep(0, subscriber.stats.restarts == 1))
    await until(lambda: asyncio.sleep(0, depth(index, new, engine) == 1))
    assert depth(index, old, engine) == 0
    assert subscriber.stats.replays["failed"] == 1
    await pub.close()


async def test_garbage_frames_are_counted_and_the_stream_goes_on(
    ctx, subscriber, index, tmp_path
) -> None:
    pub, engine = await connected(ctx, subscriber, tmp_path)
    toks = tokens(1000, 1)
    await until(lambda: asyncio.sleep(0, not subscriber._streams[engine].replaying))
    await pub.send_raw([b"", b"\x00\x01"])  # two frames
    await pub.send_raw([b"", b"short", b"x"])  # bad sequence frame
    pub.seq += 1
    await pub.send_raw([b"", encode_seq(0), b"\xc1\xc1not msgpack"])
    await pub.publish([stored([81], toks)])
    await until(lambda: asyncio.sleep(0, depth(index, toks, engine) == 1))
    assert subscriber.stats.garbage == 3
    await pub.close()


async def test_without_a_replay_endpoint_a_gap_clears_the_engine(ctx, index, tmp_path) -> None:
    sub = KVEventSubscriber(EventIngestor(index), ctx=ctx)
    pub = Publisher(ctx, f"ipc://{tmp_path}/nr-pub", f"ipc://{tmp_path}/nr-replay")
    engine = EngineKey("127.0.0.1:9200")
    await sub.add_source(EventSource(engine, MODEL, pub.pub_endpoint, None))
    early, late = tokens(1100, 1), tokens(1200, 1)

    # Without replay the slow joiner may miss the first batches: publish until one lands.
    async def landed() -> bool:
        await pub.publish([stored([91], early)])
        await asyncio.sleep(0.02)
        return depth(index, early, engine) == 1

    await until(landed)
    pub.seq += 3
    await pub.publish([stored([92], late)])
    await until(lambda: asyncio.sleep(0, depth(index, late, engine) == 1))
    assert depth(index, early, engine) == 0
    await sub.close()
    await pub.close()


async def test_bind_mode_keys_streams_by_topic(ctx, subscriber, index, tmp_path) -> None:
    def resolve(topic: str, rank: int | None) -> EventSource | None:
        parsed = parse_llmd_topic(topic)
        if parsed is None:
            return None
        endpoint, model = parsed
        return EventSource(EngineKey(endpoint, rank or 0), model)

    bound = await subscriber.bind(f"ipc://{tmp_path}/central", resolve)
    pubs = []
    for i in range(2):
        pub = Publisher(ctx, bound, f"ipc://{tmp_path}/c{i}-replay", connect=True)
        pub.topic = f"kv@10.0.0.{i + 1}:8000@{MODEL}".encode()
        pubs.append(pub)
    toks = [tokens(2000, 2), tokens(3000, 1)]

    async def both_landed() -> bool:
        for i, pub in enumerate(pubs):
            if depth(index, toks[i], EngineKey(f"10.0.0.{i + 1}:8000")) == 0:
                pub.restart()  # resend from scratch until the connection is up
                await pub.publish([stored([100 + i, 200 + i][: len(toks[i]) // BS], toks[i])])
        await asyncio.sleep(0.02)
        return all(
            depth(index, toks[i], EngineKey(f"10.0.0.{i + 1}:8000")) == len(toks[i]) // BS
            for i in range(2)
        )

    await until(both_landed)
    await pubs[0].send_raw([b"other-topic", encode_seq(0), b"\x90"])
    await until(lambda: asyncio.sleep(0, subscriber.stats.unknown_topics == 1))
    assert (
        index.lookup_now(block_keys(toks[0], BS, seed_for(MODEL)), [EngineKey("10.0.0.2:8000")])
        == {}
    )
    for pub in pubs:
        await pub.close()


def resolve_llmd(topic: str, rank: int | None) -> EventSource | None:
    parsed = parse_llmd_topic(topic)
    if parsed is None:
        return None
    endpoint, model = parsed
    return EventSource(EngineKey(endpoint, rank or 0), model)


@pytest.mark.parametrize("check_address", [True, False])
async def test_a_bound_tcp_socket_takes_an_engines_topic_only_from_its_address(
    ctx, subscriber, index, check_address: bool
) -> None:
    """Over TCP a publisher at 127.0.0.2 posting under the topic of the engine at
    127.0.0.1 is dropped and counted; under its own address's topic it lands (issue 44,
    item 2). With ``check_address`` off (the control), anything lands."""
    bound = await subscriber.bind("tcp://127.0.0.1:*", resolve_llmd, check_address=check_address)
    port = bound.rpartition(":")[2]
    here = Publisher(ctx, bound, "inproc://here-replay", connect=True)
    there = Publisher(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{port}", "inproc://x-replay", True)
    engine, other = EngineKey("127.0.0.1:8000"), EngineKey("127.0.0.2:8000")
    own, forged, elsewhere = tokens(1000, 1), tokens(2000, 1), tokens(3000, 1)

    async def landed(pub: Publisher, topic: str, toks: list[int], key: EngineKey) -> bool:
        if depth(index, toks, key) == 0:
            pub.restart()  # resend from scratch until the connection is up
            pub.topic = topic.encode()
            await pub.publish([stored([toks[0]], toks)])
        await asyncio.sleep(0.02)
        return depth(index, toks, key) == 1

    await until(lambda: landed(here, f"kv@{engine.endpoint}@{MODEL}", own, engine))
    await until(lambda: landed(there, f"kv@{other.endpoint}@{MODEL}", elsewhere, other))
    there.topic = f"kv@{engine.endpoint}@{MODEL}".encode()
    for _ in range(3):
        await there.publish([stored([forged[0]], forged)])
        await there.publish([AllBlocksCleared()])
    if check_address:
        await until(lambda: asyncio.sleep(0, subscriber.stats.address_mismatches == 6))
        assert depth(index, own, engine) == 1 and depth(index, forged, engine) == 0
    else:
        await until(lambda: asyncio.sleep(0, depth(index, own, engine) == 0))  # cleared
        assert subscriber.stats.address_mismatches == 0
    for pub in (here, there):
        await pub.close()


async def test_an_engine_named_by_host_name_is_matched_by_its_resolved_address(
    ctx, subscriber, index
) -> None:
    """``kv@localhost:8000@m``: localhost resolves to 127.0.0.1 (and ::1), so a publisher
    there lands and one at 127.0.0.2 does not."""
    bound = await subscriber.bind("tcp://127.0.0.1:*", resolve_llmd)
    port = bound.rpartition(":")[2]
    here = Publisher(ctx, bound, "inproc://here-replay", connect=True)
    there = Publisher(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{port}", "inproc://x-replay", True)
    engine = EngineKey("localhost:8000")
    toks = {pub: tokens(1000 * n, 1) for n, pub in enumerate((here, there), start=1)}
    for pub in (here, there):
        pub.topic = f"kv@{engine.endpoint}@{MODEL}".encode()

    async def sent_until_counted() -> bool:
        for pub in (here, there):
            pub.restart()  # resend from scratch until the connections are up
            await pub.publish([stored([toks[pub][0]], toks[pub])])
        await asyncio.sleep(0.02)
        return depth(index, toks[here], engine) == 1 and subscriber.stats.address_mismatches > 0

    await until(sent_until_counted)
    assert depth(index, toks[there], engine) == 0
    for pub in (here, there):
        await pub.close()


async def test_a_bound_socket_keeps_a_bounded_number_of_topic_streams(
    ctx, subscriber, index, tmp_path, monkeypatch
) -> None:
    """Engines that connect choose their topics and DP ranks: past MAX_TOPICS (topic,
    rank) streams, messages on new ones are dropped as unknown; known ones still land."""
    monkeypatch.setattr(subscriber_module, "MAX_TOPICS", 3)
    resolved: list[tuple[str, int | None]] = []

    def resolve(topic: str, rank: int | None) -> EventSource | None:
        parsed = parse_llmd_topic(topic)
        if parsed is None:
            return None
        resolved.append((topic, rank))
        endpoint, model = parsed
        return EventSource(EngineKey(endpoint, rank or 0), model)

    bound = await subscriber.bind(f"ipc://{tmp_path}/central", resolve)
    pub = Publisher(ctx, bound, f"ipc://{tmp_path}/many-replay", connect=True)
    topic = {i: f"kv@10.0.0.{i}:8000@{MODEL}".encode() for i in range(1, 4)}
    engine = {i: EngineKey(f"10.0.0.{i}:8000") for i in range(1, 4)}
    toks = {n: tokens(1000 * n, 1) for n in range(1, 7)}

    async def first_landed() -> bool:
        if depth(index, toks[1], engine[1]) == 0:
            pub.restart()  # resend from scratch until the connection is up
            pub.topic = topic[1]
            await pub.publish([stored([1], toks[1])])
        await asyncio.sleep(0.02)
        return depth(index, toks[1], engine[1]) == 1

    await until(first_landed)
    pub.topic = topic[2]
    await pub.publish([stored([2], toks[2])])  # stream 2
    pub.topic = topic[1]
    await pub.publish([stored([3], toks[3])], rank=1)  # stream 3: a new rank is a new stream
    pub.topic = topic[3]
    await pub.publish([stored([4], toks[4])])  # over the bound: dropped
    pub.topic = topic[1]
    await pub.publish([stored([5], toks[5])], rank=2)  # dropped too
    pub.topic = topic[2]
    await pub.publish([stored([6], toks[6])])  # a known stream goes on
    await until(lambda: asyncio.sleep(0, depth(index, toks[6], engine[2]) == 1))
    assert resolved == [
        (topic[1].decode(), None),
        (topic[2].decode(), None),
        (topic[1].decode(), 1),
    ]
    assert subscriber.stats.unknown_topics == 2
    assert depth(index, toks[3], EngineKey(engine[1].endpoint, 1)) == 1
    assert depth(index, toks[4], engine[3]) == 0
    assert depth(index, toks[5], EngineKey(engine[1].endpoint, 2)) == 0
    await pub.close()


def test_llmd_topics_parse() -> None:
    assert parse_llmd_topic("kv@10.1.2.3:8000@meta/llama") == ("10.1.2.3:8000", "meta/llama")
    assert parse_llmd_topic("kv-events") is None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: A publisher in its own process, so that its 256 MiB frame is not counted here.
BIG_FRAME_PUBLISHER = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.XPUB)
sock.connect(sys.argv[1])
# Send once the subscriber's subscription has arrived, not after a fixed sleep: a
# publisher drops what it sends before then (the slow joiner), and on a busy machine
# no sleep is long enough.
if not sock.poll(30_000):
    sys.exit("no subscription arrived within 30 s")
sock.recv()
sock.send_multipart([sys.argv[2].encode(), (0).to_bytes(8, "big"), b"\\x91" * (256 << 20)])
sock.close(linger=30_000)  # deliver the frame before exiting (dropped if refused)
ctx.term()
"""


@pytest.mark.parametrize("limit", [None, 512 << 20], ids=["default limit", "512 MiB limit"])
async def test_a_256_mib_frame_is_refused_and_nothing_is_kept(
    ctx, index, tmp_path, limit: int | None
) -> None:
    """Over the default ``events.max_message_bytes`` the publisher is disconnected before
    the frame is read; under a limit raised above it, the frame is read, found to be
    garbage, and released at once (not kept until the next message arrives)."""
    subscriber = KVEventSubscriber(
        EventIngestor(index), ctx=ctx, **({"max_message_bytes": limit} if limit else {})
    )

    def resolve(topic: str, rank: int | None) -> EventSource | None:
        parsed = parse_llmd_topic(topic)
        return EventSource(EngineKey(parsed[0]), parsed[1], block_size=BS) if parsed else None

    bound = await subscriber.bind(f"ipc://{tmp_path}/central", resolve)
    topic = f"kv@10.0.0.9:8000@{MODEL}"
    before = resident_bytes()
    publisher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BIG_FRAME_PUBLISHER, bound, topic
    )
    assert await publisher.wait() == 0
    # Reading 256 MiB (under the raised limit) and releasing it takes a while on a busy
    # machine: wait for the frame to be counted and the memory to be back, or 30 s.
    expected = 0 if limit is None else 1
    await asyncio.sleep(0.2)

    async def settled() -> bool:
        return subscriber.stats.garbage == expected and resident_bytes() - before < 32 << 20

    with contextlib.suppress(AssertionError):  # the asserts below say what did not happen
        await until(settled, timeout=30)
    grown = resident_bytes() - before
    assert grown < 32 << 20, f"resident memory grew by {grown >> 20} MiB"
    assert subscriber.stats.batches == 0
    assert subscriber.stats.garbage == expected
    # The socket goes on: a publisher sending batches of a sane size is heard.
    pub = Publisher(ctx, bound, f"ipc://{tmp_path}/after-replay", connect=True)
    pub.topic = topic.encode()
    toks = tokens(5000, 1)

    async def landed() -> bool:
        pub.restart()
        await pub.publish([stored([7], toks)])
        await asyncio.sleep(0.02)
        return depth(index, toks, EngineKey("10.0.0.9:8000")) == 1

    await until(landed)
    await pub.close()
    await subscriber.close()

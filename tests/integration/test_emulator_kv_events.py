"""KV events on real ZMQ sockets: content, wire shapes, replay and both topologies."""

from __future__ import annotations

import itertools
from pathlib import Path

import aiohttp
import msgspec
import pytest
from support.clients import Subscriber, get, post, replay
from support.engines import start_test_engine

from router.emulator import EmulatedEngine
from router.engine_model import EngineParams
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from router.events.vllm import END_SEQ, WIRE_FORMATS, decode_seq, encode_batch
from router.tokenization import WordTokenizer

WORDS = WordTokenizer()


def text_prompt(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 1) -> None:
    status, answer = await post(
        http, f"{url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}
    )
    assert status == 200, answer


async def test_stored_blocks_arrive_in_order_with_their_tokens(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        probe = await sub.sync(http, engine.url)
        prompt = text_prompt(40)
        await complete(http, engine.url, prompt, max_tokens=30)
        stored: list[BlockStored] = []
        seq = probe.seq
        while sum(len(e.block_hashes) for e in stored) < (40 + 30 - 1) // 16:
            msg = await sub.recv()
            assert msg.seq == seq + 1 and msg.topic == engine.kv_events_topic.encode()  # type: ignore[union-attr]
            seq = msg.seq
            assert msg.batch.data_parallel_rank == 0
            stored += [e for e in msg.batch.events if isinstance(e, BlockStored)]
    finally:
        sub.close()
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == WORDS.encode(prompt)[:32]
    assert all(e.block_size == 16 and e.medium == "GPU" for e in stored)
    for prev, event in itertools.pairwise(stored):
        assert event.parent_block_hash == prev.block_hashes[-1]


async def test_reset_publishes_all_blocks_cleared(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        probe = await sub.sync(http, engine.url)
    finally:
        sub.close()
    assert probe.batch.events == [AllBlocksCleared()]


async def test_eviction_is_published_as_block_removed(http: aiohttp.ClientSession) -> None:
    params = EngineParams(block_size=16, num_gpu_blocks=16, max_model_len=256)
    engine = await start_test_engine(params=params, kv_events_endpoint="tcp://127.0.0.1:*")
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        await sub.sync(http, engine.url)
        await complete(http, engine.url, text_prompt(200, "a"))  # 12 cached blocks
        await complete(http, engine.url, text_prompt(200, "b"))  # needs 13 of 16
        stored: list[int] = []
        removed: list[int] = []
        while len(stored) < 24:
            for event in (await sub.recv()).batch.events:
                if isinstance(event, BlockStored):
                    stored += event.block_hashes
                elif isinstance(event, BlockRemoved):
                    assert event.medium == "GPU"
                    removed += event.block_hashes
    finally:
        sub.close()
        await engine.stop()
    # 13 blocks wanted, 4 never used: 9 of the first prompt's cached blocks are evicted,
    # its tail first.
    assert removed == list(reversed(stored[3:12]))


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
async def test_each_wire_format_matches_the_golden_encoder(
    http: aiohttp.ClientSession, ipc_dir: Path, wire_format: str
) -> None:
    engine = await start_test_engine(
        kv_events_endpoint=f"ipc://{ipc_dir}/fmt-{wire_format}", kv_events_format=wire_format
    )
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        await sub.sync(http, engine.url)
        await complete(http, engine.url, text_prompt(64), max_tokens=1)
        msg = await sub.recv()
    finally:
        sub.close()
        await engine.stop()
    batch = msg.batch
    assert [type(e) for e in batch.events] == [BlockStored]
    # Byte for byte what the encoder tested against vLLM's golden payloads produces.
    assert msg.payload == encode_batch(batch.events, batch.ts, 0, wire_format)  # type: ignore[arg-type]
    raw = msgspec.msgpack.decode(msg.payload)
    if wire_format == "v3-map":
        assert isinstance(raw, dict) and raw["events"][0]["type"] == "BlockStored"
    elif wire_format == "v2-mixed":
        assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored"
    else:
        assert isinstance(raw, list) and raw[1][0][0] == "BlockStored"


async def test_replay_resends_a_missed_range_then_the_end_marker(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        first = (await sub.sync(http, engine.url)).seq
    finally:
        sub.close()
    # Nobody listens while these are published.
    for tag in "abc":
        await complete(http, engine.url, text_prompt(20, tag))
    topics: list[bytes] = []
    replies = await replay(engine.kv_events_replay_endpoint or "", first + 1, topics=topics)
    # vLLM 0.32's frames: the stream's topic before each seq, an empty one in the marker.
    assert topics == [(engine.kv_events_topic or "").encode()] * 3 + [b""]
    *batches, (end_seq, end_payload) = replies
    assert (end_seq, end_payload) == (END_SEQ, b"")
    assert [decode_seq(s) for s, _ in batches] == [first + 1, first + 2, first + 3]
    assert all(isinstance(b, bytes) and b for _, b in batches)
    # Asking past the end yields just the marker.
    assert await replay(engine.kv_events_replay_endpoint or "", first + 100) == [(END_SEQ, b"")]


async def test_connect_topology_publishes_to_a_central_subscriber(
    http: aiohttp.ClientSession,
) -> None:
    sub = Subscriber("tcp://127.0.0.1:*", bind=True)
    engine = await start_test_engine(kv_events_endpoint=sub.endpoint)
    try:
        assert engine.kv_events_endpoint == sub.endpoint  # connected, not bound
        probe = await sub.sync(http, engine.url)
        await complete(http, engine.url, text_prompt(40))
        msg = await sub.recv()
    finally:
        sub.close()
        await engine.stop()
    assert probe.topic == msg.topic == f"kv@127.0.0.1:{engine.port}@kvroute-emulated".encode()
    assert msg.seq == probe.seq + 1


async def test_tcp_wildcard_binds_a_random_port_and_reports_it(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(
        kv_events_endpoint="tcp://127.0.0.1:*", kv_events_topic="custom-topic"
    )
    try:
        _, info = await get(http, f"{engine.url}/server_info")
        endpoint = info["kv_events_endpoint"]
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith("*")
        sub = Subscriber(endpoint)
        try:
            probe = await sub.sync(http, engine.url)
        finally:
            sub.close()
    finally:
        await engine.stop()
    assert probe.topic == b"custom-topic" and info["kv_events_topic"] == "custom-topic"
    assert endpoint in engine.startup_line()


async def test_an_empty_topic_is_sent_as_is_as_vllm_does(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    # vLLM's default topic is "", and vllm-router's static sources take only that one:
    # "" must not fall back to the kv@HOST:PORT@MODEL default.
    engine = await start_test_engine(
        kv_events_endpoint=f"ipc://{ipc_dir}/empty-topic",
        kv_events_topic="",
        kv_events_format="v2-mixed",
    )
    sub = Subscriber(engine.kv_events_endpoint or "")
    try:
        _, info = await get(http, f"{engine.url}/server_info")
        probe = await sub.sync(http, engine.url)
        await complete(http, engine.url, text_prompt(40))
        msg = await sub.recv()
    finally:
        sub.close()
        await engine.stop()
    assert probe.topic == msg.topic == b"" and info["kv_events_topic"] == ""
    assert "topic ''" in engine.startup_line()
    # The shape vllm-router 0.1.17 decodes: an array batch of events tagged by "type".
    raw = msgspec.msgpack.decode(msg.payload)
    assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored"


async def test_no_endpoint_means_no_events(http: aiohttp.ClientSession) -> None:
    engine = await start_test_engine()
    try:
        _, info = await get(http, f"{engine.url}/server_info")
    finally:
        await engine.stop()
    assert info["kv_events_endpoint"] is None and info["kv_events_topic"] is None

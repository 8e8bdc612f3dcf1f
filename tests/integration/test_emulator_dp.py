"""Data-parallel ranks behind one HTTP port: separate caches, event streams and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from support.clients import Subscriber, get, metric_sum, metrics, post, post_reply, replay
from support.engines import start_test_engine

from router.emulator import EmulatedEngine
from router.events.types import BlockStored
from router.events.vllm import END_SEQ, decode_batch, decode_seq


def text_prompt(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest_asyncio.fixture(scope="module")
async def dp(ipc_dir: Path) -> AsyncIterator[EmulatedEngine]:
    engine = await start_test_engine(
        engine_id="dp",
        dp_size=2,
        kv_events_endpoint=f"ipc://{ipc_dir}/dp-events",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    yield engine
    await engine.stop()


async def cached(
    http: aiohttp.ClientSession, engine: EmulatedEngine, prompt: str, rank: int | None
) -> int:
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else None
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
    status, answer = await post(http, f"{engine.url}/v1/completions", body, headers)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_each_rank_keeps_its_own_cache(
    dp: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(100, "sep")
    assert await cached(http, dp, prompt, rank=0) == 0
    assert await cached(http, dp, prompt, rank=0) == 96
    assert await cached(http, dp, prompt, rank=1) == 0
    assert await cached(http, dp, prompt, rank=1) == 96


async def test_requests_without_the_header_alternate_between_ranks(
    dp: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(100, "rr")
    hits = [await cached(http, dp, prompt, rank=None) for _ in range(4)]
    assert hits == [0, 0, 96, 96]


async def test_a_rank_out_of_range_or_not_a_number_is_a_400(
    dp: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    for value, phrase in (("2", "out of range [0, 2)"), ("-1", "out of range"), ("x", "integer")):
        reply = await post_reply(
            http,
            f"{dp.url}/v1/completions",
            {"prompt": "a b", "max_tokens": 1},
            {"X-data-parallel-rank": value},
        )
        assert reply.status == 400 and phrase in reply.body["error"]["message"], value


async def test_server_info_lists_every_rank_and_keeps_rank_0_at_the_top(
    dp: EmulatedEngine, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    _, info = await get(http, f"{dp.url}/server_info")
    first, second = info["ranks"]
    assert info["dp_size"] == 2
    assert first["kv_events_endpoint"] == info["kv_events_endpoint"] == f"ipc://{ipc_dir}/dp-events"
    assert second["kv_events_endpoint"] == f"ipc://{ipc_dir}/dp-events_dp1"
    assert first["kv_events_replay_endpoint"] == info["kv_events_replay_endpoint"]
    assert second["kv_events_replay_endpoint"] != first["kv_events_replay_endpoint"]
    assert (first["kv_engine_id"], second["kv_engine_id"]) == ("dp_dp0", "dp_dp1")
    assert first["side_channel_port"] == info["side_channel_port"]
    assert second["side_channel_port"] not in (0, first["side_channel_port"])


async def test_each_rank_publishes_its_own_numbered_event_stream(
    dp: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    _, info = await get(http, f"{dp.url}/server_info")
    subs = [Subscriber(rank["kv_events_endpoint"]) for rank in info["ranks"]]
    try:
        # A reset publishes on every rank: one probe per stream proves both are live.
        probes = [await sub.sync(http, dp.url) for sub in subs]
        for sub in subs:
            while True:  # drain the probes of the other stream's retries
                try:
                    await sub.recv(timeout=0.05)
                except asyncio.TimeoutError:
                    break
        prompt = text_prompt(40, "events")
        await cached(http, dp, prompt, rank=1)
        message = await subs[1].recv()
        batch = message.batch
        assert batch.data_parallel_rank == 1
        assert any(isinstance(e, BlockStored) for e in batch.events)
        assert probes[1].batch.data_parallel_rank == 1 and probes[0].batch.data_parallel_rank == 0
        # Rank 0 published nothing for a request rank 1 served.
        try:
            extra = await subs[0].recv(timeout=0.1)
        except asyncio.TimeoutError:
            extra = None
        assert extra is None
    finally:
        for sub in subs:
            sub.close()
    # Each rank numbers its own batches from 0 and replays only its own.
    replies = await replay(info["ranks"][1]["kv_events_replay_endpoint"], 0)
    seqs = [decode_seq(seq) for seq, _ in replies if seq != END_SEQ]
    assert seqs == list(range(len(seqs))) and message.seq in seqs
    ranks = {decode_batch(p).data_parallel_rank for s, p in replies if s != END_SEQ}
    assert ranks == {1}


async def test_metrics_carry_the_rank_as_the_engine_label(
    dp: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    name = "vllm:prompt_tokens_total"
    before = await metrics(http, dp.url)
    await cached(http, dp, text_prompt(30, "metrics"), rank=1)
    after = await metrics(http, dp.url)
    assert {s.labels["engine"] for s in after["vllm:num_requests_running"]} == {"0", "1"}
    moved = {
        engine: metric_sum(after, name, engine=engine) - metric_sum(before, name, engine=engine)
        for engine in ("0", "1")
    }
    assert moved == {"0": 0, "1": 30}


async def test_a_nixl_handoff_names_the_rank_that_holds_the_blocks(
    dp: EmulatedEngine, engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    _, info = await get(http, f"{dp.url}/server_info")
    prompt = text_prompt(64, "dp-handoff")
    leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    _, answer = await post(http, f"{dp.url}/v1/completions", leg, {"X-data-parallel-rank": "1"})
    params = answer["kv_transfer_params"]
    assert params["remote_engine_id"] == "dp_dp1"
    assert params["remote_port"] == info["ranks"][1]["side_channel_port"]
    body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
    reply = await post_reply(http, f"{engine.url}/v1/completions", body)
    assert reply.headers["x-kvroute-handoff"] == "pulled=64"

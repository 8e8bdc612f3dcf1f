"""KV events from real vLLM engines through kvroute: discovery, replay, gaps, eviction and
cache resets (an engine restart: test_vllm_nixl.py). No frame of a real engine may ever
be counted as garbage."""

from __future__ import annotations

import re

import aiohttp
import pytest
from support.clients import metric_sum, metrics, post, post_reply
from support.engines import poll
from support.real_vllm import VllmEngine
from support.vllm_prompts import above, cached_tokens, completion, start_vllm_router, text

from router.app import RouterApp
from router.process import ServerProcess
from router.types import EngineKey


def key(engine: VllmEngine) -> EngineKey:
    return EngineKey(f"127.0.0.1:{engine.port}")


async def held(app: RouterApp, engine: VllmEngine) -> int:
    return (await app.index.held_blocks()).get(key(engine), 0)


def matched_blocks(reason: str) -> int:
    found = re.search(r"match=(\d+)", reason)
    return int(found.group(1)) if found else 0


async def test_serve_with_only_engine_urls_follows_both_engines_and_replays_what_they_cached(
    vllm_pair: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = vllm_pair
    prompt = text(120, "cached-before-the-router")
    status, body = await post(http, f"{a.url}/v1/completions", completion(prompt))
    assert status == 200 and cached_tokens(body) == 0
    # No configuration but the engines' URLs; only the timeouts are a busy machine's (the
    # defaults, 1 s probes and 2 s replays, are for engines that answer at once: a probe
    # or discovery call a loaded CPU vLLM misses leaves an engine unreplayed).
    for name in ("HEALTH__TIMEOUT_S", "EVENTS__REPLAY_TIMEOUT_S", "SCRAPE__TIMEOUT_S"):
        monkeypatch.setenv(f"KVROUTE_{name}", "5")
    router = ServerProcess(
        "serve", ["--port", "0", "--engine", a.url, "--engine", b.url], timeout=120
    )
    try:

        async def replayed() -> bool:
            samples = await metrics(http, router.url)
            return (
                metric_sum(samples, "kvroute_kv_event_replays_total", outcome="ok") >= 2
                and metric_sum(samples, "kvroute_engine_healthy") == 2
            )

        # Both engines are found through vLLM's /kv_event_sources and replayed at start-up.
        await poll(replayed, timeout=60, interval=0.2)
        samples = await metrics(http, router.url)
        assert metric_sum(samples, "kvroute_kv_events_total", type="BlockStored") >= 1
        reply = await post_reply(http, f"{router.url}/v1/completions", completion(prompt))
        assert reply.status == 200
        assert reply.headers["x-kvroute-engine"] == f"127.0.0.1:{a.port}"
        reason = reply.headers["x-kvroute-reason"]
        assert "prefix_hit" in reason and matched_blocks(reason) >= 8, reason
        assert cached_tokens(reply.body) >= 8 * 32
        chat = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": text(40, "serve-chat")}],
            "max_tokens": 2,
        }
        status, _ = await post(http, f"{router.url}/v1/chat/completions", chat)
        assert status == 200
        samples = await metrics(http, router.url)
        assert metric_sum(samples, "kvroute_kv_event_garbage_total") == 0
        assert metric_sum(samples, "kvroute_tokenizer_mismatches_total") == 0
        # A block size was never configured: the pool took the engines' 32 and kept both.
        assert metric_sum(samples, "kvroute_engine_refused") == 0
        assert metric_sum(samples, "kvroute_engine_healthy") == 2
    finally:
        router.stop()


async def test_a_gap_in_the_stream_is_repaired_by_replay(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, _ = vllm_pair
    app = await start_vllm_router([a.url])
    try:
        assert app.subscriber is not None
        stream = app.subscriber._streams[key(a)]
        state, source = stream.state, stream.source
        # Unsubscribe, keeping the stream's place: what the engine publishes meanwhile
        # is missed on the wire, as when a SUB socket drops messages.
        await app.subscriber.remove_source(key(a))
        prompt = text(120, "published-during-the-gap")
        status, _ = await post(http, f"{a.url}/v1/completions", completion(prompt))
        assert status == 200
        ok_before = app.subscriber.stats.replays["ok"]
        await app.subscriber.add_source(source, state)
        await poll(lambda: app.subscriber.stats.replays["ok"] > ok_before, timeout=30)
        reply = await post_reply(http, f"{app.url}/v1/completions", completion(prompt))
        assert matched_blocks(reply.headers["x-kvroute-reason"]) >= 5
        assert app.subscriber.stats.garbage == 0
    finally:
        await app.stop()


async def test_eviction_in_a_small_cache_arrives_as_block_removed(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    _, b = vllm_pair
    app = await start_vllm_router([b.url])
    try:
        first = text(500, "evicted-first")
        status, _ = await post(http, f"{app.url}/v1/completions", completion(first))
        assert status == 200
        # 192 blocks of 32 tokens: these prompts need more than the cache holds.
        for i in range(8):
            status, _ = await post(
                http, f"{app.url}/v1/completions", completion(text(500, f"evictor-{i}"))
            )
            assert status == 200

        async def removals() -> float:
            samples = await metrics(http, app.url)
            return metric_sum(samples, "kvroute_kv_events_total", type="BlockRemoved")

        await poll(removals, timeout=15)
        reply = await post_reply(http, f"{app.url}/v1/completions", completion(first))
        # The router no longer believes the engine holds the evicted prefix.
        assert matched_blocks(reply.headers["x-kvroute-reason"]) < 10
        assert app.subscriber is not None and app.subscriber.stats.garbage == 0
    finally:
        await app.stop()


async def test_reset_prefix_cache_arrives_as_all_blocks_cleared(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, _ = vllm_pair
    app = await start_vllm_router([a.url])
    try:
        prompt = text(120, "before-the-reset")
        await post(http, f"{app.url}/v1/completions", completion(prompt))
        await poll(lambda: held(app, a), timeout=10)
        # The start-up replay done: an old reset it still holds must not be taken for
        # this one (a replay that timed out starts again with the next batch).
        subscriber = app.subscriber
        assert subscriber is not None
        stream = subscriber._streams[key(a)]
        await poll(
            lambda: not stream.replaying and subscriber.stats.replays["ok"] >= 1,
            timeout=30,
            interval=0.05,
        )

        async def cleared() -> float:
            samples = await metrics(http, app.url)
            return metric_sum(samples, "kvroute_kv_events_total", type="AllBlocksCleared")

        before = await cleared()  # the start-up replay may hold earlier resets
        async with http.post(f"{a.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        # vLLM queues AllBlocksCleared and publishes it with its next scheduler step.
        await post(http, f"{a.url}/v1/completions", completion(text(10, "next-step")))
        await poll(lambda: above(cleared(), before), timeout=15, interval=0.05)
        reply = await post_reply(http, f"{app.url}/v1/completions", completion(prompt))
        assert matched_blocks(reply.headers["x-kvroute-reason"]) == 0
        assert cached_tokens(reply.body) == 0
    finally:
        await app.stop()

"""kvroute serve in front of four emulated engines: cache affinity against round robin."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest_asyncio
from support.clients import REQUEST_TIMEOUT_S, post, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.bench.loadgen import run_load, summarize
from router.emulator import EmulatedEngine
from router.workloads.generated import shared_prefix_workload


@pytest_asyncio.fixture(scope="module")
async def fleet(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"fleet{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/fleet{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(4)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


async def fresh(http: aiohttp.ClientSession, engines: list[EmulatedEngine]) -> None:
    for engine in engines:
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200


async def test_shared_prefix_groups_stay_together_and_beat_round_robin(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """8 groups sharing a 2,000-token prefix, concurrency 8 (issue 5's acceptance)."""
    workload = shared_prefix_workload(8, 5, 2000, 40, 8, seed=3, shuffle=False)
    ratios = {}
    for policy in ("kv_cost", "round_robin"):
        await fresh(http, fleet)
        app = await start_router([e.url for e in fleet], policy={"name": policy})
        try:
            await poll(lambda app=app: app.subscriber and app.subscriber.stats.replays["ok"] == 4)
            results = await run_load(app.url, workload, concurrency=8, timeout=REQUEST_TIMEOUT_S)
        finally:
            await app.stop()
        summary = summarize(results)
        assert summary.errors == 0
        ratios[policy] = summary.hit_rate
        if policy == "kv_cost":
            by_group: dict[str, Counter[str]] = {}
            for r in results:
                by_group.setdefault(r.spec.group, Counter())[r.engine] += 1
            for group, engines in by_group.items():
                assert max(engines.values()) / sum(engines.values()) >= 0.9, (group, engines)
            assert len(summary.per_engine) == 4, summary.per_engine
    assert ratios["kv_cost"] >= 3 * ratios["round_robin"], ratios


async def test_routing_follows_the_engines_kv_events(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    await fresh(http, fleet)
    app = await start_router([e.url for e in fleet])
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 4)
        prompt = " ".join(f"doc{i}" for i in range(640))
        status, _ = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompt, "max_tokens": 2}
        )
        assert status == 200
        # The engine's BlockStored events reach the index as firm entries.
        await poll(lambda: app.ingestor.counters.blocks_stored >= 640 // 16)
        status, again = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompt + " tail", "max_tokens": 2}
        )
        assert status == 200
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
    finally:
        await app.stop()


async def test_engines_added_and_removed_at_run_time(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """add_engine makes a new engine a candidate with its KV events followed;
    remove_engine stops routing to it and drops its stream and load state."""
    from router.config import EngineConfig
    from router.fleet.registry import endpoint_of
    from router.types import EngineKey

    await fresh(http, fleet)
    app = await start_router([fleet[0].url], policy={"name": "round_robin"})
    try:
        model = app.registry.models()[0]
        app.add_engine(EngineConfig(url=fleet[1].url))
        added = EngineKey(endpoint_of(fleet[1].url))
        await poll(lambda: app.subscriber is not None and app.subscriber.stream_state(added))
        await poll(lambda: len(app.registry.candidates(model)) == 2)
        served: Counter[str] = Counter()
        for i in range(4):
            reply = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"prompt": f"run time {i} " * 40, "max_tokens": 2},
            )
            assert reply.status == 200, reply.body
            served[reply.headers["x-kvroute-engine"]] += 1
        assert served[added.label] == 2
        removed = await app.remove_engine(added.endpoint)
        assert removed is not None
        assert app.subscriber.stream_state(added) is None
        assert app.registry.candidates(model) == [EngineKey(endpoint_of(fleet[0].url))]
        for i in range(2):
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": f"after {i} " * 40, "max_tokens": 2}
            )
            assert reply.headers["x-kvroute-engine"] != added.label
        assert await app.remove_engine(added.endpoint) is None
    finally:
        await app.stop()

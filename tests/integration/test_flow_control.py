"""Flow control (``flow.enabled``) on every front end: priority bands, fairness across
tenants, sheddable requests, queue mechanics, rate limits (local and shared through
Redis), pool saturation. One slow engine and ``limits.max_inflight: 1`` make requests
queue behind one held stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from support.clients import metric_sum, metrics, post_reply
from support.engines import poll, start_test_engine
from support.extproc import header_map, request_messages
from support.grpc_clients import connect, generate
from support.redis import RedisServer
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.grpc.gen.kvroute.v1 import router_pb2 as pb

HOLD = {"prompt": "hold on " * 10, "max_tokens": 400, "stream": True}
KEYS = [
    {"key": "k-http", "name": "http", "rpm": 1},
    {"key": "k-gen", "name": "gen", "rpm": 1},
    {"key": "k-pick", "name": "pick", "rpm": 1},
    {"key": "k-ext", "name": "ext", "rpm": 1},
    {"key": "k-tokens", "name": "tokens", "tpm": 50},
]


@pytest_asyncio.fixture(scope="module")
async def slow() -> AsyncIterator[EmulatedEngine]:
    engine = await start_test_engine(engine_id="flow-slow", time_scale=1.0)
    yield engine
    await engine.stop()


async def flow_router(engine: EmulatedEngine, **flow: Any) -> RouterApp:
    limits = flow.pop("limits", {"max_inflight": 1, "admission_timeout_s": 30})
    server = flow.pop("server", {})
    return await start_router(
        [engine.url],
        limits=limits,
        server=server,
        grpc={"port": 0},
        extproc={"port": 0},
        flow={"enabled": True, **flow},
    )


@asynccontextmanager
async def holding(http: aiohttp.ClientSession, app: RouterApp) -> AsyncIterator[None]:
    """One streaming request holds the router's only slot until the block ends."""
    async with http.post(f"{app.url}/v1/completions", json=HOLD) as held:
        assert held.status == 200
        await held.content.readany()
        yield


def request(
    http: aiohttp.ClientSession,
    app: RouterApp,
    finished: list[str],
    name: str,
    headers: dict[str, str],
) -> asyncio.Task[tuple[int, dict[str, str]]]:
    """A small completion, queued; ``finished`` gets ``name`` when its answer is read."""

    async def run() -> tuple[int, dict[str, str]]:
        body = {"prompt": f"{name} asks", "max_tokens": 1}
        async with http.post(f"{app.url}/v1/completions", json=body, headers=headers) as resp:
            await resp.read()
            finished.append(name)
            return resp.status, dict(resp.headers)

    return asyncio.ensure_future(run())


async def queue_up(
    app: RouterApp, make: list[Callable[[], asyncio.Task[Any]]]
) -> list[asyncio.Task[Any]]:
    """Start each request once the one before it is waiting (so arrival order is known)."""
    tasks = []
    for start in make:
        before = app.admission.waiting
        tasks.append(start())
        await poll(lambda b=before: app.admission.waiting == b + 1)
    return tasks


# --------------------------------------------------------------------------- bands


async def test_a_higher_band_is_served_before_requests_that_queued_earlier(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow)
    try:
        finished: list[str] = []
        async with holding(http, app):
            tasks = await queue_up(
                app,
                [
                    lambda: request(http, app, finished, "low-1", {}),
                    lambda: request(http, app, finished, "low-2", {}),
                    lambda: request(http, app, finished, "high", {"x-kvroute-priority": "5"}),
                ],
            )
        answers = await asyncio.gather(*tasks)
        assert finished == ["high", "low-1", "low-2"]
        status, headers = answers[2]
        assert status == 200
        reason = headers["x-kvroute-reason"]
        assert "flow tenant=default priority=5 waited=" in reason
        waited = float(reason.rsplit("waited=", 1)[1].rstrip("s"))
        assert waited > 0
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_admitted_total", band="5") == 1
        assert metric_sum(samples, "kvroute_flow_wait_seconds_total", band="5") > 0
    finally:
        await app.stop()


async def test_generate_waits_in_the_same_bands_as_http(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow)
    try:
        finished: list[str] = []

        async def via_generate() -> int:
            async with connect(app.grpc_port) as stubs:
                answer = await generate(
                    stubs.router,
                    {"prompt": "grpc asks", "max_tokens": 1},
                    headers={"x-kvroute-priority": "3"},
                )
            finished.append("generate")
            assert "priority=3" in answer.headers["x-kvroute-reason"]
            return answer.status

        async with holding(http, app):
            tasks = await queue_up(
                app,
                [
                    lambda: request(http, app, finished, "http-low", {}),
                    lambda: asyncio.ensure_future(via_generate()),
                ],
            )
        await asyncio.gather(*tasks)
        assert finished == ["generate", "http-low"]
    finally:
        await app.stop()


# --------------------------------------------------------------------------- fairness


@pytest.mark.parametrize("fairness", ["vtc", "round_robin"])
async def test_a_quiet_tenant_is_not_queued_behind_a_noisy_tenants_backlog(
    slow: EmulatedEngine, http: aiohttp.ClientSession, fairness: str
) -> None:
    app = await flow_router(slow, fairness=fairness)
    try:
        finished: list[str] = []
        noisy = {"x-kvroute-tenant": "noisy"}
        async with holding(http, app):
            tasks = await queue_up(
                app,
                [
                    *[
                        lambda i=i: request(http, app, finished, f"noisy-{i}", noisy)
                        for i in range(3)
                    ],
                    lambda: request(http, app, finished, "quiet", {"x-kvroute-tenant": "quiet"}),
                ],
            )
            samples = await metrics(http, app.url)
            assert metric_sum(samples, "kvroute_flow_waiting", band="0", tenant="other") == 4
        await asyncio.gather(*tasks)
        assert finished.index("quiet") == 1  # after the first noisy request, not the last
    finally:
        await app.stop()


async def test_a_tenant_at_its_share_waits_while_a_slot_stays_free_for_others(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(
        slow, tenant_share=0.5, limits={"max_inflight": 2, "admission_timeout_s": 30}
    )
    try:
        finished: list[str] = []
        noisy = {"x-kvroute-tenant": "noisy"}
        async with http.post(f"{app.url}/v1/completions", json=HOLD, headers=noisy) as held:
            await held.content.readany()
            (task,) = await queue_up(app, [lambda: request(http, app, finished, "noisy-2", noisy)])
            assert app.admission.in_flight == 1  # a slot is free, but not for noisy
            quiet = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"prompt": "quiet asks", "max_tokens": 1},
                {"x-kvroute-tenant": "quiet"},
            )
            assert quiet.status == 200 and "waited=0.000s" in quiet.headers["x-kvroute-reason"]
            assert finished == [] and app.admission.waiting == 1
        assert (await task)[0] == 200
        await poll(lambda: app.admission.in_flight == 0)
        assert app.admission.holding == {}
    finally:
        await app.stop()


async def test_the_openai_user_field_names_the_tenant(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow, limits={"max_inflight": 10})
    try:
        body = {"prompt": "who am i", "max_tokens": 1, "user": "alice"}
        reply = await post_reply(http, f"{app.url}/v1/completions", body)
        assert reply.status == 200
        assert "flow tenant=alice priority=0" in reply.headers["x-kvroute-reason"]
    finally:
        await app.stop()


# --------------------------------------------------------------------------- shedding


async def test_only_sheddable_requests_are_refused_while_higher_bands_wait(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """Two queued requests saturate the pool (``queue_waiting: 2``): a queued sheddable
    request is evicted, a new one refused at once, both 429 with Retry-After; the
    priority-0 requests wait and are served."""
    app = await flow_router(slow, saturation={"queue_waiting": 2})
    try:
        finished: list[str] = []
        shed = {"x-kvroute-priority": "-1"}
        async with holding(http, app):
            tasks = await queue_up(
                app,
                [
                    lambda: request(http, app, finished, "sheddable", shed),
                    lambda: request(http, app, finished, "normal-1", {}),
                ],
            )
            tasks.append(request(http, app, finished, "normal-2", {}))
            evicted = await tasks[0]
            assert evicted[0] == 429 and evicted[1]["Retry-After"] == "1"
            await poll(lambda: app.admission.waiting == 2)
            refused = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": "x", "max_tokens": 1}, shed
            )
            assert refused.status == 429 and refused.headers["retry-after"] == "1"
            assert "sheddable" in refused.body["error"]["message"]
            samples = await metrics(http, app.url)
            model = "kvroute-emulated"
            assert metric_sum(samples, "kvroute_pool_saturation", model=model) == 1.0
        assert [t[0] for t in await asyncio.gather(*tasks[1:])] == [200, 200]
        assert finished == ["sheddable", "normal-1", "normal-2"]
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_refused_total", band="-1", reason="shed") == 2
        assert metric_sum(samples, "kvroute_flow_refused_total", band="0") == 0
    finally:
        await app.stop()


async def test_pick_and_extproc_refuse_a_sheddable_request_at_once_when_saturated(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """One held stream fills the only engine (``engine_inflight: 1``): Pick and ext_proc
    answer a sheddable request 429 / RESOURCE_EXHAUSTED at once, and pick the others at
    once (they do not wait)."""
    app = await flow_router(slow, saturation={"engine_inflight": 1}, limits={"max_inflight": 10})
    try:
        async with holding(http, app):
            async with connect(app.grpc_port) as stubs:
                with pytest.raises(aio.AioRpcError) as refused:
                    await stubs.router.Pick(
                        pb.PickRequest(text="pick me", headers={"x-kvroute-priority": "-2"})
                    )
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "sheddable" in (refused.value.details() or "")
                kept = await stubs.router.Pick(pb.PickRequest(text="pick me"))
                await stubs.router.Release(pb.ReleaseRequest(request_id=kept.request_id))
            status, headers, error = await via_extproc(app, {}, {"priority": -1})
            assert status == 429 and headers["retry-after"] == "1"
            assert "sheddable" in error["error"]["message"]
            assert (await via_extproc(app, {}))[0] == 200
            assert (await via_extproc(app, {"x-kvroute-priority": "-1"}))[0] == 429
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_refused_total", reason="shed") == 3
    finally:
        await app.stop()


# --------------------------------------------------------------------------- queue mechanics


async def test_a_queued_request_whose_client_leaves_is_removed_at_once(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow)
    try:
        finished: list[str] = []
        async with holding(http, app):
            (task,) = await queue_up(app, [lambda: request(http, app, finished, "gone", {})])
            assert len(app.flow.queue) == 1  # type: ignore[union-attr]
            task.cancel()
            await poll(lambda: app.admission.waiting == 0)
            assert len(app.flow.queue) == 0  # type: ignore[union-attr]
        await poll(lambda: app.admission.in_flight == 0)
        assert finished == []
    finally:
        await app.stop()


async def test_a_queued_generate_call_that_is_cancelled_leaves_the_queue_at_once(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow)
    try:
        async with holding(http, app), connect(app.grpc_port) as stubs:
            call = stubs.router.Generate(
                pb.GenerateRequest(body=json.dumps({"prompt": "wait", "max_tokens": 1}).encode())
            )
            reading = asyncio.ensure_future(call.read())
            await poll(lambda: app.admission.waiting == 1)
            call.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await poll(lambda: app.admission.waiting == 0)
            assert len(app.flow.queue) == 0  # type: ignore[union-attr]
        await poll(lambda: app.admission.in_flight == 0)
    finally:
        await app.stop()


async def test_the_wait_is_in_the_access_log_reason(
    slow: EmulatedEngine, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    app = await flow_router(slow, limits={"max_inflight": 4}, server={"access_log": True})
    try:
        with caplog.at_level(logging.INFO, logger="kvroute.access"):
            reply = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"prompt": "logged", "max_tokens": 1},
                {"x-request-id": "flow-logged", "x-kvroute-tenant": "acct"},
            )
        assert reply.status == 200
        (record,) = [r for r in caplog.records if getattr(r, "request_id", "") == "flow-logged"]
        assert "flow tenant=acct priority=0 waited=" in record.reason  # type: ignore[attr-defined]
    finally:
        await app.stop()


async def test_fairness_counts_the_tokens_the_answer_reports(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """The admission charge is an estimate; the answer's usage replaces it."""
    app = await flow_router(slow, limits={"max_inflight": 4})
    try:
        body = {"prompt": "count my tokens " * 30, "max_tokens": 200}
        reply = await post_reply(
            http, f"{app.url}/v1/completions", body, {"x-kvroute-tenant": "acct"}
        )
        assert reply.status == 200
        usage = reply.body["usage"]
        served = usage["prompt_tokens"] + usage["completion_tokens"]
        counters = app.flow.fairness.counters  # type: ignore[union-attr]
        await poll(lambda: counters.get("acct") == served)
    finally:
        await app.stop()


async def test_a_band_that_waits_past_its_longest_wait_gets_the_configured_status(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow, max_wait_s={0: 0.2}, max_wait_status=503)
    try:
        async with holding(http, app):
            started = time.monotonic()
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": "late", "max_tokens": 1}
            )
            assert reply.status == 503 and "waited" in reply.body["error"]["message"]
            assert time.monotonic() - started < 20  # its band's wait, not the 30 s timeout
            # Another band keeps limits.admission_timeout_s: it is still waiting.
            other = asyncio.ensure_future(
                post_reply(
                    http,
                    f"{app.url}/v1/completions",
                    {"prompt": "patient", "max_tokens": 1},
                    {"x-kvroute-priority": "1"},
                )
            )
            await poll(lambda: app.admission.waiting == 1)
        assert (await other).status == 200
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_refused_total", band="0", reason="timeout") == 1
    finally:
        await app.stop()


async def test_a_full_band_refuses_with_429(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow, band_queue=1)
    try:
        finished: list[str] = []
        async with holding(http, app):
            tasks = await queue_up(app, [lambda: request(http, app, finished, "first", {})])
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": "x", "max_tokens": 1}
            )
            assert reply.status == 429 and "waiting at priority 0" in reply.body["error"]["message"]
            other_band = request(http, app, finished, "other", {"x-kvroute-priority": "1"})
            await poll(lambda: app.admission.waiting == 2)
        await asyncio.gather(*tasks, other_band)
        assert finished == ["other", "first"]
    finally:
        await app.stop()


# --------------------------------------------------------------------------- rate limits


async def via_extproc(
    app: RouterApp,
    headers: dict[str, str],
    flow: dict[str, Any] | None = None,
    body: bytes = json.dumps({"prompt": "through envoy", "max_tokens": 1}).encode(),
) -> tuple[int, dict[str, str], Any]:
    """One FULL_DUPLEX_STREAMED exchange: (status, immediate-response headers, error body)."""
    async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        for message in request_messages(headers, body, flow):
            await call.write(message)
        first = await call.read()
        await call.done_writing()
        while await call.read() is not aio.EOF:
            pass
    if first.WhichOneof("response") == "immediate_response":
        refusal = first.immediate_response
        got = {h.header.key: h.header.raw_value.decode() for h in refusal.headers.set_headers}
        return refusal.status.code, got, json.loads(refusal.body)
    return 200, {}, None


async def test_a_keys_rpm_limit_refuses_on_every_front_end_naming_the_limit(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await flow_router(slow, keys=KEYS, limits={"max_inflight": 10})
    try:
        url = f"{app.url}/v1/completions"
        body = {"prompt": "counted", "max_tokens": 1}
        auth = {"authorization": "Bearer k-http"}
        assert (await post_reply(http, url, body, auth)).status == 200
        refused = await post_reply(http, url, body, auth)
        assert refused.status == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.body["error"]
        assert error["code"] == "rate_limit_exceeded" and error["param"] == "rpm"
        assert "key 'http': 1 requests per minute (rpm)" in error["message"]

        async with connect(app.grpc_port) as stubs:
            gen = {"authorization": "Bearer k-gen"}
            assert (await generate(stubs.router, body, headers=gen)).status == 200
            with pytest.raises(aio.AioRpcError) as err:
                await generate(stubs.router, body, headers=gen)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "key 'gen'" in (err.value.details() or "")

            pick = {"authorization": "Bearer k-pick"}
            kept = await stubs.router.Pick(pb.PickRequest(text="x", headers=pick))
            await stubs.router.Release(pb.ReleaseRequest(request_id=kept.request_id))
            with pytest.raises(aio.AioRpcError) as err:
                await stubs.router.Pick(pb.PickRequest(text="x", headers=pick))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "key 'pick'" in (err.value.details() or "")

        ext = {"authorization": "Bearer k-ext"}
        assert (await via_extproc(app, ext))[0] == 200
        status, headers, body_json = await via_extproc(app, ext)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body_json["error"]["code"] == "rate_limit_exceeded"
        assert "key 'ext'" in body_json["error"]["message"]

        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_flow_refused_total", reason="rpm") == 4
    finally:
        await app.stop()


async def test_a_tpm_limit_counts_prompt_and_output_tokens(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """The first request costs more than the bucket holds and passes (a full bucket goes
    into debt); the next is refused on tokens; a tenant's limit applies too."""
    app = await flow_router(
        slow,
        keys=KEYS,
        tenants=[{"name": "team", "rpm": 1}],
        limits={"max_inflight": 10},
    )
    try:
        url = f"{app.url}/v1/completions"
        auth = {"authorization": "Bearer k-tokens"}
        body = {"prompt": "many words " * 20, "max_tokens": 40}
        assert (await post_reply(http, url, body, auth)).status == 200
        refused = await post_reply(http, url, body, auth)
        assert refused.status == 429 and refused.body["error"]["param"] == "tpm"
        assert "50 tokens per minute" in refused.body["error"]["message"]

        team = {"x-kvroute-tenant": "team"}
        small = {"prompt": "x", "max_tokens": 1}
        assert (await post_reply(http, url, small, team)).status == 200
        refused = await post_reply(http, url, small, team)
        assert refused.status == 429 and "tenant 'team'" in refused.body["error"]["message"]
    finally:
        await app.stop()


async def test_two_replicas_sharing_redis_enforce_one_rpm_and_fall_back_when_it_stops(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """One key's rpm 40 (a bucket of the whole window, refilling one request per 1.5 s):
    90 requests at once through two replicas pass 40 between them (one limit, not one
    per replica); with Redis killed each replica keeps limiting with its own buckets and
    counts the fallbacks. (The rate over a whole minute: docs/benchmarks.md.)"""
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not on the PATH")
    apps: list[RouterApp] = []
    try:
        for _ in range(2):
            apps.append(
                await flow_router(
                    slow,
                    keys=[{"key": "k-shared", "name": "shared", "rpm": 40}],
                    rate_limit={
                        "backend": "redis",
                        "redis_url": server.url,
                        "window_s": 60,
                        "burst": 1.0,
                        "timeout_s": 1.0,  # this shared machine can stall a call 50 ms
                    },
                    limits={"max_inflight": 200},
                )
            )
        auth = {"authorization": "Bearer k-shared"}
        body = {"prompt": "x", "max_tokens": 1}

        async def send(app: RouterApp, n: int) -> list[int]:
            url = f"{app.url}/v1/completions"
            replies = await asyncio.gather(*(post_reply(http, url, body, auth) for _ in range(n)))
            return [r.status for r in replies]

        started = time.monotonic()
        results = await asyncio.gather(*(send(a, 45) for a in apps))
        refill = (time.monotonic() - started) / 1.5  # at most this many more may pass
        passed = sum(s == 200 for r in results for s in r)
        assert 40 <= passed <= 40 + refill + 1, (passed, refill)
        assert all(200 in r for r in results)  # both replicas took a share of one limit
        assert sum(s == 429 for r in results for s in r) == 90 - passed
        assert all(a.flow.limiter.fallbacks == 0 for a in apps)  # type: ignore[union-attr]

        server.kill()
        results = await asyncio.gather(*(send(a, 45) for a in apps))
        for app, statuses in zip(apps, results, strict=True):
            assert 200 in statuses and 429 in statuses  # still limiting, alone
            samples = await metrics(http, app.url)
            assert metric_sum(samples, "kvroute_rate_limit_fallbacks_total") == 45
    finally:
        for app in apps:
            await app.stop()
        server.kill()


# --------------------------------------------------------------------------- saturation


async def test_pool_saturation_rises_monotonically_with_offered_load(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """More held streams, then requests queued past max_inflight: the exported
    saturation never falls and reaches 1."""
    app = await flow_router(
        slow,
        limits={"max_inflight": 4, "admission_timeout_s": 30},
        saturation={"engine_inflight": 8, "queue_waiting": 4},
    )
    model = "kvroute-emulated"
    streams: list[Any] = []
    queued: list[asyncio.Task[Any]] = []
    finished: list[str] = []
    try:
        values = []
        samples = await metrics(http, app.url)
        values.append(metric_sum(samples, "kvroute_pool_saturation", model=model))
        for n in range(1, 5):
            resp = await http.post(f"{app.url}/v1/completions", json=HOLD)
            await resp.content.readany()
            streams.append(resp)
            await poll(lambda n=n: app.loads.in_flight == n)
            samples = await metrics(http, app.url)
            values.append(metric_sum(samples, "kvroute_pool_saturation", model=model))
        for i in range(4):
            queued += await queue_up(app, [lambda i=i: request(http, app, finished, f"q{i}", {})])
            samples = await metrics(http, app.url)
            values.append(metric_sum(samples, "kvroute_pool_saturation", model=model))
        assert values == sorted(values), values
        assert values[0] < values[4] < values[-1] == 1.0, values
    finally:
        for resp in streams:
            resp.close()
        await asyncio.gather(*queued, return_exceptions=True)
        await app.stop()


async def test_pick_and_extproc_correct_the_token_estimate_from_the_answers_usage(
    slow: EmulatedEngine,
) -> None:
    """A gateway's request is charged ``max_tokens`` at the pick; the answer's usage (a
    final ``Release`` with token counts, the usage ext_proc reads at the end of the
    answer) gives back what was not used, so the next request passes; without usage the
    estimate stands, and the one after is refused on tokens."""
    keys = [
        {"key": "k-pick-usage", "name": "pick-usage", "tpm": 2_000},
        {"key": "k-ext-usage", "name": "ext-usage", "tpm": 2_000},
    ]
    app = await flow_router(slow, keys=keys, rate_limit={"burst": 0.5}, limits={"max_inflight": 10})
    body = json.dumps({"prompt": "x", "max_tokens": 900}).encode()
    try:
        async with connect(app.grpc_port) as stubs:

            async def pick() -> pb.PickResponse:
                auth = {"authorization": "Bearer k-pick-usage"}
                return await stubs.router.Pick(pb.PickRequest(body=body, headers=auth))

            first = await pick()
            await stubs.router.Release(
                pb.ReleaseRequest(request_id=first.request_id, prompt_tokens=2, completion_tokens=1)
            )
            second = await pick()  # 900 tokens given back: the bucket holds enough
            await stubs.router.Release(pb.ReleaseRequest(request_id=second.request_id))
            with pytest.raises(aio.AioRpcError) as refused:
                await pick()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tokens" in (refused.value.details() or "")

        usage = b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
        auth = {"authorization": "Bearer k-ext-usage"}
        assert await extproc_exchange(app, body, auth, usage + b"data: [DONE]\n\n") == 200
        assert await extproc_exchange(app, body, auth, b"data: [DONE]\n\n") == 200
        assert await extproc_exchange(app, body, auth, b"") == 429
    finally:
        await app.stop()


async def extproc_exchange(
    app: RouterApp, body: bytes, headers: dict[str, str], answer: bytes
) -> int:
    """A whole request through ext_proc, its answer ``answer`` included: the status (200:
    routed, else the immediate response's)."""
    status_map = header_map({":status": "200"})
    async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        for message in request_messages(headers, body):
            await call.write(message)
        first = await call.read()
        if first.WhichOneof("response") == "immediate_response":
            await call.done_writing()
            return first.immediate_response.status.code
        while not (
            await call.read()
        ).request_body.response.body_mutation.streamed_response.end_of_stream:
            pass
        await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=status_map)))
        await call.read()
        await call.write(
            ep.ProcessingRequest(response_body=ep.HttpBody(body=answer, end_of_stream=True))
        )
        await call.read()
        await call.done_writing()
        while await call.read() is not aio.EOF:
            pass
    return 200


async def test_json_nested_past_the_interpreters_limit_is_a_400_on_every_front_end(
    slow: EmulatedEngine, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Flow control glances at a body before it is decoded: a nesting msgspec cannot
    decode is the client's 400 / INVALID_ARGUMENT there too (as with flow control off),
    not a router error with a traceback."""
    app = await flow_router(slow, limits={"max_inflight": 10})
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 1}'
    try:
        with caplog.at_level(logging.WARNING):
            headers = {"content-type": "application/json"}
            async with http.post(f"{app.url}/v1/completions", data=deep, headers=headers) as r:
                assert r.status == 400
                assert "deeper than" in (await r.json())["error"]["message"]
            async with connect(app.grpc_port) as stubs:
                with pytest.raises(aio.AioRpcError) as err:
                    async for _ in stubs.router.Generate(pb.GenerateRequest(body=deep)):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status, _, error = await via_extproc(app, {}, body=deep)
            assert status == 400 and "deeper than" in error["error"]["message"]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await app.stop()


async def test_a_keys_tenant_limit_binds_whatever_tenant_its_client_names(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """``x-kvroute-tenant`` from a listed key neither dodges its tenant's rpm nor spends
    another tenant's; a key allowed to set tenants names them."""
    app = await flow_router(
        slow,
        keys=[
            {"key": "k-http", "name": "http-team"},
            {"key": "k-gen", "name": "gen-team"},
            {"key": "k-gateway", "name": "gateway", "may_set_tenant": True},
        ],
        tenants=[{"name": n, "rpm": 1} for n in ("http-team", "gen-team", "victim")],
        limits={"max_inflight": 10},
    )
    body = {"prompt": "tenant", "max_tokens": 1}
    try:
        url = f"{app.url}/v1/completions"
        own = {"authorization": "Bearer k-http"}
        assert (await post_reply(http, url, body, own)).status == 200
        dodge = {**own, "x-kvroute-tenant": "elsewhere"}
        refused = await post_reply(http, url, body, dodge)
        assert refused.status == 429 and "tenant 'http-team'" in refused.body["error"]["message"]
        async with connect(app.grpc_port) as stubs:
            gen = {"authorization": "Bearer k-gen"}
            assert (await generate(stubs.router, body, headers=gen)).status == 200
            with pytest.raises(aio.AioRpcError) as err:
                await generate(stubs.router, body, headers={**gen, "x-kvroute-tenant": "other"})
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 'gen-team'" in (err.value.details() or "")
        # The victim's budget is untouched by the others naming it; the gateway spends it.
        victim = {"x-kvroute-tenant": "victim"}
        for key in ("k-http", "k-gen"):
            named = {"authorization": f"Bearer {key}", **victim}
            assert (await post_reply(http, url, body, named)).status == 429
        gateway = {"authorization": "Bearer k-gateway", **victim}
        assert (await post_reply(http, url, body, gateway)).status == 200
        refused = await post_reply(http, url, body, gateway)
        assert refused.status == 429 and "tenant 'victim'" in refused.body["error"]["message"]
    finally:
        await app.stop()

"""Disaggregated prefill/decode through kvroute serve, against emulated engines that
implement the handoff protocols (issue 7). Decode engines run with
``handoff_failure="error"``, so a leg with wrong parameters fails instead of silently
recomputing."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post, post_reply
from support.engines import TEST_PARAMS, poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.fleet.load import EngineLoad

LONG = 2000


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


def prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def engine_metric(http: aiohttp.ClientSession, engine: EmulatedEngine, name: str) -> float:
    return metric_sum(await metrics(http, engine.url), name)


@pytest_asyncio.fixture(scope="module")
async def pools() -> AsyncIterator[dict[str, list[EmulatedEngine]]]:
    prefill = [await start_test_engine(engine_id=f"p{i}", role="prefill") for i in range(2)]
    decode = [
        await start_test_engine(engine_id=f"d{i}", role="decode", handoff_failure="error")
        for i in range(2)
    ]
    yield {"prefill": prefill, "decode": decode}
    for engine in prefill + decode:
        await engine.stop()


@pytest_asyncio.fixture
async def pd_router(
    pools: dict[str, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> AsyncIterator[RouterApp]:
    for engine in pools["prefill"] + pools["decode"]:
        await post(http, f"{engine.url}/reset_prefix_cache", {})
    app = await start_router(
        [{"url": e.url, "role": "prefill"} for e in pools["prefill"]]
        + [{"url": e.url, "role": "decode"} for e in pools["decode"]]
    )
    yield app
    await app.stop()


async def test_a_long_prompt_is_split_and_the_decode_engine_pulls_its_kv(
    pools: dict[str, list[EmulatedEngine]], pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    before = sum(
        [
            await engine_metric(http, d, "kvroute_emulator_kv_pulled_tokens_total")
            for d in pools["decode"]
        ]
    )
    async with http.post(
        f"{pd_router.url}/v1/completions", json={"prompt": prompt("long", LONG), "max_tokens": 5}
    ) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert resp.headers["x-kvroute-mode"] == "split"
        assert resp.headers["x-kvroute-prefill"] in {endpoint(p) for p in pools["prefill"]}
        assert resp.headers["x-kvroute-engine"] in {endpoint(d) for d in pools["decode"]}
        seen = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-kvroute")}
    assert body["usage"]["prompt_tokens"] == LONG
    assert body["usage"]["completion_tokens"] == 5
    # the client sees what the cache saved at prefill: nothing, for a new prompt
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = sum(
        [
            await engine_metric(http, d, "kvroute_emulator_kv_pulled_tokens_total")
            for d in pools["decode"]
        ]
    )
    assert after - before >= LONG - 16
    samples = await metrics(http, pd_router.url)
    outcomes = {
        outcome: metric_sum(samples, "kvroute_handoffs_total", dialect="nixl", outcome=outcome)
        for outcome in ("pulled", "recomputed", "unverified", "no_params")
    }
    assert outcomes["pulled"] == 1, (outcomes, seen, body["usage"])
    assert metric_sum(samples, "kvroute_disagg_decisions_total", mode="split") == 1


async def test_a_streamed_split_shows_the_prefill_legs_cached_tokens(
    pools: dict[str, list[EmulatedEngine]], pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    shared = prompt("shared", LONG)
    cached = []
    for q in range(2):
        body = {
            "prompt": f"{shared} question{q}",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(f"{pd_router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        usage = __import__("json").loads(events[-2][len("data: ") :])["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    # the second request found the shared prefix cached on its prefill engine
    assert cached == [0, LONG]


async def test_shared_prefixes_go_to_the_same_prefill_engine(
    pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    # Each prompt: a shared 2,000-token prefix and its own 1,000 tokens, so the decode
    # engine never holds 80% of it and every request is split.
    shared = prompt("ctx", LONG)
    prefill_engines = set()
    for q in range(5):
        body = {"prompt": f"{shared} {prompt(f'own{q}x', 1000)}", "max_tokens": 2}
        async with http.post(f"{pd_router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-mode"] == "split"
            prefill_engines.add(resp.headers["x-kvroute-prefill"])
            cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if q == 0 else LONG)
    assert len(prefill_engines) == 1


async def test_a_multi_turn_prefix_held_by_the_decode_engine_is_served_there(
    pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    shared = prompt("turns", LONG)
    modes = []
    for q in range(3):
        async with http.post(
            f"{pd_router.url}/v1/completions", json={"prompt": f"{shared} q{q}", "max_tokens": 2}
        ) as resp:
            assert resp.status == 200
            modes.append(resp.headers["x-kvroute-mode"])
    assert modes == ["split", "local:decode_holds_prefix", "local:decode_holds_prefix"]


async def test_short_prompts_are_not_split(
    pools: dict[str, list[EmulatedEngine]], pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    before = [await engine_metric(http, p, "vllm:prompt_tokens_total") for p in pools["prefill"]]
    for i in range(4):
        async with http.post(
            f"{pd_router.url}/v1/completions",
            json={"prompt": prompt(f"short{i}x", 100), "max_tokens": 3},
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-mode"] == "local:short_uncached"
    after = [await engine_metric(http, p, "vllm:prompt_tokens_total") for p in pools["prefill"]]
    assert after == before


async def test_chat_requests_are_split_too(
    pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {
        "messages": [
            {"role": "system", "content": prompt("sys", LONG)},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 3,
    }
    async with http.post(f"{pd_router.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-kvroute-mode"] == "split"
        assert (await resp.json())["object"] == "chat.completion"


async def test_a_decode_engine_failing_before_its_first_byte_is_replaced(
    pools: dict[str, list[EmulatedEngine]], pd_router: RouterApp, http: aiohttp.ClientSession
) -> None:
    bad = pools["decode"][0]
    async with http.post(f"{bad.url}/admin/faults", json={"fail_rate": 1.0}) as resp:
        assert resp.status == 200
    try:
        for i in range(4):
            async with http.post(
                f"{pd_router.url}/v1/completions",
                json={"prompt": prompt(f"retry{i}x", LONG), "max_tokens": 2},
            ) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-kvroute-engine"] == endpoint(pools["decode"][1])
    finally:
        async with http.delete(f"{bad.url}/admin/faults") as resp:
            assert resp.status == 200


@pytest.mark.parametrize("dialect", ["nixl", "sglang"])
async def test_a_dead_prefill_pool_falls_back_to_the_decode_engine_without_failing(
    dialect: str, http: aiohttp.ClientSession
) -> None:
    prefill = [await start_test_engine(engine_id=f"doomed{i}", role="prefill") for i in range(2)]
    decode = await start_test_engine(engine_id="survivor", role="decode", handoff_failure="error")
    app = await start_router(
        [{"url": p.url, "role": "prefill"} for p in prefill]
        + [{"url": decode.url, "role": "decode"}],
        health={"interval_s": 30.0},
        disaggregation={"handoff": dialect},
    )
    try:
        sent = 0

        async def one(i: int) -> None:
            nonlocal sent
            status, body = await post(
                http,
                f"{app.url}/v1/completions",
                {"prompt": prompt(f"kill{i}x", LONG), "max_tokens": 2},
            )
            assert status == 200, body
            sent += 1

        await one(0)
        await prefill[0].stop()  # one prefill engine dies: the other takes over
        for i in range(1, 4):
            await one(i)
        await prefill[1].stop()  # the whole prefill pool is gone: decode alone
        for i in range(4, 7):
            await one(i)
        assert sent == 7
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="prefill_failed") >= 1
    finally:
        await app.stop()
        await decode.stop()
        for p in prefill:
            await p.stop()


async def test_silent_recompute_on_the_decode_engine_is_detected(
    http: aiohttp.ClientSession,
) -> None:
    # The prefill engine drops held KV at once, so every pull fails and the decode engine
    # (vLLM's default behaviour) recomputes the prefill without saying so.
    prefill = await start_test_engine(
        engine_id="forgetful", role="prefill", params=TEST_PARAMS.replace(kv_hold_timeout_s=0.0)
    )
    decode = await start_test_engine(
        engine_id="patient", role="decode", handoff_failure="recompute"
    )
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    )
    try:
        status, _ = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompt("lost", LONG), "max_tokens": 2}
        )
        assert status == 200
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="recomputed") == 1
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="pulled") == 0
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize("dialect", ["nixl", "sglang"])
async def test_a_client_leaving_during_prefill_aborts_the_prefill_leg(
    dialect: str, http: aiohttp.ClientSession
) -> None:
    prefill = await start_test_engine(engine_id="slowfill", role="prefill", time_scale=1.0)
    decode = await start_test_engine(engine_id="waiting", role="decode")
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        disaggregation={"handoff": dialect},
    )
    model = prefill.state.drivers[0].model
    try:
        request = asyncio.ensure_future(
            post(
                http,
                f"{app.url}/v1/completions",
                {"prompt": prompt("huge", 12_000), "max_tokens": 2},
            )
        )
        await poll(lambda: model.stats().num_running == 1)  # prefill is under way
        request.cancel()  # the client goes away
        await asyncio.gather(request, return_exceptions=True)
        await poll(lambda: model.stats().num_running == 0)
        aborted = await engine_metric(http, prefill, "kvroute_emulator_aborted_requests_total")
        assert aborted == 1
        await poll(lambda: app.core.loads.in_flight == 0)
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()


async def test_sglang_pairs_are_never_mixed_up_across_100_concurrent_requests(
    http: aiohttp.ClientSession,
) -> None:
    # Holds that outlast a loaded machine: 480 model seconds are 0.48 s at the tests' clock.
    held = TEST_PARAMS.replace(kv_hold_timeout_s=60_000.0)
    prefill = [
        await start_test_engine(engine_id=f"sp{i}", role="prefill", params=held) for i in range(2)
    ]
    decode = [await start_test_engine(engine_id=f"sd{i}", role="decode") for i in range(2)]
    plain = await start_test_engine(engine_id="reference")
    app = await start_router(
        [{"url": p.url, "role": "prefill"} for p in prefill]
        + [{"url": d.url, "role": "decode"} for d in decode],
        disaggregation={"handoff": "sglang"},
    )
    try:
        assert all(app.registry.get(endpoint(p)).bootstrap_port for p in prefill)
        bodies = [{"prompt": prompt(f"pair{i}x", 600 + i), "max_tokens": 6} for i in range(100)]
        answers = await asyncio.gather(
            *(post(http, f"{app.url}/v1/completions", b) for b in bodies)
        )
        expected = await asyncio.gather(
            *(post(http, f"{plain.url}/v1/completions", b) for b in bodies)
        )
        for (status, got), (_, want), b in zip(answers, expected, bodies, strict=True):
            assert status == 200, got
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["usage"]["prompt_tokens"] == len(b["prompt"].split())
        samples = await metrics(http, app.url)
        assert (
            metric_sum(samples, "kvroute_handoffs_total", dialect="sglang", outcome="pulled") == 100
        )
    finally:
        await app.stop()
        for engine in [*prefill, *decode, plain]:
            await engine.stop()


# ---------------------------------------------------------------- prefill failures, both dialects

#: Faults that make a prefill engine fail at once, or never answer in time.
PREFILL_FAULTS = {"fails": {"fail_rate": 1.0}, "stalls": {"extra_latency_ms": 60_000}}
DIALECTS = ("nixl", "sglang")


async def start_pd(
    tag: str, dialect: str, prefills: int = 2, **sections: Any
) -> tuple[RouterApp, list[EmulatedEngine], EmulatedEngine]:
    """A router over ``prefills`` prefill engines and one decode engine: a decode engine
    wrongly blamed for a prefill failure has no other to be replaced by."""
    prefill = [
        await start_test_engine(engine_id=f"{tag}-p{i}", role="prefill") for i in range(prefills)
    ]
    decode = await start_test_engine(engine_id=f"{tag}-d", role="decode", handoff_failure="error")
    config: dict[str, Any] = {
        # Probes far apart (a fault is found by the requests, not by a probe), and a
        # first one that waits for an engine slow to answer on a busy machine: one
        # missed would leave it out of the pool until the next.
        "health": {"interval_s": 30.0, "timeout_s": 10.0},
        # A stalled prefill is given up on after this; the good engine's prefill must
        # come within it on a loaded machine too.
        "proxy": {"first_byte_timeout_s": 1.5},
        "disaggregation": {"handoff": dialect},
    }
    for name, section in sections.items():
        config[name] = {**config.get(name, {}), **section}
    app = await start_router(
        [{"url": p.url, "role": "prefill"} for p in prefill]
        + [{"url": decode.url, "role": "decode"}],
        **config,
    )
    await poll(lambda: app.registry.healthy_count() == prefills + 1, timeout=30.0)
    return app, prefill, decode


async def stop_pd(app: RouterApp, engines: list[EmulatedEngine]) -> None:
    await app.stop()
    for engine in engines:
        await engine.stop()


@pytest.mark.parametrize("fault", PREFILL_FAULTS)
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_prefill_engine_that_fails_or_stalls_is_replaced_by_another(
    dialect: str, fault: str, http: aiohttp.ClientSession
) -> None:
    app, prefill, decode = await start_pd(f"swap-{dialect}-{fault}", dialect)
    bad, good = prefill
    try:
        await post(http, f"{bad.url}/admin/faults", PREFILL_FAULTS[fault])
        for i in range(4):
            reply = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"prompt": prompt(f"swap{i}x", LONG), "max_tokens": 2},
            )
            assert reply.status == 200, reply.body
            assert reply.headers["x-kvroute-mode"] == "split"
            assert reply.headers["x-kvroute-prefill"] == endpoint(good)
        assert await engine_metric(http, bad, "kvroute_emulator_faults_injected_total") >= 1
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_retries_total") >= 1
        assert metric_sum(samples, "kvroute_handoffs_total", dialect=dialect, outcome="pulled") == 4
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="prefill_failed") == 0
    finally:
        await stop_pd(app, [*prefill, decode])


@pytest.mark.parametrize("fault", PREFILL_FAULTS)
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_prefill_pool_that_fails_or_stalls_falls_back_to_the_decode_engine(
    dialect: str, fault: str, http: aiohttp.ClientSession
) -> None:
    app, prefill, decode = await start_pd(f"fall-{dialect}-{fault}", dialect)
    try:
        for p in prefill:
            await post(http, f"{p.url}/admin/faults", PREFILL_FAULTS[fault])
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": prompt("fall", LONG), "max_tokens": 2}
        )
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "local:prefill_failed"
        assert reply.headers["x-kvroute-engine"] == endpoint(decode)
        assert reply.body["usage"]["completion_tokens"] == 2
        samples = await metrics(http, app.url)
        assert (
            metric_sum(samples, "kvroute_handoffs_total", dialect=dialect, outcome="prefill_failed")
            == 1
        )
        reason = "status" if fault == "fails" else "timeout"
        assert metric_sum(samples, "kvroute_retries_total", reason=reason) == 2  # both engines
    finally:
        await stop_pd(app, [*prefill, decode])


@pytest.mark.parametrize(("fault", "status"), [("fails", 502), ("stalls", 504)])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_without_fallback_a_failed_prefill_pool_fails_the_request(
    dialect: str, fault: str, status: int, http: aiohttp.ClientSession
) -> None:
    app, prefill, decode = await start_pd(
        f"nofall-{dialect}-{fault}",
        dialect,
        disaggregation={"fallback_to_decode": False},
    )
    try:
        for p in prefill:
            await post(http, f"{p.url}/admin/faults", PREFILL_FAULTS[fault])
        got, body = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompt("nofall", LONG), "max_tokens": 2}
        )
        assert got == status, body
        assert "no prefill engine" in body["error"]["message"]
        assert metric_sum(await metrics(http, decode.url), "vllm:prompt_tokens_total") == 0
    finally:
        await stop_pd(app, [*prefill, decode])


async def test_sglang_a_failed_prefill_leg_cancels_the_decode_leg(
    http: aiohttp.ClientSession,
) -> None:
    app, (prefill,), decode = await start_pd(
        "sgcancel-d",
        "sglang",
        prefills=1,
        disaggregation={"fallback_to_decode": False},
        proxy={"first_byte_timeout_s": 30.0},
    )
    try:
        await post(http, f"{prefill.url}/admin/faults", {"fail_rate": 1.0})
        status, _ = await asyncio.wait_for(
            post(
                http,
                f"{app.url}/v1/completions",
                {"prompt": prompt("sgcanceld", LONG), "max_tokens": 2},
            ),
            timeout=10,  # the decode leg would wait for its room for the bootstrap timeout
        )
        assert status == 502
        await poll(lambda: engine_metric(http, decode, "kvroute_emulator_aborted_requests_total"))
        assert decode.state.drivers[0].model.stats().num_running == 0
        await poll(lambda: app.core.loads.in_flight == 0)
    finally:
        await stop_pd(app, [prefill, decode])


async def test_sglang_a_failed_decode_leg_cancels_the_prefill_leg(
    http: aiohttp.ClientSession,
) -> None:
    app, (prefill,), decode = await start_pd(
        "sgcancel-p", "sglang", prefills=1, proxy={"first_byte_timeout_s": 30.0}
    )
    try:
        await post(http, f"{decode.url}/admin/faults", {"fail_rate": 1.0})
        status, _ = await asyncio.wait_for(
            post(
                http,
                f"{app.url}/v1/completions",
                {"prompt": prompt("sgcancelp", LONG), "max_tokens": 2},
            ),
            timeout=10,  # the prefill leg would wait for a decode engine to join its room
        )
        assert status == 502  # the only decode engine failed: nothing else could serve
        await poll(lambda: engine_metric(http, prefill, "kvroute_emulator_aborted_requests_total"))
        assert prefill.state.drivers[0].model.stats().num_running == 0
        await poll(lambda: app.core.loads.in_flight == 0)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="prefill_failed") == 0
    finally:
        await stop_pd(app, [prefill, decode])


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_prefill_engine_refusing_the_request_passes_its_answer_on(
    dialect: str, http: aiohttp.ClientSession
) -> None:
    app, (prefill,), decode = await start_pd(f"refuse-{dialect}", dialect, prefills=1)
    try:
        # longer than the engines' context (16,384 tokens): the engines' own 400
        too_long = {"prompt": prompt("huge", 17_000), "max_tokens": 2}
        status, body = await asyncio.wait_for(
            post(http, f"{app.url}/v1/completions", too_long), timeout=10
        )
        assert status == 400, body
        assert "maximum context length" in body["error"]["message"]  # the engine's answer
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_retries_total") == 0
        assert metric_sum(samples, "kvroute_handoffs_total") == 0
        await poll(lambda: app.core.loads.in_flight == 0)
    finally:
        await stop_pd(app, [prefill, decode])


# ---------------------------------------------------------------- other handoff paths


async def test_a_prefill_answer_without_params_sends_the_request_to_decode_as_is(
    http: aiohttp.ClientSession,
) -> None:
    prefill = await start_test_engine(engine_id="np-p", role="prefill")
    decode = await start_test_engine(engine_id="np-d", role="decode", handoff_failure="error")
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    )
    try:
        # A prefill leg that stops at its first token (a stop token) returns no params.
        text = prompt("noparams", LONG)
        _, plain = await post(
            http, f"{prefill.url}/v1/completions", {"prompt": text, "max_tokens": 1}
        )
        (first,) = plain["choices"][0]["text"].split()
        _, tokens = await post(http, f"{prefill.url}/tokenize", {"prompt": first})
        await post(http, f"{prefill.url}/reset_prefix_cache", {})
        reply = await post_reply(
            http,
            f"{app.url}/v1/completions",
            {"prompt": text, "max_tokens": 3, "stop_token_ids": tokens["tokens"]},
        )
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "local:prefill_no_params"
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="no_params") == 1
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()


async def test_a_decode_leg_failing_after_its_first_token_ends_with_an_sse_error(
    http: aiohttp.ClientSession,
) -> None:
    prefill = await start_test_engine(engine_id="mid-p", role="prefill")
    decode = await start_test_engine(engine_id="mid-d", role="decode", handoff_failure="error")
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        health={"interval_s": 30.0},
    )
    try:
        await post(http, f"{decode.url}/admin/faults", {"drop_after_tokens": 2})
        body = {"prompt": prompt("middrop", LONG), "max_tokens": 10, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-mode"] == "split"
            text = (await resp.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2]
        assert app.core.loads.in_flight == 0
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()


async def test_a_loopback_side_channel_host_is_warned_about_and_counted(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # The router knows the prefill engine by this machine's name (not a loopback address)
    # while its NIXL side channel listens, and is reported, on 127.0.0.1: the mistake a
    # pod makes without VLLM_NIXL_SIDE_CHANNEL_HOST.
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve")
    prefill = await start_test_engine(
        engine_id="lo-p", role="prefill", host=address, side_channel_host="127.0.0.1"
    )
    decode = await start_test_engine(engine_id="lo-d", role="decode", handoff_failure="error")
    app = await start_router(
        [
            {"url": f"http://{name}:{prefill.port}", "role": "prefill"},
            {"url": decode.url, "role": "decode"},
        ]
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvroute.pd"):
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": prompt("lo", LONG), "max_tokens": 2}
            )
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "split"
        samples = await metrics(http, app.url)
        label = reply.headers["x-kvroute-prefill"]
        assert metric_sum(samples, "kvroute_handoff_loopback_hosts_total", engine=label) == 1
        # only warned: the host is not rewritten, so the pull from 127.0.0.1 still works
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="pulled") == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("127.0.0.1" in w and "VLLM_NIXL_SIDE_CHANNEL_HOST" in w for w in warnings)
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()


async def test_two_models_hand_off_in_their_own_dialects(http: aiohttp.ClientSession) -> None:
    # alpha keeps the global dialect (nixl); beta's pools speak SGLang, and so do the
    # requests for beta's LoRA adapter.
    engines = {
        f"{model}-{role}": await start_test_engine(
            engine_id=f"{model}-{role}",
            model=model,
            role=role,
            handoff_failure="error",
            **({"lora_modules": ("beta-chat",)} if model == "beta" else {}),
        )
        for model in ("alpha", "beta")
        for role in ("prefill", "decode")
    }
    app = await start_router(
        [{"url": e.url, "role": name.split("-")[1]} for name, e in engines.items()],
        models=[{"name": "beta", "handoff": "sglang"}],
    )
    try:
        assert app.config.disaggregation.handoff == "nixl"
        expected = {"nixl": 0, "sglang": 0}
        for model, dialect in (("alpha", "nixl"), ("beta", "sglang"), ("beta-chat", "sglang")):
            reply = await post_reply(
                http,
                f"{app.url}/v1/completions",
                {"model": model, "prompt": prompt(f"{model}x", LONG), "max_tokens": 2},
            )
            assert reply.status == 200, reply.body
            assert reply.headers["x-kvroute-mode"] == "split"
            base = model.split("-")[0]
            assert reply.headers["x-kvroute-prefill"] == endpoint(engines[f"{base}-prefill"])
            assert reply.headers["x-kvroute-engine"] == endpoint(engines[f"{base}-decode"])
            expected[dialect] += 1
            samples = await metrics(http, app.url)
            for name, count in expected.items():
                got = metric_sum(samples, "kvroute_handoffs_total", dialect=name, outcome="pulled")
                assert got == count, (model, name)
        for base in ("alpha", "beta"):
            pulled = await engine_metric(
                http, engines[f"{base}-decode"], "kvroute_emulator_kv_pulled_tokens_total"
            )
            assert pulled >= LONG - 16
    finally:
        await app.stop()
        for engine in engines.values():
            await engine.stop()


async def test_decode_choice_follows_engine_reported_load_the_router_does_not_see(
    http: aiohttp.ClientSession,
) -> None:
    # busy runs in real time and is kept busy by requests sent to it directly (another
    # router's traffic): this router has nothing in flight on either decode engine.
    prefill = await start_test_engine(engine_id="rl-p", role="prefill")
    busy = await start_test_engine(engine_id="rl-busy", role="decode", time_scale=1.0)
    idle = await start_test_engine(engine_id="rl-idle", role="decode")
    app = await start_router(
        [
            {"url": prefill.url, "role": "prefill"},
            {"url": busy.url, "role": "decode"},
            {"url": idle.url, "role": "decode"},
        ]
    )

    async def foreign(i: int) -> None:
        body = {"prompt": prompt(f"foreign{i}x", 300), "max_tokens": 5000, "stream": True}
        async with http.post(f"{busy.url}/v1/completions", json=body) as resp:
            await resp.read()

    background = [asyncio.ensure_future(foreign(i)) for i in range(4)]
    try:
        key = app.registry.get(endpoint(busy)).keys[0]
        await poll(lambda: (app.core.loads.view.get(key) or EngineLoad()).running == 4)
        for i in range(6):
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": f"short {i}", "max_tokens": 2}
            )
            assert reply.status == 200, reply.body
            assert reply.headers["x-kvroute-mode"] == "local:short_uncached"
            assert reply.headers["x-kvroute-engine"] == endpoint(idle), i
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await app.stop()
        for engine in (prefill, busy, idle):
            await engine.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_cached_tokens_are_what_the_prefill_cache_saved_in_both_dialects(
    dialect: str, stream: bool, http: aiohttp.ClientSession
) -> None:
    app, prefill, decode = await start_pd(
        f"ct-{dialect}-{int(stream)}",
        dialect,
        prefills=1,
        proxy={"first_byte_timeout_s": 30.0},  # no stall here: a busy machine is no fault
    )
    try:
        shared = prompt("same", LONG)
        cached = []
        for q in range(2):
            body: dict[str, Any] = {"prompt": f"{shared} q{q}", "max_tokens": 3}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            async with http.post(f"{app.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                mode = resp.headers["x-kvroute-mode"]
                text = (await resp.read()).decode()
            if stream:
                events = [e for e in text.split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                text = events[-2][len("data: ") :]
            usage = json.loads(text)["usage"]
            if q == 0:
                assert mode == "split"
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        # a fresh prompt saved nothing; the second found the shared prefix cached
        assert cached == [0, LONG]
    finally:
        await stop_pd(app, [*prefill, decode])


async def test_a_clients_bogus_bootstrap_room_does_not_eject_the_decode_engine(
    http: aiohttp.ClientSession,
) -> None:
    app, prefill, decode = await start_pd("room", "sglang", prefills=1)
    try:
        body = {"prompt": "short", "max_tokens": 2, "bootstrap_room": 99, "bootstrap_port": 1}
        for _ in range(4):  # more than health.eject_after_failures
            reply = await post_reply(http, f"{app.url}/v1/completions", body)
            assert reply.status == 200, reply.body
        assert app.registry.get(endpoint(decode)).state.value == "healthy"
    finally:
        await stop_pd(app, [*prefill, decode])


async def test_a_side_channel_outside_the_allowed_networks_is_never_handed_to_decode(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # The prefill engine (127.0.0.1, allowed) names a side channel on 127.0.0.2, outside
    # auth.engine_cidrs: the decode engine must not be sent to dial there.
    prefill = await start_test_engine(
        engine_id="sc-p", role="prefill", side_channel_host="127.0.0.2"
    )
    decode = await start_test_engine(engine_id="sc-d", role="decode", handoff_failure="error")
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        auth={"engine_cidrs": ["127.0.0.1/32"]},
    )
    try:
        pulled = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": prompt("sc", LONG), "max_tokens": 2}
        )
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "local:side_channel_refused"
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="side_channel_refused") == 1
        after = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        assert after == pulled
        assert "127.0.0.2" in caplog.text and "engine_cidrs" in caplog.text
    finally:
        await app.stop()
        await prefill.stop()
        await decode.stop()

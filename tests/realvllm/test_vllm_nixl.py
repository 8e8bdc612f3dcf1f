"""Prefill/decode disaggregation between two real vLLM processes over NIXL (UCX over TCP on
loopback): the split moves KV, short prompts stay local, failures fall back as
docs/disaggregation.md says. Engine ``a`` prefills, ``b`` decodes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.clients import metric_sum, metrics, post_reply
from support.engines import poll
from support.listeners import DialCounter
from support.real_vllm import START_TIMEOUT_S, TIER_TEST_TIMEOUT_S, VllmEngine
from support.vllm_prompts import (
    MODEL,
    above,
    cached_tokens,
    completion,
    engine_metric,
    start_vllm_router,
    text,
    zero,
)

from router.app import RouterApp
from router.types import EngineKey


async def pd_router(a: VllmEngine, b: VllmEngine, **sections: object) -> RouterApp:
    return await start_vllm_router(
        [{"url": a.url, "role": "prefill"}, {"url": b.url, "role": "decode"}],
        disaggregation={"handoff": "nixl"},
        **sections,
    )


async def transfers(http: aiohttp.ClientSession, decode: VllmEngine) -> float:
    return await engine_metric(http, decode.url, "vllm:nixl_xfer_time_seconds_count")


async def running(http: aiohttp.ClientSession, engine: VllmEngine) -> float:
    return await engine_metric(http, engine.url, "vllm:num_requests_running")


async def test_a_long_prompt_is_split_and_its_kv_pulled_by_the_decode_engine(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, b = vllm_pair
    app = await pd_router(a, b)
    try:
        before = await transfers(http, b)
        body = completion(text(300, "split-me"), 4)
        reply = await post_reply(http, f"{app.url}/v1/completions", body)
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "split"
        assert reply.headers["x-kvroute-prefill"] == f"127.0.0.1:{a.port}"
        assert reply.headers["x-kvroute-engine"] == f"127.0.0.1:{b.port}"
        assert reply.body["usage"]["completion_tokens"] == 4
        await poll(lambda: above(transfers(http, b), before), timeout=30, interval=0.1)
        samples = await metrics(http, app.url)
        # vLLM 0.32 echoes the prefill's cache hits as the decode leg's cached_tokens
        # (remote_prefill_cached_tokens), so usage cannot tell a pull from a recompute.
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="recomputed") == 0
        assert metric_sum(samples, "kvroute_handoffs_total", outcome="unverified") >= 1
    finally:
        await app.stop()


async def test_a_short_prompt_is_served_by_the_decode_engine_alone(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, b = vllm_pair
    app = await pd_router(a, b)
    try:
        reply = await post_reply(http, f"{app.url}/v1/completions", completion(text(20, "short")))
        assert reply.status == 200
        assert reply.headers["x-kvroute-mode"].startswith("local:")
        assert reply.headers["x-kvroute-engine"] == f"127.0.0.1:{b.port}"
    finally:
        await app.stop()


async def test_a_prompt_repeated_after_a_split_is_served_from_the_kv_decode_pulled(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    """The decode engine caches what it pulled (and says so in its KV events), so a
    follow-up turn stays on it: no second transfer."""
    a, b = vllm_pair
    app = await pd_router(a, b)
    try:
        prompt = text(300, "split-then-follow-up")
        first = await post_reply(http, f"{app.url}/v1/completions", completion(prompt))
        assert first.headers["x-kvroute-mode"] == "split"
        follow_up = completion(prompt + " and one more question", 2)

        async def stays_on_decode() -> bool:
            reply = await post_reply(http, f"{app.url}/v1/completions", follow_up)
            return reply.headers["x-kvroute-mode"] == "local:decode_holds_prefix" and (
                cached_tokens(reply.body) >= 32 * 10
            )

        # The pulled blocks reach the router as the decode engine's BlockStored events.
        await poll(stays_on_decode, timeout=20, interval=0.5)
    finally:
        await app.stop()


async def test_a_clients_kv_transfer_params_in_extra_args_never_make_the_engine_dial(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    """vLLM's engine reads ``SamplingParams.extra_args["kv_transfer_params"]``
    (vllm/v1/request.py), and ``/inference/v1/generate`` takes ``sampling_params.
    extra_args`` from the client as it is. Through the router the field is removed: the
    engine answers and never dials the side channel it names (a listener on loopback).
    Sent to the engine directly, the same body makes it dial there."""
    _, b = vllm_pair
    counter = DialCounter()
    port = await counter.start()
    app = await start_vllm_router([b.url])
    pull = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "a-client-chose-it",
        "remote_block_ids": [[1]],
        "remote_host": "127.0.0.2",
        "remote_port": port,
        "remote_request_id": "r",
        "tp_size": 1,
    }
    body = {
        "model": MODEL,
        "token_ids": [5, 6, 7, 8, 9, 10],
        "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": pull}},
    }
    try:
        reply = await post_reply(http, f"{app.url}/inference/v1/generate", body)
        assert counter.dials == 0  # a pull runs before the request: none was started
        assert reply.status == 200, reply.body
        assert len(reply.body["choices"][0]["token_ids"]) == 2
        samples = await metrics(http, app.url)
        field = "sampling_params.extra_args.kv_transfer_params"
        assert metric_sum(samples, "kvroute_client_handoff_fields_removed_total", field=field) == 1
        # What the router prevented (vLLM answers 500 once the pull fails, after ~5 s).
        await post_reply(http, f"{b.url}/inference/v1/generate", body)
        await poll(lambda: counter.dials > 0, timeout=30)
    finally:
        await app.stop()
        await counter.stop()


async def test_a_client_leaving_during_a_split_leaves_nothing_running(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, b = vllm_pair
    app = await pd_router(a, b)
    try:
        # 200 tokens take the decode engine well over a second: leaving at 0.3 s is
        # leaving during the prefill leg or the decode leg, never after the answer.
        body = completion(text(400, "left-during-the-split"), 200, ignore_eos=True)
        request = asyncio.ensure_future(post_reply(http, f"{app.url}/v1/completions", body))
        await asyncio.sleep(0.3)
        assert not request.done()
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await poll(lambda: app.loads.in_flight == 0, timeout=15)
        # Every 0.1 s: asking vLLM's /metrics back to back takes CPU from the aborts.
        await poll(lambda: zero(running(http, a)), timeout=30, interval=0.1)
        await poll(lambda: zero(running(http, b)), timeout=30, interval=0.1)
    finally:
        await app.stop()


# It restarts an engine, after what any tier test may spend.
@pytest.mark.timeout(TIER_TEST_TIMEOUT_S + START_TIMEOUT_S)
async def test_a_dead_prefill_engine_falls_back_to_the_decode_engine_and_its_restart_is_seen(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    """The prefill engine is SIGKILLed before the router's probes notice (they run every
    30 s here): the split's prefill leg fails to connect, and the decode engine serves the
    request alone (``fallback_to_decode``). Once the engine is back on its port, the
    router's event stream finds it restarted."""
    a, b = vllm_pair
    if a.proc is None:
        pytest.skip("REAL_VLLM_ATTACH: the attached engines are not this session's to kill")
    # The tokenizer from the model's files: with engine tokenization, the dead engine's
    # turn at /tokenize would make the router estimate the prompt's length instead.
    tokenizer = {
        "mode": "hf",
        "path": str(a.model_dir / "tokenizer.json"),
        "config_path": str(a.model_dir / "tokenizer_config.json"),
    }
    app = await pd_router(
        a,
        b,
        health={"interval_s": 30.0},
        tokenizer=tokenizer,
    )
    try:
        assert app.subscriber is not None
        # A restart shows only against batches the router applied before it.
        await post_reply(http, f"{a.url}/v1/completions", completion(text(60, "before-kill")))
        stream = app.subscriber._streams[EngineKey(f"127.0.0.1:{a.port}")]
        await poll(lambda: stream.state.last_seq is not None, timeout=30)
        a.kill()
        body = completion(text(300, "prefill-is-gone"), 4)
        reply = await post_reply(http, f"{app.url}/v1/completions", body)
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-mode"] == "local:prefill_failed"
        assert reply.headers["x-kvroute-engine"] == f"127.0.0.1:{b.port}"
        restarts = app.subscriber.stats.restarts

        def restart_a() -> None:
            # b, whose NIXL peer just died, keeps a core busy: paused while a starts
            # (on two cores it starved a's restart past its deadline in 3 of 6 runs).
            with b.paused():
                a.restart()

        await asyncio.get_running_loop().run_in_executor(None, restart_a)
        await post_reply(http, f"{a.url}/v1/completions", completion(text(60, "reborn")))
        await poll(lambda: app.subscriber.stats.restarts > restarts, timeout=60)
        assert app.subscriber.stats.garbage == 0
    finally:
        await app.stop()  # an engine left down is restarted before the next test

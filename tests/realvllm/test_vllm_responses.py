"""The OpenAI Responses API through kvroute to real vLLM: the router's prompt count is
the engine's (vLLM's Responses renderer adds the tokenizer's special tokens to the
rendered chat: a second BOS with this Llama template), a multi-turn conversation stays
on one engine and hits its cache, and a stored response is found through either of two
replicas sharing Redis, or by a replica told nothing, which asks the engines.

vLLM 0.32 stores responses only when started with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
(without it ``store`` is dropped silently, ``previous_response_id`` and ``GET`` answer
404): the tier's own pair sets it (tests/support/real_vllm.py); the tests that need it
are skipped, with that reason, on an attached pair started without it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import get, metric_sum, metrics, post_reply
from support.real_vllm import VllmEngine
from support.vllm_prompts import MODEL, start_vllm_router, text

from router.app import RouterApp

AFFINITY = "kvroute_responses_affinity_total"


def request(input: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": input, "max_output_tokens": 2, **fields}


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["input_tokens_details"]["cached_tokens"])


async def create(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, Any]:
    reply = await post_reply(http, f"{url}/v1/responses", body)
    assert reply.status == 200, reply.body
    return reply.headers["x-kvroute-engine"], reply.body


@pytest_asyncio.fixture
async def storing(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> tuple[VllmEngine, VllmEngine]:
    """The pair, if it stores responses (else the test is skipped, saying why)."""
    a = vllm_pair[0]
    reply = await post_reply(http, f"{a.url}/v1/responses", request(text(5, "store-probe")))
    assert reply.status == 200, reply.body
    status, _ = await get(http, f"{a.url}/v1/responses/{reply.body['id']}")
    if status == 404:
        pytest.skip(
            "the engines run without VLLM_ENABLE_RESPONSES_API_STORE=1: vLLM ignores "
            "`store` then (restart the attached pair with it; the tier's own pair sets it)"
        )
    return vllm_pair


@pytest_asyncio.fixture
async def router(vllm_pair: tuple[VllmEngine, VllmEngine]) -> AsyncIterator[RouterApp]:
    app = await start_vllm_router([e.url for e in vllm_pair])
    yield app
    await app.stop()


@pytest.mark.parametrize("mode", ["hf", "engine"])
async def test_the_routers_count_of_a_response_prompt_is_the_engines(
    mode: str,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    vllm_model: Path,
    http: aiohttp.ClientSession,
) -> None:
    tokenizer: dict[str, object] = {"mode": mode}
    if mode == "hf":
        tokenizer |= {
            "path": str(vllm_model / "tokenizer.json"),
            "config_path": str(vllm_model / "tokenizer_config.json"),
        }
    app = await start_vllm_router([vllm_pair[0].url], tokenizer=tokenizer)
    try:
        items = [
            {"role": "user", "content": [{"type": "input_text", "text": text(30, f"q-{mode}")}]},
            {
                "type": "message",  # vLLM reads an assistant item as an output message
                "role": "assistant",
                "content": [{"type": "output_text", "text": "an answer"}],
            },
            {"role": "user", "content": text(20, f"again-{mode}")},
        ]
        for body in (
            request(text(40, f"plain-{mode}")),
            request(items, instructions="you are a helpful assistant"),
        ):
            await create(http, app.url, body)
        assert app.tokenizers.mismatches() == {MODEL: 0}
    finally:
        await app.stop()


async def test_a_conversation_resent_whole_stays_on_one_engine_and_hits_its_cache(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    """Without stored state: the client sends the whole conversation each turn, and
    cache-aware routing keeps it where its prefix is cached."""
    items: list[dict[str, Any]] = [{"role": "user", "content": text(80, "resent")}]
    engines, hits = [], []
    for turn in range(3):
        engine, body = await create(
            http, router.url, request(items, instructions="answer briefly", temperature=0)
        )
        engines.append(engine)
        hits.append(cached(body))
        items += [*body["output"], {"role": "user", "content": text(10, f"resent-{turn}")}]
    assert len(set(engines)) == 1, engines
    assert hits[0] == 0 and all(h >= 64 for h in hits[1:]), hits


async def test_previous_response_id_keeps_a_conversation_on_one_engine_and_its_cache(
    storing: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    # Round robin would alternate between the engines: only the pin keeps the turns on one.
    app = await start_vllm_router([e.url for e in storing], policy={"name": "round_robin"})
    try:
        engine, body = await create(http, app.url, request(text(80, "pinned")))
        engines, hits = [engine], []
        for turn in range(3):
            engine, body = await create(
                http,
                app.url,
                request(text(8, f"pinned-{turn}"), previous_response_id=body["id"]),
            )
            engines.append(engine)
            hits.append(cached(body))
        assert len(set(engines)) == 1, engines
        # Each turn's prompt is the stored conversation plus the new input: cached there.
        assert all(h >= 64 for h in hits) and hits == sorted(hits), hits
        assert metric_sum(await metrics(http, app.url), AFFINITY, outcome="pinned") == 3
    finally:
        await app.stop()


async def test_get_reaches_the_engine_holding_a_response_through_two_replicas(
    storing: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    redis_url: str,
    redis_namespace: str,
) -> None:
    index = {
        "backend": "redis",
        "redis": {"url": redis_url, "namespace": redis_namespace, "budget_ms": 200},
    }
    urls = [e.url for e in storing]
    first = await start_vllm_router(urls, index=index)
    second = await start_vllm_router(urls, index=index, policy={"name": "round_robin"})
    try:
        holder, body = await create(http, first.url, request(text(40, "replicas")))
        for _ in range(2):  # round robin would send one of these to the other engine
            async with http.get(f"{second.url}/v1/responses/{body['id']}") as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-engine"] == holder
                stored = await resp.json()
            assert stored["id"] == body["id"] and stored["output"] == body["output"]
        engine, _ = await create(
            http, second.url, request("and then", previous_response_id=body["id"])
        )
        assert engine == holder
    finally:
        await first.stop()
        await second.stop()


async def test_a_replica_told_nothing_finds_the_holder_by_asking_the_engines(
    storing: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    # vLLM answers 200 for an id it holds and 404 for one it does not: the router's
    # question. Two replicas sharing nothing stand for a write to Redis that was lost.
    urls = [e.url for e in storing]
    rr = {"name": "round_robin"}
    first = await start_vllm_router(urls, policy=rr)
    second = await start_vllm_router(urls, policy=rr)
    try:
        holder, body = await create(http, first.url, request(text(30, "asked")))
        for _ in range(2):  # round robin alone would send one of these elsewhere
            async with http.get(f"{second.url}/v1/responses/{body['id']}") as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-engine"] == holder
        engine, _ = await create(
            http, second.url, request("go on", previous_response_id=body["id"])
        )
        assert engine == holder
        samples = await metrics(http, second.url)
        assert metric_sum(samples, "kvroute_responses_engine_queries_total", result="found") == 1
    finally:
        await first.stop()
        await second.stop()

"""Requests through kvroute to real vLLM: tokenizer modes against the engine's own counts,
block-size adoption and refusal, streaming usage, client disconnects, scraped load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from support.clients import post, stream_reply
from support.engines import poll
from support.real_vllm import VllmEngine
from support.vllm_prompts import MODEL, completion, engine_metric, start_vllm_router, text, zero

from router.fleet.registry import EngineState
from router.tokenization.modes import HFTokenizer
from router.types import EngineKey


def chat(content: str, max_tokens: int = 2, **fields: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": content},
        ],
        "max_tokens": max_tokens,
        **fields,
    }


async def running(http: aiohttp.ClientSession, engine: VllmEngine) -> float:
    return await engine_metric(http, engine.url, "vllm:num_requests_running")


@pytest.mark.parametrize("mode", ["hf", "engine", "auto"])
async def test_every_tokenizer_mode_counts_exactly_the_engines_prompt_tokens(
    mode: str,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    vllm_model: Path,
    http: aiohttp.ClientSession,
) -> None:
    a, _ = vllm_pair
    tokenizer: dict[str, object] = {"mode": mode}
    if mode == "hf":
        tokenizer |= {
            "path": str(vllm_model / "tokenizer.json"),
            "config_path": str(vllm_model / "tokenizer_config.json"),
        }
    app = await start_vllm_router([a.url], tokenizer=tokenizer)
    try:
        for i in range(3):
            prompt = text(50 + 40 * i, f"tok-{mode}-{i}")
            status, body = await post(http, f"{app.url}/v1/completions", completion(prompt))
            assert status == 200, body
            status, body = await post(http, f"{app.url}/v1/chat/completions", chat(prompt))
            assert status == 200, body
        assert app.tokenizers.mismatches() == {MODEL: 0}
        # auto finds the model's files in the directory vLLM reports as its root.
        assert app.tokenizers.modes() == {MODEL: "hf" if mode == "auto" else mode}
    finally:
        await app.stop()


async def test_a_configured_block_size_that_differs_from_the_engines_refuses_them(
    vllm_pair: tuple[VllmEngine, VllmEngine],
) -> None:
    a, _ = vllm_pair
    app = await start_vllm_router([a.url], block_size=16)
    try:
        (engine,) = list(app.registry)
        # Discovery reads the block size; if a busy engine's /metrics was too slow for it,
        # a later scrape does.
        await poll(lambda: engine.state is EngineState.REFUSED, timeout=30, interval=0.1)
        assert "uses KV block size 32" in (engine.refused_reason or "")
        assert "uses 16" in (engine.refused_reason or "")
    finally:
        await app.stop()


async def test_an_unset_block_size_adopts_the_engines(
    vllm_pair: tuple[VllmEngine, VllmEngine],
) -> None:
    app = await start_vllm_router([e.url for e in vllm_pair])
    try:
        await poll(lambda: app.block_size_for(MODEL) == 32, timeout=30, interval=0.1)
        assert all(e.state is EngineState.HEALTHY for e in app.registry)
    finally:
        await app.stop()


async def test_a_stream_with_include_usage_ends_with_the_usage_chunk(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_vllm_router([vllm_pair[0].url])
    try:
        body = chat(
            text(60, "streamed"),
            8,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,  # random weights: EOS may come first
        )
        reply = await stream_reply(http, f"{app.url}/v1/chat/completions", body)
        *chunks, usage_chunk, done = reply.body
        assert done == "[DONE]"
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
        assert usage_chunk["usage"]["prompt_tokens"] > 60
        assert any(c["choices"] and c["choices"][0]["delta"] for c in chunks)
    finally:
        await app.stop()


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "non-streaming"])
async def test_a_client_that_leaves_makes_vllm_abort_the_request(
    streaming: bool, vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    _, b = vllm_pair
    app = await start_vllm_router([b.url])
    try:
        # Thousands of tokens: generation lasts far longer than it takes to see it
        # running, however slowly a loaded machine serves vLLM's /metrics, and a request
        # that is not aborted could not end on its own before the test looks.
        body = completion(
            text(30, f"abandoned-{streaming}"), 3000, ignore_eos=True, stream=streaming
        )

        async def leave() -> None:
            async with http.post(f"{app.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                if streaming:
                    await resp.content.readline()  # the first event: generation is under way
                await asyncio.sleep(3600)  # hang until cancelled

        task = asyncio.ensure_future(leave())

        async def started() -> bool:
            # A request that failed (the router's or the engine's error) or ended before
            # it was seen running fails here with its own reason, not as a 30 s timeout.
            if task.done():
                raise AssertionError(f"the request ended before it was seen running: {task!r}")
            return await running(http, b) > 0

        # Polled every 0.1 s: each /metrics costs vLLM's API server real CPU, and polling
        # it flat out starved the generation it was waiting to see on two busy cores.
        await poll(started, timeout=30, interval=0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await poll(lambda: zero(running(http, b)), timeout=30, interval=0.1)
        await poll(lambda: app.loads.in_flight == 0, timeout=10)
    finally:
        await app.stop()


async def test_load_signals_come_from_vllms_own_metrics(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, _ = vllm_pair
    # Scrapes often, and patiently: a busy vLLM can take over the default second to
    # answer /metrics, and a skipped scrape must not outlast the request.
    app = await start_vllm_router([a.url], scrape={"interval_s": 0.2, "timeout_s": 5.0})
    try:
        # Long enough to be running at several scrapes (300 tokens can be over in one
        # second's scrape interval); it is cancelled as soon as it has been seen.
        body = completion(text(30, "long-running"), 3000, ignore_eos=True)
        task = asyncio.ensure_future(post(http, f"{app.url}/v1/completions", body))
        loads = app.loads.view
        engine = EngineKey(f"127.0.0.1:{a.port}")

        def seen() -> bool:
            load = loads.get(engine)
            return load is not None and (load.running or 0) >= 1 and (load.kv_usage or 0) > 0

        await poll(seen, timeout=60)
        assert loads[engine].waiting is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await app.stop()
    await poll(lambda: zero(running(http, a)), timeout=30, interval=0.1)


async def test_vllm_tokenize_and_the_routers_hf_tokenizer_agree_on_a_chat(
    vllm_pair: tuple[VllmEngine, VllmEngine], vllm_model: Path, http: aiohttp.ClientSession
) -> None:
    """The chat template in tokenizer_config.json renders as vLLM renders it."""
    a, _ = vllm_pair
    messages = chat(text(20, "template"))["messages"]
    status, body = await post(http, f"{a.url}/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    tok = HFTokenizer(str(vllm_model / "tokenizer.json"), str(vllm_model / "tokenizer_config.json"))
    assert await tok.chat(json.loads(json.dumps(messages))) == body["tokens"]

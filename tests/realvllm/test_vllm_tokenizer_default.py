"""``kvroute serve --engine URL`` with no tokenizer settings in front of real vLLM: the
default (``tokenizer.mode: auto``) finds the model's own tokenizer in the directory vLLM
reports as its ``root`` and tokenizes with it, exactly and without asking the engine's
``/tokenize`` per request (counted by vLLM's own ``http_requests_total``)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from support.clients import metric_sum, metrics, post
from support.engines import poll
from support.real_vllm import VllmEngine
from support.vllm_prompts import MODEL, completion, text

from router.process import ServerProcess


async def tokenize_calls(http: aiohttp.ClientSession, engine: VllmEngine) -> float:
    """The ``/tokenize`` requests vLLM has answered (its HTTP instrumentation)."""
    return metric_sum(await metrics(http, engine.url), "http_requests_total", handler="/tokenize")


async def tokenizers(http: aiohttp.ClientSession, router_url: str) -> list[dict[str, Any]]:
    async with http.get(f"{router_url}/admin/engines") as resp:
        return (await resp.json()).get("tokenizers", [])


async def test_serve_with_only_an_engine_url_tokenizes_with_the_models_files_from_its_root(
    vllm_pair: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, _ = vllm_pair
    before = await tokenize_calls(http, a)
    # Only the timeouts are a busy machine's (test_vllm_kv_events.py says why).
    for name in ("HEALTH__TIMEOUT_S", "EVENTS__REPLAY_TIMEOUT_S", "SCRAPE__TIMEOUT_S"):
        monkeypatch.setenv(f"KVROUTE_{name}", "5")
    router = ServerProcess("serve", ["--port", "0", "--engine", a.url], timeout=120)
    try:

        async def settled() -> list[dict[str, Any]]:
            pools = await tokenizers(http, router.url)
            return pools if pools and pools[0]["source"] != "pending" else []

        (pool,) = await poll(settled, timeout=60, interval=0.2)
        assert pool["model"] == MODEL
        assert pool["description"] == f"hf: {a.model_dir / 'tokenizer.json'} (engine root)"
        # Settling asked vLLM's /tokenize twice (a prompt and a chat probe) ...
        probed = await tokenize_calls(http, a)
        assert probed == before + 2
        for i in range(3):
            prompt = text(60 + 30 * i, f"default-tokenizer-{i}")
            status, body = await post(http, f"{router.url}/v1/completions", completion(prompt))
            assert status == 200, body
            chat = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": prompt},
                ],
                "max_tokens": 2,
            }
            status, body = await post(http, f"{router.url}/v1/chat/completions", chat)
            assert status == 200, body
        # ... and requests never do; the router's counts are vLLM's own.
        assert await tokenize_calls(http, a) == probed
        samples = await metrics(http, router.url)
        assert metric_sum(samples, "kvroute_tokenizer_mismatches_total") == 0
        assert metric_sum(samples, "kvroute_tokenizer_mode", model=MODEL, mode="hf") == 1
    finally:
        router.stop()

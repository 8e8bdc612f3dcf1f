"""The Anthropic Messages API through kvroute to real vLLM: the router counts the prompt
tokens the engine prefills (system blocks, content blocks, an inline system message the
tiny model's template makes vLLM merge), streaming and not; count_tokens passes through;
what the router refuses is in Anthropic's error form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.real_vllm import VllmEngine
from support.vllm_prompts import MODEL, start_vllm_router, text

from router.app import RouterApp


def request(tag: str, **fields: Any) -> dict[str, Any]:
    """A conversation with a system block list, a block-content user turn, an answer,
    an inline system reminder (merged into the leading system prompt by vLLM for this
    template) and a string user turn."""
    return {
        "model": MODEL,
        "max_tokens": 2,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": text(40, f"{tag}-system")},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": text(30, f"{tag}-q1")}]},
            {"role": "assistant", "content": [{"type": "text", "text": "an earlier answer"}]},
            {"role": "system", "content": "a reminder in the middle"},
            {"role": "user", "content": text(20, f"{tag}-q2")},
        ],
        **fields,
    }


def engine_prompt(usage: dict[str, Any]) -> int:
    """The engine's prompt tokens: Anthropic's input tokens leave out the cached ones."""
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(usage.get(k) or 0 for k in keys)


def router_counts(app: RouterApp, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(router's prompt tokens, engine's) of every answer the tokenizer guard checks."""
    seen: list[tuple[int, int]] = []
    observe = app.tokenizers.observe

    def spy(model: str, ours: int, theirs: int, **kw: bool) -> bool:
        seen.append((ours, theirs))
        return observe(model, ours, theirs, **kw)

    monkeypatch.setattr(app.tokenizers, "observe", spy)
    return seen


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n", 1)
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("mode", ["hf", "engine"])
async def test_messages_streaming_and_not_count_what_the_engine_prefills(
    mode: str,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    vllm_model: Path,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, _ = vllm_pair
    tokenizer: dict[str, object] = {"mode": mode}
    if mode == "hf":
        tokenizer |= {
            "path": str(vllm_model / "tokenizer.json"),
            "config_path": str(vllm_model / "tokenizer_config.json"),
        }
    app = await start_vllm_router([a.url], tokenizer=tokenizer)
    seen = router_counts(app, monkeypatch)
    try:
        body = request(f"msgs-{mode}")
        async with http.post(f"{app.url}/v1/messages", json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        assert answer["type"] == "message" and answer["stop_reason"] == "max_tokens"
        async with http.post(f"{app.url}/v1/messages", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            streamed = sse_events(await resp.read())
        names = [name for name, _ in streamed]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        prompt = engine_prompt(answer["usage"])
        assert engine_prompt(streamed[0][1]["message"]["usage"]) == prompt
        assert engine_prompt(streamed[-2][1]["usage"]) == prompt
        # Both answers were checked against the router's own count, and agreed.
        assert seen == [(prompt, prompt), (prompt, prompt)]
        assert app.tokenizers.mismatches() == {MODEL: 0}
    finally:
        await app.stop()


async def test_count_tokens_passes_through_to_an_engine(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, b = vllm_pair
    app = await start_vllm_router([a.url, b.url])
    try:
        body = request("msgs-count")
        del body["max_tokens"]
        async with http.post(f"{a.url}/v1/messages/count_tokens", json=body) as resp:
            direct = await resp.json()
        async with http.post(f"{app.url}/v1/messages/count_tokens", json=body) as resp:
            assert resp.status == 200
            routed = await resp.json()
            assert resp.headers["x-kvroute-engine"] in {f"127.0.0.1:{e.port}" for e in (a, b)}
        assert routed == direct and routed["input_tokens"] > 100
    finally:
        await app.stop()


async def test_a_refusal_is_anthropic_shaped_and_an_engines_passes_through(
    vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    a, _ = vllm_pair
    app = await start_vllm_router([a.url])
    try:
        no_max = request("msgs-refused")
        del no_max["max_tokens"]
        async with http.post(f"{app.url}/v1/messages", json=no_max) as resp:
            assert resp.status == 400
            refused = await resp.json()
        assert refused["type"] == "error"
        assert refused["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in refused["error"]["message"]
        # Past the engine's context: vLLM's own Anthropic-shaped 400, as it sent it.
        too_long = request("msgs-too-long", max_tokens=5000)
        async with http.post(f"{a.url}/v1/messages", json=too_long) as resp:
            direct = (resp.status, await resp.read())
        async with http.post(f"{app.url}/v1/messages", json=too_long) as resp:
            routed = (resp.status, await resp.read())
        assert routed == direct and direct[0] == 400
        assert json.loads(direct[1])["type"] == "error"
    finally:
        await app.stop()

"""vLLM's other routes through kvroute: tokenize and detokenize pass through with the
engine's answer unchanged; the routes the CPU build does not serve for a generation
model (embeddings, pooling: the tiny Llama is no pooling model, so vLLM answers 404
``{"detail": "Not Found"}``) pass the engine's own refusal through unchanged, status
included; what the router refuses itself is its own OpenAI error. (The tier's engines
run with ``--enable-scale-out``: ``/inference/v1/generate`` through the router is in
test_vllm_nixl.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from support.clients import Reply, post_reply
from support.engines import poll
from support.real_vllm import VllmEngine
from support.vllm_prompts import MODEL, start_vllm_router, text

from router.app import RouterApp


@pytest.fixture
async def router(vllm_pair: tuple[VllmEngine, VllmEngine]) -> AsyncIterator[RouterApp]:
    app = await start_vllm_router([e.url for e in vllm_pair])
    await poll(lambda: app.registry.healthy_count() == 2 and app.registry.models(), timeout=60)
    yield app
    await app.stop()


def _endpoints(pair: tuple[VllmEngine, VllmEngine]) -> set[str]:
    return {f"127.0.0.1:{e.port}" for e in pair}


async def _both(
    http: aiohttp.ClientSession, app: RouterApp, engine: VllmEngine, path: str, body: Any
) -> tuple[Reply, Reply]:
    """The same request through the router and straight to ``engine``."""
    routed = await post_reply(http, f"{app.url}{path}", body)
    direct = await post_reply(http, f"{engine.url}{path}", body)
    return routed, direct


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/tokenize", {"prompt": text(30, "routes-tokenize")}),
        ("/tokenize", {"messages": [{"role": "user", "content": text(12, "routes-chat")}]}),
        ("/detokenize", {"tokens": [1, 263, 330, 84, 226, 92]}),
    ],
)
async def test_tokenize_and_detokenize_pass_through_unchanged(
    router: RouterApp,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    path: str,
    fields: dict[str, Any],
) -> None:
    routed, direct = await _both(http, router, vllm_pair[0], path, {"model": MODEL, **fields})
    assert routed.status == direct.status == 200, routed.body
    assert routed.body == direct.body  # the same tokenizer on both engines
    assert routed.headers["x-kvroute-engine"] in _endpoints(vllm_pair)


async def test_tokenize_requests_spread_over_both_engines(
    router: RouterApp, vllm_pair: tuple[VllmEngine, VllmEngine], http: aiohttp.ClientSession
) -> None:
    seen: set[str] = set()
    for i in range(16):
        body = {"model": MODEL, "prompt": text(8, f"routes-spread-{i}")}
        reply = await post_reply(http, f"{router.url}/tokenize", body)
        assert reply.status == 200
        seen.add(reply.headers["x-kvroute-engine"])
    assert seen == _endpoints(vllm_pair)


@pytest.mark.parametrize(
    ("path", "fields", "status"),
    [
        ("/v1/embeddings", {"input": "routes embeddings"}, 404),
        ("/pooling", {"input": "routes pooling"}, 404),
        ("/score", {"queries": "a", "documents": ["b"]}, 404),
    ],
)
async def test_an_engine_refusal_of_a_route_it_does_not_serve_passes_through_unchanged(
    router: RouterApp,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    path: str,
    fields: dict[str, Any],
    status: int,
) -> None:
    routed, direct = await _both(http, router, vllm_pair[1], path, {"model": MODEL, **fields})
    assert routed.status == direct.status == status
    assert routed.body == direct.body, routed.body
    assert routed.headers["x-kvroute-engine"] in _endpoints(vllm_pair)


async def test_an_unknown_model_is_refused_by_the_router_before_any_engine(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    reply = await post_reply(http, f"{router.url}/tokenize", {"model": "nope", "prompt": "x"})
    assert reply.status == 404
    assert reply.body["error"]["code"] == "model_not_found"
    assert "x-kvroute-engine" not in reply.headers


@pytest.mark.parametrize(
    ("fields", "status"),
    [({"max_tokens": 0}, 400), ({"max_tokens": 0, "echo": True}, 200)],
    ids=["max_tokens 0", "echo with max_tokens 0"],
)
async def test_the_router_refuses_the_max_tokens_vllm_refuses_and_no_other(
    router: RouterApp,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    http: aiohttp.ClientSession,
    fields: dict[str, Any],
    status: int,
) -> None:
    body = {"model": MODEL, "prompt": text(6, "routes-least-output"), **fields}
    routed, direct = await _both(http, router, vllm_pair[1], "/v1/completions", body)
    assert routed.status == direct.status == status, (routed.body, direct.body)
    if status == 400:  # the router's own refusal, in the engine's terms
        assert "x-kvroute-engine" not in routed.headers
        assert routed.body["error"]["param"] == direct.body["error"]["param"] == "max_tokens"
        assert routed.body["error"]["message"] == "'max_tokens' must be at least 1, got 0"

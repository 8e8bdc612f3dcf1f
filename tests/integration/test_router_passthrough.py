"""Every other engine route through kvroute serve: embeddings, pooling, score, rerank,
tokenize, detokenize, render (router/frontends/http/passthrough.py,
router/frontends/http/engine_routes.py).

Each passes through to an engine serving the body's model, chosen on load, with the
auth, limits, metrics, retries and errors of completions; unknown paths and the routes
kvroute does not forward get its own 404 in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from support.clients import metric_sum, metrics, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.frontends.http.engine_routes import ENGINE_ROUTES

ALPHA, BETA = "alpha", "beta"

#: One request of each route family, with the fields that differ per answer (ids,
#: timestamps) named so that a direct answer and a routed one can be compared.
FAMILIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": ["the quick brown fox", "jumps over"]},
    "/pooling": {"input": "the quick brown fox"},
    "/score": {"queries": "brown fox", "documents": ["a brown fox", "a red hen"]},
    "/rerank": {"query": "brown fox", "documents": ["a red hen", "a brown fox"]},
    "/tokenize": {"prompt": "the quick brown fox"},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "hi there"}]},
}
_VARYING = ("id", "created", "request_id")


def _stable(answer: Any) -> Any:
    if isinstance(answer, dict):
        return {k: _stable(v) for k, v in answer.items() if k not in _VARYING}
    if isinstance(answer, list):
        return [_stable(v) for v in answer]
    return answer


def _is_openai_error(body: Any, status: int, code: str | int | None = None) -> bool:
    error = body["error"]
    return (
        isinstance(error["message"], str)
        and isinstance(error["type"], str)
        and error["code"] == (code if code is not None else status)
    )


@pytest_asyncio.fixture(scope="module")
async def two_models() -> AsyncIterator[dict[str, EmulatedEngine]]:
    """One engine serving ``alpha``, one serving ``beta``."""
    engines = {m: await start_test_engine(model=m, engine_id=f"pt-{m}") for m in (ALPHA, BETA)}
    yield engines
    for engine in engines.values():
        await engine.stop()


@pytest_asyncio.fixture(scope="module")
async def one_model() -> AsyncIterator[list[EmulatedEngine]]:
    """Two engines serving ``alpha``."""
    engines = [await start_test_engine(model=ALPHA, engine_id=f"pt-same{i}") for i in range(2)]
    yield engines
    for engine in engines:
        await engine.stop()


async def _router(urls: list[str], models: int, **sections: Any) -> RouterApp:
    app = await start_router(urls, **sections)
    await poll(lambda: len(app.registry.models()) == models and app.registry.healthy_count())
    return app


@pytest_asyncio.fixture
async def router(two_models: dict[str, EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await _router([e.url for e in two_models.values()], 2, limits={"max_body_bytes": 4096})
    await poll(lambda: app.registry.healthy_count() == 2)
    yield app
    await app.stop()


# ------------------------------------------------------------------------ routed


@pytest.mark.parametrize("path", list(FAMILIES))
async def test_each_route_family_reaches_an_engine_serving_its_model_and_relays_its_answer(
    router: RouterApp,
    two_models: dict[str, EmulatedEngine],
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    for model, engine in two_models.items():
        body = {"model": model, **FAMILIES[path]}
        routed = await post_reply(http, f"{router.url}{path}", body)
        direct = await post_reply(http, f"{engine.url}{path}", body)
        assert routed.status == direct.status == 200, routed.body
        assert routed.headers["x-kvroute-engine"] == engine.url.removeprefix("http://")
        # The body was not hashed: the reason is the load's, not a prefix verdict.
        assert routed.headers["x-kvroute-reason"].startswith("latency:load match=0 ")
        assert _stable(routed.body) == _stable(direct.body)
    samples = await metrics(http, router.url)
    label = path.rsplit("/", 1)[-1] if path != "/v1/chat/completions/render" else "render"
    assert metric_sum(
        samples, "kvroute_requests_total", route=label, outcome="ok", status="200"
    ) >= len(two_models)
    assert metric_sum(samples, "kvroute_decisions_total", reason="load") >= len(two_models)


async def test_an_engine_refusal_passes_through_with_its_status_and_body(
    router: RouterApp, two_models: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    body = {"model": BETA, "tokens": [10**9]}  # out of the emulator's vocabulary
    routed = await post_reply(http, f"{router.url}/detokenize", body)
    direct = await post_reply(http, f"{two_models[BETA].url}/detokenize", body)
    assert routed.status == direct.status == 400
    assert routed.body == direct.body
    assert routed.headers["x-kvroute-engine"] == two_models[BETA].url.removeprefix("http://")
    samples = await metrics(http, router.url)
    assert metric_sum(
        samples, "kvroute_requests_total", route="detokenize", outcome="client_error", status="400"
    )


async def test_the_only_model_is_used_when_the_body_names_none(
    one_model: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await _router([e.url for e in one_model], 1)
    try:
        reply = await post_reply(http, f"{app.url}/tokenize", {"prompt": "a b c"})
        assert reply.status == 200 and reply.body["count"] == 3
    finally:
        await app.stop()


# ------------------------------------------------------------------------ load


async def test_requests_spread_over_the_engines_serving_the_model(
    one_model: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await _router([e.url for e in one_model], 1)
    await poll(lambda: app.registry.healthy_count() == 2)
    try:
        seen: set[str] = set()
        for _ in range(24):
            body = {"model": ALPHA, "input": "the same text every time"}
            reply = await post_reply(http, f"{app.url}/v1/embeddings", body)
            assert reply.status == 200
            seen.add(reply.headers["x-kvroute-engine"])
        assert seen == {e.url.removeprefix("http://") for e in one_model}
    finally:
        await app.stop()


async def test_an_engine_busy_with_a_generation_gets_no_embeddings(
    http: aiohttp.ClientSession,
) -> None:
    # Real time: a long generation stays in flight while the embeddings are routed.
    engines = [
        await start_test_engine(model=ALPHA, engine_id=f"pt-busy{i}", time_scale=1.0)
        for i in range(2)
    ]
    app = await _router([e.url for e in engines], 1)
    await poll(lambda: app.registry.healthy_count() == 2)
    try:
        generation = {"model": ALPHA, "prompt": "long " * 200, "max_tokens": 4000, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=generation) as busy:
            assert busy.status == 200
            await busy.content.readany()  # decoding: the engine holds its KV now
            held = busy.headers["x-kvroute-engine"]
            for _ in range(8):
                body = {"model": ALPHA, "input": "short text"}
                reply = await post_reply(http, f"{app.url}/v1/embeddings", body)
                assert reply.status == 200
                assert reply.headers["x-kvroute-engine"] != held
    finally:
        await app.stop()
        for engine in engines:
            await engine.stop()


async def test_a_failure_before_the_first_byte_is_retried_on_another_engine(
    http: aiohttp.ClientSession,
) -> None:
    engines = [await start_test_engine(model=ALPHA, engine_id=f"pt-retry{i}") for i in range(2)]
    # Probes far apart: the stopped engine is found out by requests, not by a probe.
    app = await _router([e.url for e in engines], 1, health={"interval_s": 60})
    await poll(lambda: app.registry.healthy_count() == 2)
    await engines[0].stop()
    try:
        retried = 0.0
        for _ in range(40):
            reply = await post_reply(http, f"{app.url}/tokenize", {"prompt": "a b"})
            assert reply.status == 200, reply.body
            assert reply.headers["x-kvroute-engine"] == engines[1].url.removeprefix("http://")
            retried = metric_sum(await metrics(http, app.url), "kvroute_retries_total")
            if retried:
                break
        assert retried >= 1
    finally:
        await app.stop()
        await engines[1].stop()


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        ({"model": "gamma", "prompt": "x"}, 404, "model_not_found", "gamma"),
        ({"prompt": "x"}, 400, None, "'model' is required"),
        ({"model": 7, "prompt": "x"}, 400, None, "'model' must be a string"),
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        (b'{"model": "alpha", "x": ' + b"[" * 40 + b"]" * 40 + b"}", 400, None, "deeper"),
        (json.dumps({"model": ALPHA, "prompt": "x" * 5000}).encode(), 413, None, "larger"),
    ],
)
async def test_the_router_refuses_bad_requests_in_openai_shape(
    router: RouterApp,
    http: aiohttp.ClientSession,
    body: Any,
    status: int,
    code: str | None,
    needle: str,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{router.url}/tokenize", data=data, headers=headers) as resp:
        answer = await resp.json()
        assert resp.status == status, answer
        assert "x-kvroute-engine" not in resp.headers  # no engine saw it
    assert _is_openai_error(answer, status, code)
    assert needle in answer["error"]["message"]


async def test_no_healthy_engine_for_the_model_is_a_503(
    one_model: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await _router([one_model[0].url], 1)
    try:
        for engine in app.registry:
            app.registry.drain(engine)  # known, but taking no requests
        reply = await post_reply(http, f"{app.url}/v1/embeddings", {"model": ALPHA, "input": "x"})
        assert reply.status == 503 and _is_openai_error(reply.body, 503)
        assert reply.headers["retry-after"] == "1"
    finally:
        await app.stop()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/realtime"),
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/inference/v1/abort_requests"),
    ],
)
async def test_a_route_kvroute_does_not_forward_gets_its_documented_404(
    router: RouterApp, http: aiohttp.ClientSession, method: str, path: str
) -> None:
    async with http.request(method, f"{router.url}{path}", json={"lora_name": "x"}) as resp:
        answer = await resp.json()
        assert resp.status == 404
    assert _is_openai_error(answer, 404, "route_not_routed")
    assert f"does not route {method} {path}:" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("POST", "/v1/no/such/route", "unknown_route"),
        ("GET", "/v1/embeddings/x", "unknown_route"),
        ("POST", "/sleep", "unknown_route"),  # an engine's own admin route
        ("GET", "/no/such/path", "unknown_route"),
        ("GET", "/tokenize", 404),  # a routed path, another method
    ],
)
async def test_unknown_routes_get_the_routers_404_in_openai_shape(
    router: RouterApp, http: aiohttp.ClientSession, method: str, path: str, code: str | int
) -> None:
    async with http.request(method, f"{router.url}{path}", json={"model": ALPHA}) as resp:
        assert resp.status == 404
        assert resp.content_type == "application/json"
        answer = await resp.json()
        assert "x-kvroute-engine" not in resp.headers
    assert _is_openai_error(answer, 404, code)
    assert path in answer["error"]["message"]


# ------------------------------------------------------------------------ auth


async def test_client_keys_apply_to_every_passthrough_route(
    two_models: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await _router([e.url for e in two_models.values()], 2, auth={"api_keys": ["sesame"]})
    good = {"Authorization": "Bearer sesame"}
    try:
        for path in ("/tokenize", "/v1/embeddings", "/pooling", "/v1/no/such/route"):
            body = {"model": ALPHA, **FAMILIES.get(path, {})}
            refused = await post_reply(http, f"{app.url}{path}", body)
            assert refused.status == 401 and _is_openai_error(refused.body, 401, "invalid_api_key")
            wrong = await post_reply(
                http, f"{app.url}{path}", body, {"Authorization": "Bearer nope"}
            )
            assert wrong.status == 401
        reply = await post_reply(http, f"{app.url}/tokenize", {"model": ALPHA, "prompt": "x"}, good)
        assert reply.status == 200
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_auth_refusals_total", api="http", kind="client") >= 8
    finally:
        await app.stop()


# ------------------------------------------------------------------------ streams


async def _sse_engine() -> tuple[web.AppRunner, str]:
    """A minimal engine of one model whose /inference/v1/generate streams three events
    (the emulator does not serve that route)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": ALPHA, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"token_ids": [1, 2]}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for ids in ([1], [2]):
            await out.write(f"data: {json.dumps({'choices': [{'token_ids': ids}]})}\n\n".encode())
            await asyncio.sleep(0)
        await out.write(b"data: [DONE]\n\n")
        return out

    app = web.Application()
    app.add_routes(
        [
            web.get("/v1/models", models),
            web.get("/health", health),
            web.post("/inference/v1/generate", generate),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_streaming_route_relays_server_sent_events_and_a_whole_answer(
    http: aiohttp.ClientSession,
) -> None:
    runner, url = await _sse_engine()
    app = await _router([url], 1)
    try:
        body = {"model": ALPHA, "token_ids": [1, 2, 3], "stream": True}
        async with http.post(f"{app.url}/inference/v1/generate", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
        assert text.split("\n\n")[:3] == [
            'data: {"choices": [{"token_ids": [1]}]}',
            'data: {"choices": [{"token_ids": [2]}]}',
            "data: [DONE]",
        ]
        whole = await post_reply(
            http, f"{app.url}/inference/v1/generate", {**body, "stream": False}
        )
        assert whole.status == 200 and whole.body == {"choices": [{"token_ids": [1, 2]}]}
        samples = await metrics(http, app.url)
        assert (
            metric_sum(samples, "kvroute_requests_total", route="generate_tokens", outcome="ok")
            == 2
        )
    finally:
        await app.stop()
        await runner.cleanup()


async def test_the_openapi_document_lists_every_passed_through_route(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{router.url}/openapi.json") as resp:
        doc = await resp.json()
    for route in ENGINE_ROUTES:
        assert "post" in doc["paths"][route.path], route.path
    streamed = doc["paths"]["/inference/v1/generate"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in streamed


async def test_router_owned_handoff_fields_are_removed_as_on_completions(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {"model": ALPHA, "prompt": "a b", "kv_transfer_params": {"do_remote_decode": True}}
    reply = await post_reply(http, f"{router.url}/tokenize", body)
    assert reply.status == 200
    samples = await metrics(http, router.url)
    removed = metric_sum(
        samples, "kvroute_client_handoff_fields_removed_total", field="kv_transfer_params"
    )
    assert removed >= 1

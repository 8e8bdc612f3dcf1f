"""The OpenAI Responses API through the router: routing, previous_response_id affinity,
GET and cancel to the engine holding a response, limits, and two replicas sharing the
response ids through Redis. Engines are the emulator; everything is on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio
import redis as redis_sync
from support.clients import metric_sum, metrics, post_reply, session
from support.engines import start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.tokenization.words import WordTokenizer, render_chat

MODEL = "kvroute-emulated"
AFFINITY = "kvroute_responses_affinity_total"
#: Round robin sends consecutive requests to different engines: only the pin keeps a
#: conversation on one.
ROUND_ROBIN = {"policy": {"name": "round_robin"}}


@pytest_asyncio.fixture(scope="module")
async def pair() -> AsyncIterator[list[EmulatedEngine]]:
    engines = [await start_test_engine(engine_id=f"resp{i}") for i in range(2)]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def router(pair: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([e.url for e in pair], **ROUND_ROBIN)
    yield app
    await app.stop()


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def create(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, str, Any]:
    reply = await post_reply(http, f"{url}/v1/responses", {"model": MODEL, **body})
    return reply.status, reply.headers.get("x-kvroute-engine", ""), reply.body


async def stream_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, list[tuple[str, Any]]]:
    """(engine, [(event name, data)]) of a streamed response."""
    async with http.post(
        f"{url}/v1/responses", json={"model": MODEL, "stream": True, **body}
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["content-type"].startswith("text/event-stream")
        engine = resp.headers["x-kvroute-engine"]
        text = (await resp.read()).decode()
    events = []
    for block in filter(None, text.split("\n\n")):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return engine, events


async def holder_get(http: aiohttp.ClientSession, url: str) -> tuple[int, str, Any]:
    async with http.get(url) as resp:
        return resp.status, resp.headers.get("x-kvroute-engine", ""), await resp.json()


async def questions(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A router's questions to the engines about unknown response ids, by result."""
    samples = await metrics(http, url)
    name = "kvroute_responses_engine_queries_total"
    return {r: metric_sum(samples, name, result=r) for r in ("found", "not_found", "not_asked")}


# ---------------------------------------------------------------------------- new responses


async def test_a_response_is_tokenized_from_instructions_and_input_items(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c d e"}]},
        {"role": "user", "content": words("q", 40)},
    ]
    status, engine, body = await create(
        http, router.url, {"instructions": words("sys", 30), "input": items, "max_output_tokens": 2}
    )
    assert status == 200, body
    assert engine in {e.endpoint for e in router.registry}
    assert body["object"] == "response" and body["status"] == "incomplete"
    chat = [
        {"role": "system", "content": words("sys", 30)},
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "c d e"},
        {"role": "user", "content": words("q", 40)},
    ]
    # The router's count of the prompt is the engine's: both render the same chat.
    assert body["usage"]["input_tokens"] == len(WordTokenizer().encode(render_chat(chat)))
    assert router.tokenizers.mismatches().get(MODEL, 0) == 0


async def test_previous_response_id_keeps_a_conversation_on_its_engine_and_its_cache(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, first_engine, body = await create(
        http, router.url, {"input": words("conversation", 120), "max_output_tokens": 4}
    )
    assert status == 200
    engines, cached = [first_engine], []
    for turn in range(3):
        status, engine, body = await create(
            http,
            router.url,
            {"input": words(f"turn{turn}-", 8), "previous_response_id": body["id"]},
        )
        assert status == 200, body
        engines.append(engine)
        cached.append(body["usage"]["input_tokens_details"]["cached_tokens"])
    assert engines == [first_engine] * 4
    # Each turn's prompt is the conversation so far: the engine's cache holds it, and
    # more of it every turn.
    assert cached[0] >= 100 and cached == sorted(set(cached)), cached
    assert metric_sum(await metrics(http, router.url), AFFINITY, outcome="pinned") == 3


async def test_an_unknown_previous_response_id_is_routed_normally_and_counted(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, engine, body = await create(
        http, router.url, {"input": "hello", "previous_response_id": "resp_nobody"}
    )
    # Routed like any request: the engine answers for the id it does not hold.
    assert status == 404 and engine
    assert body["error"]["message"] == "Response with id 'resp_nobody' not found."
    assert metric_sum(await metrics(http, router.url), AFFINITY, outcome="unknown") == 1


async def test_a_pinned_engine_that_is_not_healthy_is_not_used_and_counted(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, holder, body = await create(http, router.url, {"input": words("x", 40)})
    assert status == 200
    engine = router.registry.get(holder)
    assert engine is not None
    router.registry.drain(engine)
    try:
        status, other, answer = await create(
            http, router.url, {"input": "more", "previous_response_id": body["id"]}
        )
    finally:
        router.registry.undrain(engine)
    assert other != holder and status == 404, answer
    samples = await metrics(http, router.url)
    assert metric_sum(samples, AFFINITY, outcome="engine_unavailable") == 1


async def test_a_streamed_response_is_relayed_and_its_id_learned_from_its_events(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    engine, events = await stream_events(
        http, router.url, {"input": words("stream", 50), "max_output_tokens": 3}
    )
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    assert names.count("response.output_text.delta") == 3
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    response_id = events[0][1]["response"]["id"]
    status, holder, stored = await holder_get(http, f"{router.url}/v1/responses/{response_id}")
    assert status == 200 and holder == engine
    assert (
        stored["output"][0]["content"][0]["text"]
        == events[-1][1]["response"]["output"][0]["content"][0]["text"]
    )
    # The next turn, streamed too, stays there.
    again, _ = await stream_events(
        http, router.url, {"input": "next", "previous_response_id": response_id}
    )
    assert again == engine


async def test_a_response_not_stored_is_not_remembered(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, _, body = await create(http, router.url, {"input": "a b c", "store": False})
    assert status == 200
    assert await router.responses.engine_of(body["id"]) is None


# ---------------------------------------------------------------------------- GET and cancel


async def test_get_and_cancel_reach_the_engine_holding_the_response(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, holder, body = await create(http, router.url, {"input": words("keep", 20)})
    assert status == 200
    url = f"{router.url}/v1/responses/{body['id']}"
    for _ in range(3):  # round robin would move any request not sent to the holder
        status, engine, stored = await holder_get(http, url)
        assert status == 200 and engine == holder and stored["id"] == body["id"]
    reply = await post_reply(http, f"{url}/cancel", {})
    # The holder's own answer: a finished response cannot be cancelled (another engine
    # would not know the id: 404).
    assert reply.status == 400 and reply.headers["x-kvroute-engine"] == holder
    assert reply.body["error"]["message"] == "Cannot cancel a synchronous response."


async def test_get_and_cancel_of_an_unknown_response_are_openai_404s(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    for method, path in (
        ("GET", "/v1/responses/resp_unknown"),
        ("POST", "/v1/responses/resp_unknown/cancel"),
        ("GET", "/v1/responses/not%20an%20id"),
    ):
        async with http.request(method, f"{router.url}{path}") as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
        assert error["type"] == "not_found_error" and error["param"] == "response_id"
        assert "x-kvroute-engine" not in resp.headers
    samples = await metrics(http, router.url)
    assert metric_sum(samples, "kvroute_requests_total", route="responses_get", status="404") == 2


# ---------------------------------------------------------------------------- refusals


async def test_limits_and_bad_input_are_refused_in_the_openai_shape(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    limits = {"limits": {"max_output_tokens": 100, "max_prompt_tokens": 50}}
    app = await start_router([e.url for e in pair], **limits)
    try:
        for body, param in (
            ({"input": "a", "max_output_tokens": 101}, "max_output_tokens"),
            ({"input": words("long", 60)}, "input"),
            ({"input": 42}, "input"),
            ({"input": [{"type": "mystery"}]}, "input"),
            ({"input": "a", "stream": "yes"}, "stream"),
        ):
            status, engine, answer = await create(http, app.url, body)
            assert status == 400 and not engine, (body, answer)
            assert answer["error"]["param"] == param
            assert answer["error"]["type"] == "invalid_request_error"
    finally:
        await app.stop()


async def test_router_owned_fields_are_removed_from_responses_bodies(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {"input": "a b", "kv_transfer_params": {"do_remote_prefill": True}}
    status, _, answer = await create(http, router.url, body)
    assert status == 200, answer
    samples = await metrics(http, router.url)
    assert (
        metric_sum(
            samples, "kvroute_client_handoff_fields_removed_total", field="kv_transfer_params"
        )
        >= 1
    )


# ---------------------------------------------------------------------------- replicas


async def test_two_replicas_share_response_ids_through_redis(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession, redis_url: str, redis_namespace: str
) -> None:
    index = {"backend": "redis", "redis": {"url": redis_url, "namespace": redis_namespace}}
    # Room for a loaded test machine: Redis is not under test for speed here.
    index["redis"]["budget_ms"] = 200
    urls = [e.url for e in pair]
    first = await start_router(urls, index=index, **ROUND_ROBIN)
    second = await start_router(urls, index=index, **ROUND_ROBIN)
    try:
        status, holder, body = await create(http, first.url, {"input": words("shared", 64)})
        assert status == 200
        key = f"{{{redis_namespace}}}:response:{body['id']}"
        client = redis_sync.Redis.from_url(redis_url)
        assert client.get(key) == holder.encode()
        assert 0 < client.pttl(key) <= 3_600_000
        engines = []
        for _ in range(2):  # round robin on the second replica: the pin decides
            status, engine, answer = await create(
                http, second.url, {"input": "go on", "previous_response_id": body["id"]}
            )
            assert status == 200, answer
            engines.append(engine)
        assert engines == [holder, holder]
        status, engine, stored = await holder_get(http, f"{second.url}/v1/responses/{body['id']}")
        assert status == 200 and engine == holder and stored["id"] == body["id"]
        samples = await metrics(http, second.url)
        assert metric_sum(samples, AFFINITY, outcome="pinned") == 2
    finally:
        await first.stop()
        await second.stop()


async def test_a_replica_that_was_never_told_finds_the_holder_by_asking_the_engines(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    # Two replicas sharing nothing: what a lost Redis write leaves behind.
    urls = [e.url for e in pair]
    first = await start_router(urls, **ROUND_ROBIN)
    second = await start_router(urls, **ROUND_ROBIN)
    try:
        status, holder, body = await create(http, first.url, {"input": words("asked", 30)})
        assert status == 200
        url = f"{second.url}/v1/responses/{body['id']}"
        for _ in range(2):  # round robin alone would send one of these elsewhere
            status, engine, stored = await holder_get(http, url)
            assert status == 200 and engine == holder and stored["id"] == body["id"]
        assert await second.responses.engine_of(body["id"]) == holder  # remembered
        status, engine, answer = await create(
            http, second.url, {"input": "go on", "previous_response_id": body["id"]}
        )
        assert status == 200 and engine == holder, answer
        # A conversation the second replica never saw starts on its engine too.
        status, other_holder, other = await create(http, first.url, {"input": words("b", 30)})
        assert status == 200
        for _ in range(2):
            status, engine, answer = await create(
                http, second.url, {"input": "and", "previous_response_id": other["id"]}
            )
            assert status == 200 and engine == other_holder, answer
        status, _, _ = await holder_get(http, f"{second.url}/v1/responses/resp_nobody")
        assert status == 404
        asked = await questions(http, second.url)
        assert (asked["found"], asked["not_found"]) == (2, 1)
        samples = await metrics(http, second.url)
        assert metric_sum(samples, AFFINITY, outcome="pinned") == 3
    finally:
        await first.stop()
        await second.stop()


async def test_asking_the_engines_can_be_turned_off(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    urls = [e.url for e in pair]
    first = await start_router(urls, **ROUND_ROBIN)
    second = await start_router(urls, responses={"ask_engines": 0}, **ROUND_ROBIN)
    try:
        status, _, body = await create(http, first.url, {"input": words("alone", 30)})
        assert status == 200
        status, engine, answer = await holder_get(http, f"{second.url}/v1/responses/{body['id']}")
        assert status == 404 and not engine, answer
        assert answer["error"]["code"] == "response_not_found"
        assert sum((await questions(http, second.url)).values()) == 0
    finally:
        await first.stop()
        await second.stop()


async def test_made_up_ids_are_asked_about_at_most_ask_per_second(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in pair], responses={"ask_per_second": 0.01})
    try:
        for n in range(3):
            status, engine, answer = await holder_get(http, f"{app.url}/v1/responses/resp_made{n}")
            assert status == 404 and not engine, answer
        # One question (a burst of one), then none for the next 100 s.
        asked = await questions(http, app.url)
        assert (asked["not_found"], asked["not_asked"]) == (1, 2)
    finally:
        await app.stop()


async def test_one_caller_cannot_use_up_the_questions_of_another(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in pair], responses={"ask_per_caller_per_second": 0.01})
    other = session(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
    try:
        for n in range(3):  # one caller: a burst of one, then none for 100 s
            status, _, answer = await holder_get(http, f"{app.url}/v1/responses/resp_mine{n}")
            assert status == 404, answer
        asked = await questions(http, app.url)
        assert (asked["not_found"], asked["not_asked"]) == (1, 2)
        # Another address still has its own question, within the router's 20 a second.
        status, _, answer = await holder_get(other, f"{app.url}/v1/responses/resp_theirs")
        assert status == 404, answer
        asked = await questions(http, app.url)
        assert (asked["not_found"], asked["not_asked"]) == (2, 2)
    finally:
        await other.close()
        await app.stop()


async def test_a_key_sent_as_x_api_key_reaches_the_engine_holding_the_response(
    http: aiohttp.ClientSession,
) -> None:
    # Engines that want the key (vLLM's --api-key), a router passing the client's key.
    engine = await start_test_engine(engine_id="keyed", api_key="k1")
    # Without a key of its own the router cannot list the engine's models: configured.
    static = [{"url": engine.url, "models": [MODEL]}]
    app = await start_router(static, auth={"api_keys": ["k1"], "accept_x_api_key": "all"})
    try:
        reply = await post_reply(
            http, f"{app.url}/v1/responses", {"model": MODEL, "input": words("k", 20)},
            headers={"x-api-key": "k1"},
        )  # fmt: skip
        assert reply.status == 200, reply.body
        for suffix, method in (("", "GET"), ("/cancel", "POST")):
            url = f"{app.url}/v1/responses/{reply.body['id']}{suffix}"
            async with http.request(method, url, headers={"x-api-key": "k1"}) as resp:
                # The engine saw the key as Bearer: its own answer, not its 401.
                assert resp.status != 401, await resp.text()
                assert resp.headers["x-kvroute-engine"]
    finally:
        await app.stop()
        await engine.stop()

"""The Anthropic Messages API through kvroute to emulated engines: routing and cache
affinity across turns, the answer relayed untouched, the router's own refusals in
Anthropic's error form, count_tokens, and ``x-api-key`` as a client key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import post, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.tokenization.anthropic import chat_messages
from router.tokenization.words import WordTokenizer, render_chat

MODEL = "kvroute-emulated"
SYSTEM = " ".join(f"rule{i}" for i in range(200))


def request(text: str, max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        **fields,
    }


def words_count(body: dict[str, Any]) -> int:
    """The prompt tokens the emulator prefills for a Messages body."""
    messages = chat_messages(body.get("system"), body["messages"])
    return len(WordTokenizer().encode(render_chat(messages)))


def engine_prompt(usage: dict[str, Any]) -> int:
    return sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens"))


async def raw_post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(url, data=data, headers=sent) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An Anthropic stream as (event name, data) pairs."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            out.append((name[7:], json.loads(data[6:])))
    return out


def anthropic_error(body: bytes, kind: str) -> str:
    """The message of an Anthropic-shaped error of type ``kind`` (fails otherwise)."""
    payload = json.loads(body)
    assert payload["type"] == "error" and payload["error"]["type"] == kind, payload
    assert set(payload) == {"type", "error"} and set(payload["error"]) == {"type", "message"}
    return str(payload["error"]["message"])


@pytest_asyncio.fixture(scope="module")
async def fleet(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"msgs{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/msgs{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(3)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def router(fleet: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([e.url for e in fleet], policy={"name": "kv_cost"})
    await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 3)
    yield app
    await app.stop()


# ---------------------------------------------------------------------- routing


async def test_the_router_counts_the_prompt_tokens_the_engine_prefills(
    router: RouterApp, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []
    observe = router.tokenizers.observe
    monkeypatch.setattr(
        router.tokenizers,
        "observe",
        lambda m, ours, theirs, **kw: seen.append((ours, theirs)) or observe(m, ours, theirs, **kw),
    )
    body = request("count me", system="plain system text")
    body["messages"] += [
        {"role": "assistant", "content": "an answer"},
        {"role": "system", "content": "an inline reminder"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    status, _, raw = await raw_post(http, f"{router.url}/v1/messages", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["type"] == "message" and answer["content"][0]["type"] == "text"
    assert engine_prompt(answer["usage"]) == words_count(body)
    async with http.post(f"{router.url}/v1/messages", json={**body, "stream": True}) as resp:
        streamed = events(await resp.read())
    assert engine_prompt(streamed[0][1]["message"]["usage"]) == words_count(body)
    assert seen == [(words_count(body), words_count(body))] * 2
    assert router.tokenizers.mismatches() == {MODEL: 0}


async def test_a_conversation_stays_on_its_engine_and_hits_its_cache_turn_after_turn(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = request("first question about the shared system prompt", max_tokens=3)
    engines, cached = [], []
    for turn in range(3):
        reply = await post_reply(http, f"{router.url}/v1/messages", body)
        assert reply.status == 200, reply.body
        engines.append(reply.headers["x-kvroute-engine"])
        cached.append(reply.body["usage"]["cache_read_input_tokens"])
        answer = reply.body["content"][0]["text"]
        body = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                {"role": "user", "content": f"follow-up {turn} " * 12},
            ],
        }
    assert len(set(engines)) == 1, engines
    # Each later turn finds the previous turn's whole prompt and answer cached.
    assert cached[1] >= 200 and cached[2] > cached[1], cached


async def test_a_stream_is_relayed_byte_for_byte(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    engine = fleet[0]
    app = await start_router([engine.url])
    body = request("stream this to me", max_tokens=6, stream=True)
    headers = {"x-request-id": "relay-bytes-1"}
    try:
        answers = []
        for url in (engine.url, app.url):
            assert (await post(http, f"{engine.url}/reset_prefix_cache", {}))[0] == 200
            status, got, raw = await raw_post(http, f"{url}/v1/messages", body, headers)
            assert status == 200 and got["content-type"].startswith("text/event-stream")
            answers.append(raw)
        direct, routed = answers
        assert routed == direct
        names = [name for name, _ in events(routed)]
        assert names == [
            "message_start",
            "content_block_start",
            *["content_block_delta"] * 6,
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert events(routed)[-2][1]["delta"]["stop_reason"] == "max_tokens"
    finally:
        await app.stop()


async def test_an_engine_refusal_passes_through_untouched(
    router: RouterApp, fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    too_long = request(" ".join(["word"] * 17_000))
    direct = await raw_post(http, f"{fleet[0].url}/v1/messages", too_long)
    routed = await raw_post(http, f"{router.url}/v1/messages", too_long)
    assert routed[0] == direct[0] == 400
    assert routed[2] == direct[2]
    anthropic_error(routed[2], "BadRequestError")


async def test_a_stream_that_breaks_ends_with_an_anthropic_error_event(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="msgs-garble")
    app = await start_router([engine.url])
    try:
        await post(http, f"{engine.url}/admin/faults", {"garble_after_tokens": 2})
        status, _, raw = await raw_post(
            http, f"{app.url}/v1/messages", request("break", max_tokens=8, stream=True)
        )
        assert status == 200
        tail = raw.rsplit(b"\n\n", 2)[-2]
        assert tail.startswith(b"event: error\ndata: ")
        anthropic_error(tail.split(b"data: ", 1)[1], "api_error")
        assert b"[DONE]" not in raw
    finally:
        await app.stop()
        await engine.stop()


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("body", "kind", "status", "says"),
    [
        (b"{not json", "invalid_request_error", 400, "not valid JSON"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
            "invalid_request_error",
            400,
            "'model'",
        ),
        ({"model": MODEL, "max_tokens": 1}, "invalid_request_error", 400, "'messages'"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            "invalid_request_error",
            400,
            "'max_tokens'",
        ),
        (
            {"model": MODEL, "max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]},
            "invalid_request_error",
            400,
            "role",
        ),
        ({**request("x"), "max_tokens": 10**9}, "invalid_request_error", 400, "at most"),
        ({**request("x"), "model": "no-such-model"}, "not_found_error", 404, "no-such-model"),
    ],
)
async def test_what_the_router_refuses_is_in_anthropics_form(
    router: RouterApp,
    http: aiohttp.ClientSession,
    body: Any,
    kind: str,
    status: int,
    says: str,
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and says in ("'max_tokens'", "at most"):
            continue  # a count has no output
        got, headers, raw = await raw_post(http, f"{router.url}{path}", body)
        assert got == status, raw
        assert says in anthropic_error(raw, kind)
        assert headers["content-type"].startswith("application/json")


async def test_a_prompt_past_max_prompt_tokens_is_refused_in_anthropics_form(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([fleet[0].url], limits={"max_prompt_tokens": 100})
    try:
        status, _, raw = await raw_post(http, f"{app.url}/v1/messages", request("x"))
        assert status == 400
        assert "at most 100" in anthropic_error(raw, "invalid_request_error")
    finally:
        await app.stop()


async def test_no_engine_and_overload_are_refused_in_anthropics_form(
    http: aiohttp.ClientSession,
) -> None:
    nowhere = await start_router(["http://127.0.0.1:9"])
    try:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, headers, raw = await raw_post(http, f"{nowhere.url}{path}", request("x"))
            assert status == 503 and headers["retry-after"] == "1"
            anthropic_error(raw, "overloaded_error")
    finally:
        await nowhere.stop()

    slow = await start_test_engine(engine_id="msgs-slow", time_scale=1.0)
    app = await start_router([slow.url], limits={"max_inflight": 1, "admission_queue": 0})
    try:
        hold = request("hold the only slot", max_tokens=200, stream=True)
        async with http.post(f"{app.url}/v1/messages", json=hold) as holder:
            await holder.content.readany()
            status, _, raw = await raw_post(http, f"{app.url}/v1/messages", request("late"))
            assert status == 429
            anthropic_error(raw, "rate_limit_error")
        # The OpenAI routes keep OpenAI's form.
        app.begin_drain()
        status, _, raw = await raw_post(
            http, f"{app.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
        assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
        status, _, raw = await raw_post(http, f"{app.url}/v1/messages", request("x"))
        assert status == 503
        anthropic_error(raw, "overloaded_error")
    finally:
        await app.stop()
        await slow.stop()


async def test_an_unsupported_method_on_a_messages_route_is_anthropic_shaped(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{router.url}/v1/messages") as resp:
        assert resp.status == 404
        anthropic_error(await resp.read(), "not_found_error")


# ---------------------------------------------------------------------- count_tokens


async def test_count_tokens_is_the_engines_count(
    router: RouterApp, fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    body = request("how many tokens is this")
    del body["max_tokens"]
    reply = await post_reply(http, f"{router.url}/v1/messages/count_tokens", body)
    assert reply.status == 200, reply.body
    assert reply.body == {
        "input_tokens": words_count(body),
        "context_management": {"original_input_tokens": words_count(body)},
    }
    assert reply.headers["x-kvroute-engine"] in {f"127.0.0.1:{e.port}" for e in fleet}
    assert reply.headers["x-kvroute-reason"].startswith("kv_cost:load match=0 ")


# ---------------------------------------------------------------------- x-api-key


async def test_x_api_key_is_a_client_key_on_the_messages_routes_by_default(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="msgs-keys")
    app = await start_router([engine.url], auth={"api_keys": ["client-key"]})
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    try:
        good, bad = {"x-api-key": "client-key"}, {"x-api-key": "wrong"}
        assert (await raw_post(http, f"{app.url}/v1/messages", request("x"), good))[0] == 200
        assert (await raw_post(http, f"{app.url}/v1/messages/count_tokens", request("x"), good))[
            0
        ] == 200
        status, headers, raw = await raw_post(http, f"{app.url}/v1/messages", request("x"), bad)
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert "invalid API key" in anthropic_error(raw, "authentication_error")
        status, _, raw = await raw_post(http, f"{app.url}/v1/messages", request("x"))
        assert status == 401 and "x-api-key" in anthropic_error(raw, "authentication_error")
        bearer = {"Authorization": "Bearer client-key"}
        assert (await raw_post(http, f"{app.url}/v1/messages", request("x"), bearer))[0] == 200
        # Elsewhere x-api-key is no key: 401 in OpenAI's form.
        status, _, raw = await raw_post(http, f"{app.url}/v1/chat/completions", chat, good)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    finally:
        await app.stop()
        await engine.stop()


@pytest.mark.parametrize(("setting", "messages", "chat"), [("off", 401, 401), ("all", 200, 200)])
async def test_accept_x_api_key_widens_or_closes_where_it_counts(
    http: aiohttp.ClientSession, setting: str, messages: int, chat: int
) -> None:
    engine = await start_test_engine(engine_id=f"msgs-keys-{setting}")
    app = await start_router(
        [engine.url], auth={"api_keys": ["client-key"], "accept_x_api_key": setting}
    )
    key = {"x-api-key": "client-key"}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    try:
        assert (await raw_post(http, f"{app.url}/v1/messages", request("x"), key))[0] == messages
        assert (await raw_post(http, f"{app.url}/v1/chat/completions", body, key))[0] == chat
    finally:
        await app.stop()
        await engine.stop()


@pytest.mark.parametrize(("upstream", "status"), [("pass", 200), ("drop", 401)])
async def test_an_x_api_key_reaches_engines_only_as_auth_upstream_passes_keys(
    http: aiohttp.ClientSession, upstream: str, status: int
) -> None:
    """An engine started with --api-key reads ``Authorization`` only: ``pass`` sends it
    the client's x-api-key as a Bearer key, ``drop`` sends no key (its 401 passes)."""
    engine = await start_test_engine(engine_id=f"msgs-up-{upstream}", api_key="shared-key")
    # Without a key of its own the router cannot list the engine's models: configured.
    static = [{"url": engine.url, "models": [MODEL]}]
    app = await start_router(static, auth={"api_keys": ["shared-key"], "upstream": upstream})
    try:
        got, _, raw = await raw_post(
            http, f"{app.url}/v1/messages", request("x"), {"x-api-key": "shared-key"}
        )
        assert got == status, raw
    finally:
        await app.stop()
        await engine.stop()

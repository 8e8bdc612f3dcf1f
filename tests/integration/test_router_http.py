"""kvroute serve's HTTP API: relay, headers, request ids, the reason log, errors, retries,
health, engine scrapes, cancellation."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
import pytest_asyncio
import zmq
from prometheus_client.parser import text_string_to_metric_families
from support.clients import get, metric_sum, metrics, post, post_reply, stream
from support.docs import documented_metrics
from support.engines import poll, start_test_engine
from support.held_stream import HeldStreamEngine, StreamingClient
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.fleet.registry import EngineState
from router.frontends.http.downstream import HttpDownstream
from router.http1 import Response
from router.types import EngineKey

MODEL = "kvroute-emulated"


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture(scope="module")
async def pair() -> AsyncIterator[list[EmulatedEngine]]:
    engines = [await start_test_engine(engine_id=f"pair{i}") for i in range(2)]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def router(pair: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([e.url for e in pair])
    yield app
    await app.stop()


# ---------------------------------------------------------------------------- relay


async def test_completion_carries_routing_headers_and_keeps_the_request_id(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "hello there " * 40, "max_tokens": 3}
    async with http.post(
        f"{router.url}/v1/completions", json=body, headers={"x-request-id": "req-42"}
    ) as resp:
        assert resp.status == 200
        payload = await resp.json()
        assert resp.headers["x-request-id"] == "req-42"
        assert resp.headers["x-kvroute-engine"] in {e.endpoint for e in router.registry}
        assert resp.headers["x-kvroute-reason"].startswith("latency:")  # the default
    assert payload["usage"]["prompt_tokens"] == 80
    # The emulator names its answer after the X-Request-Id it received: sent upstream.
    assert payload["id"] == "cmpl-req-42"
    assert payload["choices"][0]["finish_reason"] == "length"


async def test_a_request_id_is_created_when_missing(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        f"{router.url}/v1/completions", json={"prompt": "a b c", "max_tokens": 1}
    ) as resp:
        assert resp.status == 200
        rid = resp.headers["x-request-id"]
        assert len(rid) == 32
        assert (await resp.json())["id"] == f"cmpl-{rid}"  # the engine got the same id


async def test_the_debug_log_carries_the_full_reason(
    router: RouterApp,
    pair: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompt = " ".join(f"log{i}" for i in range(100))
    with caplog.at_level(logging.DEBUG, logger="kvroute.http"):
        async with http.post(
            f"{router.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1},
            headers={"x-request-id": "debug-reason-1"},
        ) as resp:
            assert resp.status == 200
            short = resp.headers["x-kvroute-reason"]
    lines = [r.getMessage() for r in caplog.records if "debug-reason-1" in r.getMessage()]
    assert lines, caplog.text
    line = lines[0]
    assert short in line
    for engine in pair:  # every candidate, with each of its cost terms
        assert f"127.0.0.1:{engine.port}[match=" in line
    for term in ("cached=", "queue=", "prefill=", "decode=", "harm=", "cost="):
        assert term in line


async def test_streaming_relays_every_chunk_and_the_usage_chunk(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {
        "model": MODEL,
        "prompt": "stream me " * 30,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await stream(http, f"{router.url}/v1/completions", body)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == 60
    text_chunks = [e for e in events[:-2] if e["choices"]]
    assert len(text_chunks) == 12
    status, plain = await post(
        http, f"{router.url}/v1/completions", {**body, "stream": False, "stream_options": None}
    )
    assert status == 200
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain["choices"][0]["text"]


async def test_chat_completions_are_routed(router: RouterApp, http: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": "be brief " * 20},
            {"role": "user", "content": "hi"},
        ],
    }
    status, payload = await post(http, f"{router.url}/v1/chat/completions", body)
    assert status == 200
    assert payload["object"] == "chat.completion"
    events = await stream(http, f"{router.url}/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"


async def test_models_health_ready_and_openapi(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, models = await get(http, f"{router.url}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert (await get(http, f"{router.url}/health"))[0] == 200
    status, ready = await get(http, f"{router.url}/ready")
    assert status == 200 and ready["healthy_engines"] == 2
    status, doc = await get(http, f"{router.url}/openapi.json")
    assert status == 200
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    ref = schema["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "prompt" in doc["components"]["schemas"][ref]["required"]
    # Every POST route the router itself parses is described (and so fuzzed by
    # tests/fuzz/test_http_hostile.py), with what the router requires of its body.
    required = {
        "/v1/chat/completions": {"messages"},
        "/v1/responses": {"input"},
        "/v1/messages": {"model", "messages", "max_tokens"},
        "/v1/messages/count_tokens": {"model", "messages"},
    }
    for path, fields in required.items():
        content = doc["paths"][path]["post"]["requestBody"]["content"]
        ref = content["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert set(doc["components"]["schemas"][ref]["required"]) == fields, path
    held = doc["paths"]["/v1/responses/{response_id}"]["get"]["parameters"]
    assert [p["name"] for p in held] == ["response_id"]
    assert "post" in doc["paths"]["/v1/responses/{response_id}/cancel"]


async def test_metrics_expose_the_documented_names(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    await post(http, f"{router.url}/v1/completions", {"prompt": "x y z", "max_tokens": 1})
    samples = await metrics(http, router.url)
    for name in (
        "kvroute_requests_total",
        "kvroute_decisions_total",
        "kvroute_routing_seconds_bucket",
        "kvroute_prefix_match_ratio_bucket",
        "kvroute_request_seconds_bucket",
        "kvroute_engine_healthy",
        "kvroute_engine_inflight_requests",
        "kvroute_build_info",
        "kvroute_inflight_requests",
    ):
        assert name in samples, name
    ok = [s for s in samples["kvroute_requests_total"] if s.labels["outcome"] == "ok"]
    assert sum(s.value for s in ok) >= 1


# ---------------------------------------------------------------------------- errors


# The refusals of a body (not JSON, what routing cannot read, the limits) are intake's,
# table-driven in test_intake.py; their HTTP form is in test_front_ends_refuse_alike.py.


async def test_an_unknown_model_gets_404_listing_the_served_ones(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    status, payload = await post(
        http, f"{router.url}/v1/completions", {"model": "gpt-9", "prompt": "hi"}
    )
    assert status == 404
    assert payload["error"]["code"] == "model_not_found" and MODEL in payload["error"]["message"]


async def test_unknown_paths_and_methods_answer_in_openai_form(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    for method, path in (("GET", "/v2/nothing"), ("GET", "/v1/completions")):
        async with http.request(method, f"{router.url}{path}") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "not_found_error"


async def test_an_oversized_body_gets_413(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in pair], limits={"max_body_bytes": 1024})
    try:
        status, payload = await post(http, f"{app.url}/v1/completions", {"prompt": "word " * 1000})
        assert status == 413 and payload["error"]["type"] == "request_too_large"
    finally:
        await app.stop()


async def test_the_engines_own_client_errors_pass_through(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    too_long = "w " * 20_000  # beyond the test engines' max_model_len of 16,384
    status, payload = await post(
        http, f"{router.url}/v1/completions", {"prompt": too_long, "max_tokens": 1}
    )
    assert status == 400 and "error" in payload
    assert router.core.loads.in_flight == 0


async def test_too_many_in_flight_gets_429_with_retry_after(
    http: aiohttp.ClientSession,
) -> None:
    """No admission queue: the request over the in-flight limit is refused at once."""
    slow = await start_test_engine(engine_id="slow", time_scale=1.0)
    app = await start_router([slow.url], limits={"max_inflight": 1, "admission_queue": 0})
    try:
        body = {"prompt": "hold on " * 10, "max_tokens": 200, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as first:
            assert first.status == 200
            await first.content.readany()
            async with http.post(
                f"{app.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ) as second:
                assert second.status == 429
                assert second.headers["Retry-After"] == "1"
                error = (await second.json())["error"]
                assert error["type"] == "rate_limit_error"
                assert "in flight" in error["message"]
        assert app.admission.rejected["queue_full"] == 1
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_admission_rejected_total", reason="queue_full") == 1
        assert metric_sum(samples, "kvroute_admission_waiting") == 0
    finally:
        await app.stop()
        await slow.stop()


async def test_admission_queue_serves_waiters_in_order_then_times_out(
    http: aiohttp.ClientSession,
) -> None:
    """Over the limit, requests wait in arrival order and are served as slots free;
    one that waits past admission_timeout_s gets 429; the slot count returns to 0."""
    slow = await start_test_engine(engine_id="slowq", time_scale=1.0)
    app = await start_router(
        [slow.url], limits={"max_inflight": 1, "admission_queue": 4, "admission_timeout_s": 30}
    )
    try:
        finished: list[int] = []

        async def one(i: int, tokens: int) -> int:
            body = {"prompt": f"queued {i} " * 10, "max_tokens": tokens}
            async with http.post(f"{app.url}/v1/completions", json=body) as resp:
                await resp.read()
                finished.append(i)
                return resp.status

        first = asyncio.ensure_future(one(0, 40))
        await poll(lambda: app.admission.in_flight == 1)
        waiters = []
        for i in (1, 2, 3):
            waiters.append(asyncio.ensure_future(one(i, 1)))
            await poll(lambda i=i: app.admission.waiting == i)
        assert await first == 200
        assert await asyncio.gather(*waiters) == [200, 200, 200]
        assert finished == [0, 1, 2, 3]
        assert app.admission.in_flight == 0 and app.admission.waiting == 0

        app.config.limits.admission_timeout_s = 0.2
        body = {"prompt": "hold on " * 10, "max_tokens": 200, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as holder:
            await holder.content.readany()
            reply = await post_reply(
                http, f"{app.url}/v1/completions", {"prompt": "late", "max_tokens": 1}
            )
            assert reply.status == 429
            assert reply.headers["retry-after"] == "1"
            assert "waited" in reply.body["error"]["message"]
        assert app.admission.rejected["timeout"] == 1
        await poll(lambda: app.admission.in_flight == 0)
    finally:
        await app.stop()
        await slow.stop()


async def test_per_engine_limit_spreads_then_waits_then_429(
    http: aiohttp.ClientSession,
) -> None:
    """max_inflight_per_engine: a full engine stops being a candidate; with every
    engine full a request waits for room (served when one ends), then 429 at its
    deadline; the per-engine count never exceeds the limit."""
    engines = [await start_test_engine(engine_id=f"cap{i}", time_scale=1.0) for i in range(2)]
    app = await start_router(
        [e.url for e in engines],
        policy={"name": "kv_cost"},
        limits={"max_inflight_per_engine": 1, "admission_timeout_s": 30},
    )
    try:
        same = {"prompt": "the same long prefix " * 30, "max_tokens": 300, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=same) as a:
            await a.content.readany()
            async with http.post(f"{app.url}/v1/completions", json=same) as b:
                await b.content.readany()
                # same prefix, yet on the other engine: the first is full
                assert a.headers["x-kvroute-engine"] != b.headers["x-kvroute-engine"]
                third = asyncio.ensure_future(
                    post_reply(
                        http,
                        f"{app.url}/v1/completions",
                        {**same, "stream": False, "max_tokens": 1},
                    )
                )
                await poll(lambda: app.admission.waiting == 1)
                assert not third.done()
                await a.read()
                reply = await third
                assert reply.status == 200
                assert reply.headers["x-kvroute-engine"] == a.headers["x-kvroute-engine"]
                await b.read()
        assert max(load.requests for load in app.loads.view.values()) == 0

        app.config.limits.admission_timeout_s = 0.2
        async with http.post(f"{app.url}/v1/completions", json=same) as a:
            await a.content.readany()
            async with http.post(f"{app.url}/v1/completions", json=same) as b:
                await b.content.readany()
                reply = await post_reply(
                    http, f"{app.url}/v1/completions", {"prompt": "x", "max_tokens": 1}
                )
                assert reply.status == 429
                assert "requests in flight" in reply.body["error"]["message"]
        assert app.admission.rejected["engines_full"] == 1
    finally:
        await app.stop()
        for engine in engines:
            await engine.stop()


def record_writes(router: RouterApp, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, int]]:
    """What the router writes to its clients, each with the requests counted in flight
    on the engines at that moment (filled as the writes happen)."""
    writes: list[tuple[bytes, int]] = []

    def counted() -> int:
        return sum(load.requests for load in router.loads.view.values())

    write, whole = HttpDownstream.write, HttpDownstream.whole

    async def recording_write(self: HttpDownstream, chunk: bytes) -> None:
        writes.append((chunk, counted()))
        await write(self, chunk)

    async def recording_whole(
        self: HttpDownstream, status: int, headers: dict[str, str], body: bytes
    ) -> None:
        writes.append((body, counted()))
        await whole(self, status, headers, body)

    monkeypatch.setattr(HttpDownstream, "write", recording_write)
    monkeypatch.setattr(HttpDownstream, "whole", recording_whole)
    return writes


async def test_an_answer_leaves_the_engines_load_before_the_client_has_its_end(
    router: RouterApp, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends its next turn as soon as it reads the last event (as the
    OpenAI and Anthropic SDKs stop at it) must not find the turn before still counted on
    the engine that served it: the router's own load would push the conversation away
    from the engine holding its cache. So the ticket ends before the last event is
    written, not after the stream closes."""
    in_flight = record_writes(router, monkeypatch)  # (what was written, requests then)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}]}
    messages = {**chat, "max_tokens": 4}
    for path, body, end in (
        ("/v1/chat/completions", {**chat, "max_tokens": 4, "stream": True}, b"data: [DONE]"),
        ("/v1/messages", {**messages, "stream": True}, b"event: message_stop"),
        (
            "/v1/responses",
            {"model": MODEL, "input": "hi " * 50, "max_output_tokens": 4, "stream": True},
            b"event: response.completed",
        ),
        ("/v1/chat/completions", {**chat, "max_tokens": 4}, b'"choices"'),
    ):
        in_flight.clear()
        async with http.post(f"{router.url}{path}", json=body) as resp:
            assert resp.status == 200
            assert end in await resp.read()
        last = [n for chunk, n in in_flight if end in chunk]
        assert last == [0], (path, in_flight)  # the answer's end: off the load already
        assert max(n for _, n in in_flight) == 1 or len(in_flight) == 1  # before: counted
    assert sum(load.requests for load in router.loads.view.values()) == 0


@pytest.mark.parametrize("cut", ["whole", "inside_the_marker"])
async def test_a_stream_end_is_seen_however_the_bytes_arrive(
    router: RouterApp, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """TCP decides how an engine's stream is cut into reads, which a test cannot force on
    a real socket: here the router's reads of the upstream are regrouped (the bytes are
    the emulated engine's own) as one read holding the whole stream, or as reads cut
    inside ``data: [DONE]``. Either way the request leaves the load before the client
    is sent the end."""
    readany = Response.readany
    pending: dict[int, list[bytes]] = {}  # per response: the reads still to give

    async def regrouped(self: Response) -> bytes:
        if id(self) not in pending:
            parts = []
            while data := await readany(self):
                parts.append(data)
            whole = b"".join(parts)
            marker = whole.find(b"data: [DONE]")
            at = marker + 8 if cut == "inside_the_marker" and marker >= 0 else 0
            pending[id(self)] = [p for p in (whole[:at], whole[at:]) if p]
        reads = pending[id(self)]
        return reads.pop(0) if reads else b""

    monkeypatch.setattr(Response, "readany", regrouped)
    counts = record_writes(router, monkeypatch)
    body = {"model": MODEL, "prompt": "hi " * 30, "max_tokens": 3, "stream": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert counts[-1][1] == 0, counts  # the write that completes the end event
    if cut == "inside_the_marker":
        assert [n for _, n in counts] == [1, 0]


async def test_a_chat_is_checked_and_accounted_by_its_max_completion_tokens(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="mct", time_scale=1.0)
    app = await start_router([engine.url])
    url = f"{app.url}/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        status, payload = await post(http, url, {**chat, "max_completion_tokens": 2_000_000})
        assert (status, payload["error"]["param"]) == (400, "max_completion_tokens")
        body = {**chat, "max_completion_tokens": 300, "stream": True}
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            await resp.content.readany()
            load = app.loads.view[EngineKey(f"127.0.0.1:{engine.port}", 0)]
            assert load.requests == 1 and load.decode_tokens == 300
    finally:
        await app.stop()
        await engine.stop()


async def test_prompts_times_n_past_max_sequences_gets_400(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": ["a"] * 1_024, "n": 128, "max_tokens": 1}
    status, payload = await post(http, f"{router.url}/v1/completions", body)
    assert (status, payload["error"]["param"]) == (400, "n")
    assert "131072 sequences" in payload["error"]["message"]
    status, _ = await post(http, f"{router.url}/v1/completions", {**body, "n": 1})
    assert status == 200


# ---------------------------------------------------------------------------- failures


async def test_a_dead_engine_is_retried_around_then_ejected(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    doomed = await start_test_engine(engine_id="doomed")
    dead = doomed.url
    app = await start_router(
        [{"url": dead, "models": [MODEL]}, pair[0].url],
        policy={"name": "round_robin"},
        health={"interval_s": 30.0},
    )
    await doomed.stop()  # after its first probe admitted it: only requests notice
    try:
        for i in range(6):
            status, _ = await post(
                http, f"{app.url}/v1/completions", {"prompt": f"try {i}", "max_tokens": 1}
            )
            assert status == 200
        engine = app.registry.get(dead.removeprefix("http://"))
        assert engine is not None and engine.state is EngineState.EJECTED
        assert f"engine {dead} ejected after 3 failures in a row" in caplog.text
        samples = await metrics(http, app.url)
        assert sum(s.value for s in samples["kvroute_retries_total"]) >= 1
    finally:
        await app.stop()


async def test_no_reachable_engine_gives_502_then_503(http: aiohttp.ClientSession) -> None:
    doomed = await start_test_engine(engine_id="doomed")
    app = await start_router(
        [{"url": doomed.url, "models": [MODEL]}],
        health={"interval_s": 30.0, "eject_after_failures": 1},
    )
    await doomed.stop()
    try:
        status, payload = await post(
            http, f"{app.url}/v1/completions", {"model": MODEL, "prompt": "hi"}
        )
        assert status == 502 and payload["error"]["type"] == "bad_gateway"
        status, payload = await post(
            http, f"{app.url}/v1/completions", {"model": MODEL, "prompt": "hi"}
        )
        assert status == 503 and payload["error"]["type"] == "service_unavailable"
        assert (await get(http, f"{app.url}/ready"))[0] == 503
    finally:
        await app.stop()


async def test_an_engine_never_reachable_is_pending_and_not_ready(
    http: aiohttp.ClientSession,
) -> None:
    port = closed_port()
    app = await start_router([{"url": f"http://127.0.0.1:{port}", "models": [MODEL]}])
    engine = None
    try:
        record = app.registry.get(f"127.0.0.1:{port}")
        assert record is not None and record.state is EngineState.PENDING
        status, payload = await get(http, f"{app.url}/ready")
        assert (status, payload["reason"]) == (503, "no healthy engine")
        status, _ = await post(http, f"{app.url}/v1/completions", {"prompt": "hi"})
        assert status == 503
        engine = await start_test_engine(engine_id="late", port=port)
        await poll(lambda: record.state is EngineState.HEALTHY)
        status, payload = await get(http, f"{app.url}/ready")
        assert (status, payload["healthy_engines"]) == (200, 1)
        assert record.ejections == 0  # failing while pending is no ejection
    finally:
        await app.stop()
        if engine is not None:
            await engine.stop()


async def test_a_zmq_port_given_as_an_engine_is_one_warning_not_a_traceback_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--engine http://HOST:KV_EVENTS_PORT``, a first-day mix-up: the ZMQ socket greets
    and hangs up on every probe and scrape; the router says so once (issue 44, item 11)."""
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    caplog.set_level(logging.WARNING, logger="kvroute")
    app = await start_router([{"url": f"http://127.0.0.1:{port}", "models": [MODEL]}])
    try:
        record = app.registry.get(f"127.0.0.1:{port}")
        assert record is not None
        await poll(lambda: record.failures >= 20)  # 20 probes, and the scrapes beside them
        assert record.state is EngineState.PENDING
        assert [r.levelname for r in caplog.records if r.name.startswith("kvroute")] == ["WARNING"]
        assert f"engine http://127.0.0.1:{port} not ready yet" in caplog.text
    finally:
        await app.stop()
        publisher.close()


async def test_an_engine_that_goes_away_is_ejected_and_readmitted_when_back(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="flaky")
    port = engine.port
    app = await start_router([engine.url])
    try:
        record = app.registry.get(f"127.0.0.1:{port}")
        assert record is not None
        await engine.stop()
        await poll(lambda: record.state is EngineState.EJECTED)
        assert (await get(http, f"{app.url}/ready"))[0] == 503
        engine = await start_test_engine(engine_id="flaky", port=port)
        await poll(lambda: record.state is EngineState.HEALTHY, timeout=10)
        status, _ = await post(
            http, f"{app.url}/v1/completions", {"prompt": "back", "max_tokens": 1}
        )
        assert status == 200
    finally:
        await app.stop()
        await engine.stop()


async def test_a_client_that_leaves_cancels_the_engine_request(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="slowpoke", time_scale=1.0)
    app = await start_router([engine.url])
    try:
        body = {"prompt": "long answer " * 10, "max_tokens": 5000, "stream": True}
        resp = await http.post(f"{app.url}/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readany()
        assert engine.state.drivers[0].model.stats().num_running == 1
        resp.close()  # the client goes away mid-stream
        await poll(lambda: engine.state.drivers[0].model.stats().num_running == 0)
        await poll(lambda: app.core.loads.in_flight == 0)
        samples = await metrics(http, app.url)
        cancelled = [
            s for s in samples["kvroute_requests_total"] if s.labels["outcome"] == "cancelled"
        ]
        assert cancelled and cancelled[0].value == 1
    finally:
        await app.stop()
        await engine.stop()


@pytest.mark.parametrize("ends", ["before", "as"])
@pytest.mark.parametrize(
    ("path", "body", "last"),
    [
        ("/v1/completions", {"prompt": "hi", "stream": True}, b"data: [DONE]\n\n"),
        (
            "/v1/messages",
            {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            b"event: message_stop\n",
        ),
    ],
)
async def test_a_client_that_closes_on_the_last_event_is_counted_not_logged(
    ends: str,
    path: str,
    body: dict[str, object],
    last: bytes,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Many clients close as they read ``data: [DONE]`` (or ``message_stop``), before
    the stream's closing bytes. Whether the close reaches the router before the engine's
    end (the handler is cancelled) or as it arrives (the end cannot be written), the
    answer was whole: an ``ok`` request, counted, and nothing logged above debug level
    (issue 44, item 12: an ERROR with a traceback)."""
    engine = HeldStreamEngine()
    app = await start_router(
        [{"url": await engine.start(), "models": [MODEL]}], health={"interval_s": 30.0}
    )
    caplog.set_level(logging.DEBUG, logger="kvroute")
    try:
        client = await StreamingClient.post(
            "127.0.0.1",
            urlsplit(app.url).port or 0,
            path,
            json.dumps({"model": MODEL, **body}).encode(),
        )
        await client.read_until(last)
        if ends == "before":
            client.leave()
        else:
            engine.end()  # the engine's last chunk, then the client's close: one poll
            client.leave()

        async def served() -> bool:
            samples = await metrics(http, app.url)
            return metric_sum(samples, "kvroute_requests_total") == 1

        await poll(served)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", outcome="ok") == 1
        assert metric_sum(samples, "kvroute_client_gone_at_end_total") == 1
        assert [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG] == []
    finally:
        await app.stop()
        await engine.stop()


async def test_a_non_streaming_client_that_leaves_cancels_the_engine_request(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="slowpoke-plain", time_scale=1.0)
    app = await start_router([engine.url])
    try:
        aborted = "kvroute_emulator_aborted_requests_total"
        before = metric_sum(await metrics(http, engine.url), aborted)
        body = {"prompt": "a long answer " * 10, "max_tokens": 5_000}  # minutes at scale 1
        task = asyncio.ensure_future(http.post(f"{app.url}/v1/completions", json=body))
        model = engine.state.drivers[0].model
        await poll(lambda: model.stats().num_running == 1)
        assert app.core.loads.in_flight == 1
        task.cancel()  # the client goes away before any byte of the answer
        with pytest.raises(asyncio.CancelledError):
            await task
        await poll(lambda: model.stats().num_running == 0)

        async def counted() -> bool:  # the engine saw the abort
            return metric_sum(await metrics(http, engine.url), aborted) == before + 1

        await poll(counted)
        await poll(lambda: app.core.loads.in_flight == 0)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", outcome="cancelled") == 1
    finally:
        await app.stop()
        await engine.stop()


async def test_engine_metrics_are_scraped_into_the_load_view(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="scraped", time_scale=1.0)
    app = await start_router([engine.url])
    key = EngineKey(f"127.0.0.1:{engine.port}")
    try:
        body = {"prompt": "keep running " * 10, "max_tokens": 5_000, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            await resp.content.readany()
            # the engine's own vllm:num_requests_running reaches the load view
            await poll(
                lambda: (
                    (load := app.core.loads.view.get(key)) is not None
                    and load.running == 1
                    and load.reported_at is not None
                )
            )
            assert app.core.loads.view[key].kv_usage > 0
        await poll(lambda: app.core.loads.view[key].running == 0)
    finally:
        await app.stop()
        await engine.stop()


async def test_every_exposed_metric_is_documented(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    await post(http, f"{router.url}/v1/completions", {"prompt": "doc me", "max_tokens": 1})
    async with http.get(f"{router.url}/metrics") as resp:
        text = await resp.text()
    exposed = {
        f.name for f in text_string_to_metric_families(text) if f.name.startswith("kvroute_")
    }
    assert exposed and exposed <= documented_metrics(), exposed - documented_metrics()


async def test_an_error_inside_the_router_is_a_503_counted_as_router_error(
    router: RouterApp, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(router.decider, "prepare", broken)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "router_error"
    samples = await metrics(http, router.url)
    counted = metric_sum(samples, "kvroute_requests_total", outcome="router_error", status="503")
    assert counted == 1
    assert metric_sum(samples, "kvroute_requests_total", outcome="cancelled") == 0

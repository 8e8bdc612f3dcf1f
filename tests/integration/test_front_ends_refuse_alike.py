"""Each front end writes intake's refusal in its own form, with intake's message: the
HTTP API (the status with OpenAI error JSON), gRPC Pick and Generate (the matching status
code, the message as details), Envoy ext_proc (an ImmediateResponse with the status and
the same JSON). What is refused, and why, is decided once by intake and tested once,
table-driven, in ``test_intake.py``; here, one error-mapping test per front end, each on
a few refusals of every kind (the body, a limit, the model) and one request that passes,
on one router."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from support.clients import metric_sum, metrics
from support.grpc_clients import connect, generate
from support.intake import refusal
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.frontends.grpc.api import status_code
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.serving.errors import ApiError

LIMITS = {"max_n": 2, "max_prompts": 2, "max_prompt_tokens": 8, "max_json_depth": 4}
MODEL = "kvroute-emulated"
"""The shared engine serves it and one LoRA adapter, ``sql-adapter``."""
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def raw(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


#: (endpoint, body): one refusal of each kind intake has.
REFUSED: list[tuple[str, bytes]] = [
    ("completions", b"{not json"),  # the body: no param
    ("completions", raw({"model": MODEL, "prompt": "x", "extra": [[[[1]]]]})),
    ("completions", raw({"model": MODEL, "prompt": "x", "n": 3})),  # a limit
    ("completions", raw({"model": MODEL, "prompt": "w0 w1 w2 w3 w4 w5 w6 w7 w8"})),
    ("chat", raw({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 3})),
    ("completions", raw({"model": "nope", "prompt": "x"})),  # the model: 404
]
ACCEPTED = ("chat", raw({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))


async def expected(app: RouterApp) -> list[tuple[str, bytes, ApiError]]:
    """Each refusal with the error intake gives it on ``app``."""
    return [(endpoint, body, await refusal(app, endpoint, body)) for endpoint, body in REFUSED]


@pytest_asyncio.fixture(scope="module")
async def router(shared_engine: EmulatedEngine) -> AsyncIterator[RouterApp]:
    app = await start_router(
        [shared_engine.url], grpc={"port": 0}, extproc={"port": 0}, limits=LIMITS
    )
    yield app
    await app.stop()


# --------------------------------------------------------------------------- one per front end


async def via_http(
    http: aiohttp.ClientSession, app: RouterApp, endpoint: str, raw: bytes
) -> tuple[int, str | None]:
    async with http.post(
        app.url + PATHS[endpoint], data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        answer = await resp.json()
        return resp.status, answer["error"]["message"] if resp.status >= 400 else None


async def via_pick(app: RouterApp, endpoint: str, raw: bytes) -> tuple[grpc.StatusCode, str | None]:
    async with connect(app.grpc_port) as stubs:
        try:
            pick = await stubs.router.Pick(pb.PickRequest(body=raw))
        except aio.AioRpcError as err:
            return err.code(), err.details()
        await stubs.router.Release(pb.ReleaseRequest(request_id=pick.request_id))
        return grpc.StatusCode.OK, None


async def via_generate(
    app: RouterApp, endpoint: str, raw: bytes
) -> tuple[grpc.StatusCode, str | None]:
    kind = pb.ENDPOINT_CHAT_COMPLETIONS if endpoint == "chat" else pb.ENDPOINT_COMPLETIONS
    async with connect(app.grpc_port) as stubs:
        try:
            answer = await generate(stubs.router, raw, endpoint=kind)
        except aio.AioRpcError as err:
            return err.code(), err.details()
        assert answer.status == 200
        return grpc.StatusCode.OK, None


async def via_extproc(app: RouterApp, endpoint: str, raw: bytes) -> tuple[int, Any]:
    """Envoy's FULL_DUPLEX_STREAMED request: headers, then the body with end of stream."""
    pairs = {":method": "POST", ":path": PATHS[endpoint], "content-type": "application/json"}
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers)))
        body = ep.HttpBody(body=raw, end_of_stream=True)
        await call.write(ep.ProcessingRequest(request_body=body))
        first = await call.read()
        await call.done_writing()  # as Envoy at the end of a request: the load is released
        while await call.read() is not aio.EOF:
            pass
    if first.WhichOneof("response") == "immediate_response":
        answer = first.immediate_response
        content_type = [h for h in answer.headers.set_headers if h.header.key == "content-type"]
        assert [h.header.raw_value for h in content_type] == [b"application/json"]
        return answer.status.code, json.loads(answer.body)
    assert first.WhichOneof("response") == "request_headers"
    return 200, None


def grown(before: dict[str, Any], after: dict[str, Any], name: str, **labels: str) -> float:
    """How much a counter grew between two scrapes."""
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


# --------------------------------------------------------------------------- tests


async def test_http_writes_the_status_and_openai_error_json(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    for endpoint, body, err in await expected(router):
        async with http.post(
            router.url + PATHS[endpoint], data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == err.status and resp.content_type == "application/json"
            assert await resp.json() == err.payload(), body
    assert await via_http(http, router, *ACCEPTED) == (200, None)
    assert router.loads.in_flight == 0


async def test_pick_gives_the_status_code_and_the_message(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    before = await metrics(http, router.url)
    cases = await expected(router)
    for endpoint, body, err in cases:
        assert await via_pick(router, endpoint, body) == (status_code(err.status), err.message)
    assert await via_pick(router, *ACCEPTED) == (grpc.StatusCode.OK, None)
    assert router.picks.open_count == 0 and router.loads.in_flight == 0
    after = await metrics(http, router.url)
    for code in ("INVALID_ARGUMENT", "NOT_FOUND"):
        count = sum(status_code(err.status).name == code for *_, err in cases)
        assert grown(before, after, "kvroute_grpc_requests_total", method="Pick", code=code) == (
            count
        ), code


async def test_generate_gives_the_status_code_and_the_message(router: RouterApp) -> None:
    for endpoint, body, err in await expected(router):
        assert await via_generate(router, endpoint, body) == (status_code(err.status), err.message)
    assert await via_generate(router, *ACCEPTED) == (grpc.StatusCode.OK, None)
    assert router.loads.in_flight == 0


async def test_extproc_answers_an_immediate_response_with_the_status_and_json(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    before = await metrics(http, router.url)
    cases = await expected(router)
    for endpoint, body, err in cases:
        assert await via_extproc(router, endpoint, body) == (err.status, err.payload()), body
    assert await via_extproc(router, *ACCEPTED) == (200, None)
    assert router.loads.in_flight == 0 and router.picks.open_count == 0
    after = await metrics(http, router.url)
    refused = grown(before, after, "kvroute_extproc_requests_total", outcome="client_error")
    assert refused == len(cases)

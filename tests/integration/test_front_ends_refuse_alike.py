"""The same bad request is refused by every front end with the same message: the HTTP
API (400/404 with OpenAI error JSON), gRPC Pick and Generate (the matching status code),
Envoy ext_proc (an ImmediateResponse with the same status and JSON), one router each."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from support.grpc_clients import connect, generate
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.frontends.grpc.api import status_code
from router.grpc.gen.kvroute.v1 import router_pb2 as pb

LIMITS = {
    "max_n": 2,
    "max_prompts": 2,
    "max_sequences": 3,
    "max_prompt_tokens": 8,
    "max_output_tokens": 16,
    "max_json_depth": 4,
}
MODEL = "kvroute-emulated"
"""The shared engine serves it and one LoRA adapter, ``sql-adapter``."""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

#: (case, endpoint, body, HTTP status, what the message says)
REFUSED: list[tuple[str, str, dict[str, Any], int, str]] = [
    (
        "n over max_n",
        "completions",
        {"model": MODEL, "prompt": "x", "n": 3},
        400,
        "'n' must be at most 2",
    ),
    (
        "too many prompts",
        "completions",
        {"model": MODEL, "prompt": ["a", "b", "c"]},
        400,
        "at most 2 prompts per request, got 3",
    ),
    (
        "too many messages",
        "chat",
        {**CHAT, "messages": CHAT["messages"] * 3},
        400,
        "at most 2 messages per request, got 3",
    ),
    (
        "prompts x n over max_sequences",
        "completions",
        {"model": MODEL, "prompt": ["a", "b"], "n": 2},
        400,
        "this request asks for 4 sequences",
    ),
    (
        "prompt over max_prompt_tokens",
        "completions",
        {"model": MODEL, "prompt": "w0 w1 w2 w3 w4 w5 w6 w7 w8"},
        400,
        "the prompt has 9 tokens; this router accepts at most 8",
    ),
    (
        "max_tokens over max_output_tokens",
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 17},
        400,
        "'max_tokens' must be at most 16",
    ),
    (
        "max_completion_tokens over max_output_tokens",
        "chat",
        {**CHAT, "max_completion_tokens": 17},
        400,
        "'max_completion_tokens' must be at most 16",
    ),
    (
        "max_tokens under the least an engine runs",
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        400,
        "'max_tokens' must be at least 1, got 0",
    ),
    (
        "max_completion_tokens under the least an engine runs",
        "chat",
        {**CHAT, "max_tokens": 5, "max_completion_tokens": 0},
        400,
        "'max_completion_tokens' must be at least 1, got 0",
    ),
    (
        "max_tokens not an integer",
        "chat",
        {**CHAT, "max_tokens": "ten"},
        400,
        "'max_tokens' must be an integer",
    ),
    ("unknown model", "completions", {"prompt": "x", "model": "nope"}, 404, "'nope'"),
    (
        "unknown LoRA adapter",
        "completions",
        {"prompt": "x", "model": "sql-adapter-2"},
        404,
        "The model 'sql-adapter-2' does not exist",
    ),
    (
        "no model while several are served",
        "chat",
        {"messages": CHAT["messages"]},
        400,
        "'model' is required when several models are served",
    ),
    (
        "JSON over max_json_depth",
        "completions",
        {"model": MODEL, "prompt": "x", "extra": [[[[1]]]]},
        400,
        "nests JSON deeper than 4 levels",
    ),
]


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
            answer = await generate(stubs.router, json.loads(raw), endpoint=kind)
        except aio.AioRpcError as err:
            return err.code(), err.details()
        assert answer.status == 200
        return grpc.StatusCode.OK, None


async def via_extproc(app: RouterApp, endpoint: str, raw: bytes) -> tuple[int, str | None]:
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
        refusal = first.immediate_response
        return refusal.status.code, json.loads(refusal.body)["error"]["message"]
    assert first.WhichOneof("response") == "request_headers"
    return 200, None


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("endpoint", "payload", "status", "needle"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_every_front_end_refuses_it_with_the_same_message(
    router: RouterApp,
    http: aiohttp.ClientSession,
    endpoint: str,
    payload: dict[str, Any],
    status: int,
    needle: str,
) -> None:
    raw = json.dumps(payload).encode()
    got_status, message = await via_http(http, router, endpoint, raw)
    assert got_status == status and message is not None and needle in message, message
    assert await via_pick(router, endpoint, raw) == (status_code(status), message)
    assert await via_generate(router, endpoint, raw) == (status_code(status), message)
    assert await via_extproc(router, endpoint, raw) == (status, message)
    assert router.loads.in_flight == 0 and router.picks.open_count == 0


@pytest.mark.parametrize(
    ("endpoint", "payload"),
    [
        (
            "completions",
            {"model": MODEL, "prompt": "w0 w1 w2 w3 w4 w5 w6 w7", "max_tokens": 16, "n": 1},
        ),
        ("completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}),
        ("chat", {**CHAT, "messages": CHAT["messages"] * 2, "max_completion_tokens": 16, "n": 2}),
        ("completions", {"model": "sql-adapter", "prompt": "x", "max_tokens": 2}),
        ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": True}),
    ],
    ids=[
        "at every bound",
        "two prompts",
        "chat at its bounds",
        "a served LoRA adapter",
        "the prompt echoed alone",
    ],
)
async def test_every_front_end_accepts_a_request_within_the_limits(
    router: RouterApp, http: aiohttp.ClientSession, endpoint: str, payload: dict[str, Any]
) -> None:
    raw = json.dumps(payload).encode()
    assert await via_http(http, router, endpoint, raw) == (200, None)
    assert await via_pick(router, endpoint, raw) == (grpc.StatusCode.OK, None)
    assert await via_generate(router, endpoint, raw) == (grpc.StatusCode.OK, None)
    assert await via_extproc(router, endpoint, raw) == (200, None)
    assert router.loads.in_flight == 0

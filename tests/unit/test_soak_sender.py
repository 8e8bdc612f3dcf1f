"""The soak's strict sender (router.bench.soak.sender) against a real HTTP server on
loopback: an answer, a clean error and a lost request each count as what they are."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from support.clients import session

from router.bench.loadgen import request_body
from router.bench.soak.sender import RequestMix, send
from router.workloads.spec import RequestSpec

ERROR = b'{"error": {"message": "engine gone", "type": "bad_gateway", "code": 502}}'


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    shape = body["prompt"]
    if shape == "http-error":
        return web.Response(status=503, body=ERROR.replace(b"502", b"503"))
    if shape == "html-error":
        return web.Response(status=502, text="<html>bad gateway</html>")
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "hi"}]})
    resp = web.StreamResponse(headers={"x-kvroute-engine": "127.0.0.1:9001"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"text": "hi"}]}\n\n')
    if shape == "sse-error":
        await resp.write(b"data: " + ERROR + b"\n\ndata: [DONE]\n\n")
    elif shape != "cut":
        await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest_asyncio.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("prompt", "stream", "answered", "reason", "lost"),
    [
        ("ok", True, True, "", False),
        ("ok", False, True, "", False),
        ("sse-error", True, False, "sse-502", False),
        ("http-error", False, False, "http-503", False),
        ("html-error", False, False, "http-502 without an OpenAI error body", True),
        ("cut", True, False, "stream ended without [DONE]", True),
    ],
)
async def test_each_answer_counts_as_what_it_is(
    server: str, prompt: str, stream: bool, answered: bool, reason: str, lost: bool
) -> None:
    spec = RequestSpec(prompt=prompt, max_tokens=4, extra={"stream": stream})
    async with session() as client:
        out = await send(client, server, spec, origin=0.0)
    assert (out.answered, out.reason, out.lost) == (answered, reason, lost)
    assert out.kind == "completion" + "-stream" * stream
    assert out.ended_at >= out.sent_at


def test_the_request_body_asks_a_stream_for_its_usage() -> None:
    spec = RequestSpec(messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    path, body = request_body(spec, stream=True, model="m")
    assert path == "/v1/chat/completions"
    assert body == {
        "max_tokens": 8,
        "stream": True,
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True},
    }
    path, body = request_body(RequestSpec(prompt="p", max_tokens=2), stream=False)
    assert (path, body) == ("/v1/completions", {"max_tokens": 2, "stream": False, "prompt": "p"})


def test_the_mix_is_the_same_for_a_seed() -> None:
    first, second = RequestMix(3), RequestMix(3)
    specs = [(first.next(), second.next()) for _ in range(20)]
    assert all(a == b for a, b in specs)
    assert {bool(a.messages) for a, _ in specs} == {True, False}

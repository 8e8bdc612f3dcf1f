"""Hostile client input that used to be answered as the router's own failure (503
``router_error``, gRPC ``UNAVAILABLE``) is the client's mistake: 400 in OpenAI's form,
gRPC ``INVALID_ARGUMENT`` (issue 19, items 5, 6 and 7), on ``kvroute serve``, its admin
API, gRPC and the sidecar."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import grpc
import pytest
import pytest_asyncio
from support.clients import metric, metrics
from support.grpc_clients import connect, rpc_error
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.frontends.sidecar import start_sidecar
from router.grpc.gen.kvroute.v1 import router_pb2 as pb

MODEL = "kvroute-emulated"
BODY = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 1}).encode()
#: Header bytes a client library would refuse to send: Latin-1, UTF-8, invalid UTF-8.
BAD_VALUES = [b"\xe9", "caf\u00e9 \u20ac".encode(), b"\xff\xfe"]
HEADERS = [b"Authorization: Bearer ", b"X-Session-Id: ", b"X-Request-Id: "]


async def raw_post(url: str, path: str, body: bytes, extra: bytes = b"") -> tuple[int, bytes]:
    """POST raw bytes over a fresh connection; (status, body) of the answer."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + extra
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def openai_error(payload: bytes) -> dict:
    error = json.loads(payload)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] != "router_error"
    return error


@pytest_asyncio.fixture
async def router(engine: EmulatedEngine) -> AsyncIterator[RouterApp]:
    app = await start_router([engine.url], grpc={"port": 0}, policy={"name": "session"})
    yield app
    await app.stop()


@pytest_asyncio.fixture
async def sidecar(engine: EmulatedEngine) -> AsyncIterator[str]:
    runner, sidecar, url = await start_sidecar(engine.url, ["127.0.0.0/8"])
    yield url
    await runner.cleanup()
    await sidecar.close()


def nested_in_a_list_member(depth: int) -> bytes:
    """The issue's bypass: nesting inside a list that starts and ends with scalars."""
    return (
        b'{"model": "kvroute-emulated", "prompt": "a", "max_tokens": 1, "x": [1, '
        + b"[" * depth
        + b"]" * depth
        + b", 1]}"
    )


# ---------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("name", HEADERS)
@pytest.mark.parametrize("value", BAD_VALUES)
async def test_a_header_that_is_not_ascii_is_a_400(
    router: RouterApp, sidecar: str, name: bytes, value: bytes
) -> None:
    for url in (router.url, sidecar):
        status, payload = await raw_post(url, "/v1/completions", BODY, name + value + b"\r\n")
        assert status == 400, (url, payload)
        assert openai_error(payload)["type"] == "invalid_request_error"


async def test_a_header_that_is_not_ascii_is_a_400_with_api_keys_too(
    engine: EmulatedEngine,
) -> None:
    app = await start_router([engine.url], auth={"api_keys": ["k1"]})
    try:
        for value in BAD_VALUES:
            extra = b"Authorization: Bearer " + value + b"\r\n"
            status, payload = await raw_post(app.url, "/v1/completions", BODY, extra)
            assert status == 400, payload
            status, payload = await raw_post(app.url, "/admin/engines", b"{}", extra)
            assert status == 400, payload
    finally:
        await app.stop()


@pytest.mark.parametrize("name", ["authorization", "x-session-id", "x-request-id"])
async def test_a_generate_header_that_is_not_ascii_is_invalid_argument(
    router: RouterApp, name: str
) -> None:
    async with connect(router.grpc_port) as stubs:
        for value in ("caf\u00e9", "\u20ac", "a\u0000b"):
            request = pb.GenerateRequest(body=BODY, headers={name: value})
            code, message = await rpc_error(_drain(stubs.router.Generate(request)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
            assert name in message
            pick = pb.PickRequest(text="hello", headers={name: value})
            code, message = await rpc_error(stubs.router.Pick(pick))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)


async def _drain(call: object) -> list[object]:
    return [chunk async for chunk in call]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- item 6


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", b"this is not gzip"),
        ("gzip", gzip.compress(BODY, mtime=0)[:-8]),  # cut short
        ("deflate", b"this is not deflate either"),
        ("br", b"\x0b\x02\x80hello\x03"),
        ("compress", b"x"),
        ("gzip", b""),
    ],
)
async def test_a_body_that_does_not_decode_is_a_400(
    router: RouterApp, sidecar: str, encoding: str, body: bytes
) -> None:
    for url in (router.url, sidecar):
        extra = f"Content-Encoding: {encoding}\r\n".encode()
        status, payload = await raw_post(url, "/v1/completions", body, extra)
        assert status == 400, (url, payload)
        openai_error(payload)


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", gzip.compress(BODY, mtime=0)),
        (
            "x-gzip",
            gzip.compress(BODY[:20], mtime=0) + gzip.compress(BODY[20:], mtime=0),
        ),  # two members
        ("deflate", zlib.compress(BODY)),
        ("deflate", zlib.compress(BODY)[2:-4]),  # raw deflate, as some clients send it
        ("gzip, deflate", zlib.compress(gzip.compress(BODY, mtime=0))),
        ("identity", BODY),
    ],
)
async def test_compressed_bodies_are_served(
    router: RouterApp, sidecar: str, encoding: str, body: bytes
) -> None:
    for url in (router.url, sidecar):
        extra = f"Content-Encoding: {encoding}\r\n".encode()
        status, payload = await raw_post(url, "/v1/completions", body, extra)
        assert status == 200, (url, payload)
        assert json.loads(payload)["choices"]


async def test_a_gzip_bomb_is_a_413_at_the_decoded_limit(engine: EmulatedEngine) -> None:
    app = await start_router([engine.url], limits={"max_body_bytes": 1 << 20})
    try:
        bomb = gzip.compress(b" " * (64 << 20), 9)
        assert len(bomb) < 1 << 20
        extra = b"Content-Encoding: gzip\r\n"
        status, payload = await raw_post(app.url, "/v1/completions", bomb, extra)
        assert status == 413, payload
        assert "1048576" in openai_error(payload)["message"]
    finally:
        await app.stop()


# ---------------------------------------------------------------------------- item 7


async def test_deep_nesting_inside_a_list_member_is_a_400(router: RouterApp) -> None:
    status, payload = await raw_post(router.url, "/v1/completions", nested_in_a_list_member(900))
    assert status == 400, payload
    assert "deeper" in openai_error(payload)["message"]
    shallow = nested_in_a_list_member(20)
    assert (await raw_post(router.url, "/v1/completions", shallow))[0] == 200


@pytest.mark.parametrize("depth", [40, 900, 5_000])
async def test_deep_nesting_on_the_admin_api_and_the_sidecar_is_a_400(
    router: RouterApp, sidecar: str, depth: int
) -> None:
    deep = b'{"url": "http://127.0.0.1:1", "x": ' + b"[" * depth + b"]" * depth + b"}"
    status, payload = await raw_post(router.url, "/admin/engines", deep)
    assert status == 400, payload
    openai_error(payload)
    target = b"X-Prefiller-Host-Port: 127.0.0.1:1\r\n"
    for body in (nested_in_a_list_member(depth), b"[" * depth + b"]" * depth):
        for extra in (target, b""):  # a split, and a request passed straight through
            status, payload = await raw_post(sidecar, "/v1/completions", body, extra)
            assert status == 400, payload
            openai_error(payload)


async def test_the_sidecar_refuses_a_body_it_cannot_strip_handoff_fields_from(
    sidecar: str,
) -> None:
    """A body the sidecar cannot decode is not passed on: an engine's laxer JSON parser
    (``NaN``) would still find the client's ``kv_transfer_params`` in it."""
    body = (
        b'{"model": "kvroute-emulated", "prompt": "a", "max_tokens": 1, "x": NaN, '
        b'"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.2", '
        b'"remote_port": 17006}}'
    )
    status, payload = await raw_post(sidecar, "/v1/completions", body)
    assert status == 400, payload
    assert "not valid JSON" in openai_error(payload)["message"]  # the sidecar's, not the engine's
    status, payload = await raw_post(sidecar, "/v1/completions", BODY)
    assert status == 200, payload


async def test_deep_nesting_on_generate_is_invalid_argument(router: RouterApp) -> None:
    async with connect(router.grpc_port) as stubs:
        for body in (nested_in_a_list_member(900), b'{"prompt": "a", "x": ' + b"[" * 5000):
            request = pb.GenerateRequest(body=body)
            code, message = await rpc_error(_drain(stubs.router.Generate(request)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)


# ------------------------------------------------------------ issue 44, items 8 and 10


async def raw_exchange(url: str, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` as it is over a fresh connection; (status, body) of the answer."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


#: Requests aiohttp's parser refuses before any kvroute code runs, by what is wrong.
MALFORMED = {
    "request line": b"GARBAGE\r\n\r\n",
    "header token": b"GET /health HTTP/1.1\r\nHo\x00st: x\r\n\r\n",
    "content length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ab\r\n\r\n",
    "length and chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"\r\nzz\r\n{}\r\n0\r\n\r\n",
    "header line too long": b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 10_000 + b"\r\n\r\n",
    "TLS on the HTTP port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages", "/no/such/route"])
@pytest.mark.parametrize("value", [b"\xff\xfe", b"caf\xe9", b"100-continue\xff"])
async def test_an_expect_header_that_is_not_utf8_is_a_400(
    router: RouterApp, sidecar: str, path: str, value: bytes
) -> None:
    """aiohttp answered 500 (it could not quote the value in its 417): issue 44, item 8."""
    for url in (router.url, sidecar):
        status, payload = await raw_post(url, path, BODY, b"Expect: " + value + b"\r\n")
        assert status == 400, (url, payload)
        assert "Expect" in json.loads(payload)["error"]["message"]


async def test_an_expect_of_100_continue_is_still_honoured(router: RouterApp) -> None:
    status, payload = await raw_post(
        router.url, "/v1/completions", BODY, b"Expect: 100-continue\r\n"
    )
    assert status == 100 and b"HTTP/1.1 200 OK" in payload


@pytest.mark.parametrize("kind", MALFORMED)
async def test_a_malformed_request_is_a_400_in_openai_form_and_no_error_log(
    router: RouterApp, sidecar: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Client garbage was an ERROR with a traceback per request (issue 44, item 10)."""
    caplog.set_level(logging.WARNING)
    for url in (router.url, sidecar):
        status, payload = await raw_exchange(url, MALFORMED[kind])
        assert status == 400, (url, payload)
        assert openai_error(payload)["message"].startswith("malformed HTTP request: ")
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_malformed_requests_are_counted_and_warned_about_once_a_minute(
    engine: EmulatedEngine, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    app = await start_router([engine.url])
    caplog.set_level(logging.WARNING, logger="kvroute.http")
    try:
        for data in [*MALFORMED.values(), *MALFORMED.values()]:
            assert (await raw_exchange(app.url, data))[0] == 400
        samples = await metrics(http, app.url)
        assert metric(samples, "kvroute_http_malformed_requests_total") == 2 * len(MALFORMED)
        (warning,) = [r for r in caplog.records if r.name == "kvroute.http"]
        assert warning.levelno == logging.WARNING and warning.exc_info is None
        assert "malformed request" in warning.getMessage()
        assert "Invalid method" in warning.getMessage()  # the first one's reason
    finally:
        await app.stop()

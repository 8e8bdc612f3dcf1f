"""Slow and idle clients of the HTTP listeners (``kvroute serve``, the sidecar): the
connection cap and the header, body and keep-alive timeouts, and the in-flight slots
that unread bodies hold and give back (issue 19, item 4)."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric, metric_sum, metrics, post
from support.engines import poll
from support.routers import StartRouter, start_router

from router.app import RouterApp
from router.config import ServerConfig
from router.emulator import EmulatedEngine
from router.frontends.sidecar import start_sidecar
from router.process import ServerProcess

MODEL = "kvroute-emulated"
BODY = b'{"model": "kvroute-emulated", "prompt": "hello there", "max_tokens": 2}'
#: Short timeouts keep the tests fast; the defaults are checked on their own below.
# The keep-alive timer runs from the connection's start: kept longer than the header
# timeout, so that a dripped head meets the header timeout first.
TIMEOUTS = {"header_timeout_s": 1.0, "body_timeout_s": 1.5, "keepalive_timeout_s": 2.0}


class Client:
    """One raw TCP client of a listener: it sends what it is told, when it is told."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Client:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> bool:
        """Send ``data``; False if the listener has closed the connection."""
        try:
            self.writer.write(data)
            await self.writer.drain()
            return True
        except (ConnectionError, OSError):
            return False

    async def answer(self, timeout: float) -> bytes:
        """Everything the listener sends until it closes (b"" for a bare close)."""
        return await asyncio.wait_for(self._until_closed(), timeout)

    async def _until_closed(self) -> bytes:
        data = b""
        while True:
            try:
                chunk = await self.reader.read(65536)
            except (ConnectionError, OSError):
                return data
            if not chunk:
                return data
            data += chunk

    def close(self) -> None:
        self.writer.close()


def head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def unfinished_body(url: str) -> Client:
    """A client whose body stops half-way."""
    client = await Client.open(url)
    await client.send(head(len(BODY)) + BODY[:10])
    return client


async def drip_head(client: Client, interval: float, stop: asyncio.Event) -> None:
    """Send a request head a byte at a time until the listener closes or ``stop``."""
    for byte in head(len(BODY)):
        if stop.is_set() or not await client.send(bytes([byte])):
            return
        await asyncio.sleep(interval)


@pytest_asyncio.fixture
async def slow_router(engine: EmulatedEngine) -> AsyncIterator[RouterApp]:
    app = await start_router(
        [engine.url],
        server=TIMEOUTS,
        limits={"max_inflight": 4, "admission_timeout_s": 0.2},
    )
    yield app
    await app.stop()


def test_the_defaults_are_sane() -> None:
    server = ServerConfig()
    assert 1 <= server.header_timeout_s <= 60
    assert 1 <= server.body_timeout_s <= 120
    assert server.keepalive_timeout_s > 60  # above a load balancer's usual idle timeout
    assert 1_000 < server.max_connections <= 65_536


async def test_unfinished_bodies_give_their_slots_back_at_the_body_timeout(
    engine: EmulatedEngine, http: aiohttp.ClientSession, routers: StartRouter
) -> None:
    """Four unfinished bodies hold all four in-flight slots (counted, 429 for others),
    until the body timeout answers them 408, closes them and frees the slots. The body
    timeout is longer than the other tests': what is checked while the bodies hang must
    happen before it, however busy the machine."""
    slow_router = await routers(
        [engine.url],
        server={**TIMEOUTS, "body_timeout_s": 6.0},
        limits={"max_inflight": 4, "admission_timeout_s": 0.2},
    )
    url = slow_router.url
    held = [await unfinished_body(url) for _ in range(4)]
    await poll(lambda: slow_router.admission.reading_body == 4, timeout=5)
    samples = await metrics(http, url)
    assert metric(samples, "kvroute_admission_reading_body") == 4
    assert metric(samples, "kvroute_admission_inflight") == 4
    status, _ = await post(
        http, f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    )
    assert status == 429
    started = time.monotonic()
    answers = await asyncio.gather(*(c.answer(timeout=15) for c in held))
    assert time.monotonic() - started < 6 + 8
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "request_timeout" and "6 s" in error["message"]
    assert slow_router.admission.in_flight == 0
    assert slow_router.admission.reading_body == 0
    status, _ = await post(
        http, f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    )
    assert status == 200
    samples = await metrics(http, url)
    assert metric_sum(samples, "kvroute_http_timeouts_total", phase="body") == 4


async def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_header_timeout(
    slow_router: RouterApp,
) -> None:
    client = await Client.open(slow_router.url)
    stop = asyncio.Event()
    dripping = asyncio.ensure_future(drip_head(client, 0.2, stop))
    started = time.monotonic()
    try:
        assert await client.answer(timeout=10) == b""
    finally:
        stop.set()
        await dripping
        client.close()
    assert 0.9 < time.monotonic() - started < 1.0 + 8
    assert slow_router.connections.timeouts["header"] == 1


async def test_an_idle_connection_is_closed_at_the_keepalive_timeout(
    slow_router: RouterApp,
) -> None:
    client = await Client.open(slow_router.url)
    started = time.monotonic()
    assert await client.answer(timeout=10) == b""
    assert 0.9 < time.monotonic() - started < 1.0 + 8
    await poll(lambda: slow_router.connections.open == 0, timeout=5)


async def test_a_connection_over_the_cap_is_closed_on_arrival(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router([engine.url], server={"max_connections": 3})
    try:
        idle = [await Client.open(app.url) for _ in range(3)]
        await poll(lambda: app.connections.open == 3, timeout=5)
        extra = await Client.open(app.url)
        assert await extra.answer(timeout=5) == b""
        assert app.connections.refused == 1
        for client in idle:
            client.close()
        await poll(lambda: app.connections.open == 0, timeout=5)
        status, _ = await post(http, f"{app.url}/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert status == 200
        samples = await metrics(http, app.url)
        assert metric(samples, "kvroute_http_connections_refused_total") == 1
    finally:
        await app.stop()


async def test_the_sidecar_times_out_an_unfinished_body(engine: EmulatedEngine) -> None:
    runner, sidecar, url = await start_sidecar(engine.url, [], server=ServerConfig(**TIMEOUTS))
    try:
        client = await unfinished_body(url)
        answer = await client.answer(timeout=10)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        idle = await Client.open(url)
        assert await idle.answer(timeout=10) == b""
    finally:
        await runner.cleanup()
        await sidecar.close()


@pytest.mark.timeout(120)
async def test_500_slow_heads_and_500_unfinished_bodies_are_closed_while_others_are_served(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """The issue's "done means": default settings but for shorter timeouts (the default
    connection cap holds the 1,000 slow clients with room to spare). Both ends of every
    connection live in this process: about 2,100 descriptors."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2_500:
        pytest.skip("the open-file hard limit is below 2,500")
    app = await start_router([engine.url], server={"header_timeout_s": 5.0, "body_timeout_s": 8.0})
    stop = asyncio.Event()
    try:
        assert app.config.server.max_connections > 1_000 + 100
        heads = [await Client.open(app.url) for _ in range(500)]
        dripping = [asyncio.ensure_future(drip_head(c, 0.5, stop)) for c in heads]
        bodies = [await unfinished_body(app.url) for _ in range(500)]
        started = time.monotonic()
        # Every body is being read, or already timed out (opening 1,000 connections can
        # outlast the body timeout on a loaded machine).
        await poll(
            lambda: app.admission.reading_body + app.connections.timeouts.get("body", 0) == 500,
            timeout=60,
        )
        served = 0
        # Until only the session's own keep-alive connection is left.
        while app.connections.open > 1 and time.monotonic() - started < 60:
            status, _ = await post(
                http,
                f"{app.url}/v1/completions",
                {"model": MODEL, "prompt": f"normal {served}", "max_tokens": 1},
            )
            assert status == 200
            served += 1
            await asyncio.sleep(0.05)
        assert app.connections.open <= 1
        assert time.monotonic() - started < 8.0 + 15  # the timeout, and slack for 2 busy cores
        answers = await asyncio.gather(*(c.answer(timeout=30) for c in bodies + heads))
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers[:500])
        assert all(a == b"" for a in answers[500:])
        assert served >= 3
        assert app.connections.timeouts == {"header": 500, "body": 500}
        assert app.admission.reading_body == 0
    finally:
        stop.set()
        await asyncio.gather(*dripping, return_exceptions=True)
        for client in heads + bodies:
            client.close()
        await app.stop()


async def test_kvroute_sidecar_takes_its_timeouts_from_the_environment(
    engine: EmulatedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_SERVER__BODY_TIMEOUT_S", "1.5")
    proc = await asyncio.to_thread(
        ServerProcess, "sidecar", ["--port", "0", "--engine", engine.url]
    )
    try:
        client = await unfinished_body(proc.url)
        started = time.monotonic()
        answer = await client.answer(timeout=20)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"1.5 s" in answer
        assert time.monotonic() - started < 1.5 + 5
    finally:
        proc.stop()
    monkeypatch.setenv("KVROUTE_SERVER__BODY_TIMEOUT_S", "soon")
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "router", "sidecar", "--port", "0", "--engine", engine.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "server.body_timeout_s" in done.stderr and "Traceback" not in done.stderr

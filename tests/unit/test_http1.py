"""The lean upstream HTTP/1.1 client against raw servers on loopback.

The servers here write exact bytes, to produce what a well-behaved engine never sends
(cut-off bodies, garbage, connections closed while idle); the engine emulator covers
the ordinary cases in the router's integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from support.engines import poll

from router.http1 import Client, ConnectError, HTTPError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length) if length else b""
    return head + body


class RawServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest_asyncio.fixture
async def client() -> AsyncIterator[Client]:
    c = Client(connect_timeout=1.0, keepalive_s=4.0)
    yield c
    c.close()


def reply(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_content_length_bodies_reuse_one_connection(client: Client) -> None:
    async def handler(reader, writer) -> None:
        while True:
            request = await read_request(reader)
            writer.write(reply(b"echo:" + request.split(b"\r\n\r\n", 1)[1]))
            await writer.drain()

    async with RawServer(handler) as server:
        for i in range(3):
            resp = await client.request(
                "POST", server.url + "/x", b"n%d" % i, {"Content-Type": "application/json"}
            )
            assert resp.status == 200 and await resp.read() == b"echo:n%d" % i
            resp.close()
        assert server.connections == 1


async def test_chunked_streams_arrive_piece_by_piece(client: Client) -> None:
    release = asyncio.Event()

    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata:1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(handler) as server:
        resp = await client.request("POST", server.url, b"{}")
        assert await resp.readany() == b"data:1"
        release.set()
        assert await resp.readany() == b"data:2"
        assert await resp.readany() == b""
        assert resp.complete
        resp.close()


async def test_a_body_delimited_by_the_connection_closing(client: Client) -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async with RawServer(handler) as server:
        resp = await client.request("GET", server.url)
        assert await resp.read() == b"all of it"
        resp.close()


async def test_a_connection_the_server_closed_while_idle_is_replaced(client: Client) -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(reply(b"once"))
        await writer.drain()  # then close: the pooled connection goes stale

    async with RawServer(handler) as server:
        for _ in range(2):
            resp = await client.request("POST", server.url, b"x")
            assert await resp.read() == b"once"
            resp.close()
            await asyncio.sleep(0)
        assert server.connections == 2


async def test_connections_idle_past_keepalive_are_not_reused() -> None:
    async def handler(reader, writer) -> None:
        while True:
            await read_request(reader)
            writer.write(reply(b"ok"))
            await writer.drain()

    client = Client(keepalive_s=0.05)
    try:
        async with RawServer(handler) as server:
            resp = await client.request("POST", server.url, b"")
            await resp.read()
            resp.close()
            await asyncio.sleep(0.1)
            resp = await client.request("POST", server.url, b"")
            await resp.read()
            resp.close()
            assert server.connections == 2
    finally:
        client.close()


async def test_a_body_cut_off_midway_is_an_error(client: Client) -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with RawServer(handler) as server:
        resp = await client.request("POST", server.url, b"")
        with pytest.raises(HTTPError) as info:
            await resp.read()
        assert not info.value.before_response
        resp.close()


async def test_garbage_instead_of_http_is_an_error(client: Client) -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(handler) as server:
        with pytest.raises(HTTPError):
            await client.request("POST", server.url, b"")


async def test_a_server_that_greets_in_another_protocol_and_hangs_up_is_an_http_error(
    client: Client,
) -> None:
    """A ZMQ port given as an engine URL sends its greeting as soon as it accepts and
    closes the connection, so the request's write meets a closed transport: that is an
    HTTPError, never uvloop's RuntimeError (issue 44, item 11: a traceback every second
    from the health probes)."""
    zmtp_greeting = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f"

    async def handler(reader, writer) -> None:
        writer.write(zmtp_greeting)
        await writer.drain()

    async with RawServer(handler) as server:
        for _ in range(5):
            with pytest.raises(HTTPError):
                await client.request("GET", server.url + "/health")


async def test_nothing_listening_is_a_connect_error(client: Client) -> None:
    async with RawServer(read_request) as server:
        url = server.url
    with pytest.raises(ConnectError) as info:
        await client.request("POST", url, b"")
    assert info.value.before_response


async def test_a_slow_reader_pauses_the_socket_instead_of_buffering(client: Client) -> None:
    megabyte = b"x" * (1 << 20)

    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (8 * len(megabyte)))
        for _ in range(8):
            writer.write(megabyte)
            await writer.drain()

    async with RawServer(handler) as server:
        resp = await client.request("POST", server.url, b"")
        transport = resp._conn.transport
        assert transport is not None
        await poll(lambda: not transport.is_reading())  # paused once past 1 MiB ...
        assert resp._buffered <= 3 * (1 << 20)  # ... so the buffer stays bounded
        total = len(await resp.read())
        assert total == 8 * len(megabyte)
        resp.close()


async def test_header_injection_is_refused(client: Client) -> None:
    with pytest.raises(ValueError):
        await client.request("POST", "http://127.0.0.1:9/x", b"", {"X-Request-Id": "a\r\nEvil: 1"})

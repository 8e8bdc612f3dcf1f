"""An engine that streams an answer up to its last event and ends the HTTP stream only
when the test says, and a client that leaves at a chosen moment.

Many clients close the connection as they read ``data: [DONE]``. With the emulator the
engine's closing bytes follow the last event at once, so whether the client's close
reaches the router before or after them is a race; these let a test choose. To have
the router see the engine's end and the client's close in one poll, in that order, call
:meth:`HeldStreamEngine.end` and then :meth:`StreamingClient.leave` with no await
between: on loopback both are delivered within the calls. The engine is a raw HTTP/1.1
server standing in for one (the emulator cannot hold its stream's end); it answers
``/health`` and refuses every other GET, so the router under test must be given its
models.
"""

from __future__ import annotations

import asyncio
import socket

_COMPLETION = b'data: {"id":"c","choices":[{"index":0,"text":"hi"}]}\n\n'
_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
#: The answer's events by path, the last one included.
EVENTS = {
    "/v1/completions": _COMPLETION + b"data: [DONE]\n\n",
    "/v1/messages": _DELTA + _STOP,
}


class HeldStreamEngine:
    """Streams ``EVENTS[path]`` in one chunk and keeps the stream open until :meth:`end`."""

    def __init__(self) -> None:
        self.held: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                events = EVENTS.get(path.decode())
                if method == b"POST" and events is not None:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(events), events)
                    )
                    self.held.append(writer)
                    await reader.read()  # until the router closes the connection
                    return
                if path == b"/health":
                    status, body = b"200 OK", b'{"status":"ok"}'
                else:
                    status, body = b"404 Not Found", b"{}"
                writer.write(
                    b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, len(body), body)
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def end(self) -> None:
        """End the held stream now: the chunked body's last chunk leaves in this call."""
        self.held.pop().write(b"0\r\n\r\n")

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


class StreamingClient:
    """A client on a raw socket: sends one streamed request, reads to a marker, leaves.

    A plain socket rather than an asyncio stream, so that :meth:`leave` sends the FIN
    within the call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def post(cls, host: str, port: int, path: str, body: bytes) -> StreamingClient:
        sock = socket.create_connection((host, port))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_sendall(
            sock,
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        return cls(sock)

    async def read_until(self, marker: bytes, timeout: float = 10.0) -> bytes:
        loop = asyncio.get_running_loop()
        received = b""
        while marker not in received:
            chunk = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), timeout)
            assert chunk, f"the connection ended before {marker!r}: {received!r}"
            received += chunk
        return received

    def leave(self) -> None:
        """Close the connection now: the FIN leaves within this call."""
        self.sock.shutdown(socket.SHUT_WR)
        self.sock.close()

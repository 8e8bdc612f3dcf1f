"""A lean HTTP/1.1 client for the router's upstream hop, on httptools' parser.

Why not aiohttp's client (which the router used first): measured side by side against
the emulator, aiohttp's client spends about 140 µs of CPU per small request, this one
about 40 µs, and that difference was a third of the router's whole per-request cost
(docs/benchmarks.md). The router talks to a handful of engines over keep-alive
connections with JSON in and JSON or SSE out, which is all this client does:

* one pool of idle keep-alive connections per engine (``http`` and ``https``);
  connections idle longer than ``keepalive_s`` are closed rather than reused, staying
  under uvicorn's 5 s server-side keep-alive (vLLM's default) so a reused connection is
  rarely one the server is closing; if a reused connection still dies before any byte
  of the answer, the request is sent once more on a fresh connection;
* responses with Content-Length, chunked bodies (SSE streams) or read-until-close;
* body chunks are queued as they arrive and reading pauses above 1 MiB, so a slow
  client of the router never makes it buffer without bound;
* deadlines are enforced from outside by :class:`router.proxy.Deadlines`, which aborts
  the response a :class:`Deadline` is attached to, so a wait costs no timer.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urlsplit

import httptools

_MAX_BUFFER = 1 << 20


class Watcher(Protocol):
    """Something that may abort a response from outside (a deadline)."""

    target: Response | None


class HTTPError(Exception):
    """The exchange failed. ``before_response`` tells whether any byte of an answer came."""

    def __init__(self, message: str, *, before_response: bool, timeout: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response
        self.timeout = timeout


class ConnectError(HTTPError):
    """No connection could be made."""


class Response:
    """One response: status and headers first, then the body as it arrives."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ---------------------------------------------------------------- fed by the protocol

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _MAX_BUFFER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: HTTPError) -> None:
        if not self._complete:
            self._error = error
        self._wake()

    # ---------------------------------------------------------------- read by the caller

    @property
    def complete(self) -> bool:
        return self._complete and not self._chunks

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """Whatever body bytes have arrived (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        if self._buffered > _MAX_BUFFER:
            self._conn.resume()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def abort(self) -> None:
        """Drop the connection (the server sees the client go away)."""
        self._conn.close()

    def close(self) -> None:
        """Done with this response: reuse the connection if it finished cleanly."""
        if self._complete and self._error is None:
            self._conn.release()
        else:
            self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.reused = False
        self.idle_since = 0.0
        self.closed = False
        self.keep_alive = False
        self._header_name = b""
        self._got_bytes = False
        self._broken = ""
        """Why the connection closed before a request was on it (the peer sent garbage)."""

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken = f"malformed HTTP response: {exc}"
            self._error(HTTPError(self._broken, before_response=False))
            self.close()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response._complete:
            headers_done = self.headers_ready is not None and self.headers_ready.done()
            if (
                headers_done
                and "content-length" not in self.response.headers
                and ("chunked" not in self.response.headers.get("transfer-encoding", ""))
            ):
                self.response._finish()  # a body delimited by the connection's end
            else:
                self._error(
                    HTTPError(
                        "connection closed before the response was complete",
                        before_response=not self._got_bytes,
                    )
                )
        self.pool.forget(self)

    # ---------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            self.keep_alive = self.parser.should_keep_alive()
            response._finish()

    # ---------------------------------------------------------------- helpers

    def _error(self, error: HTTPError) -> None:
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()

    def release(self) -> None:
        self.response = None
        self.headers_ready = None
        if self.closed or not self.keep_alive:
            self.close()
            return
        self.parser = httptools.HttpResponseParser(self)
        self._got_bytes = False
        self.pool.put(self)

    async def exchange(self, head: bytes, body: bytes, watcher: Watcher | None) -> Response:
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            # The peer closed the connection (or spoke something other than HTTP, e.g. a
            # ZMQ port given as an engine URL) before the request went out: uvloop would
            # raise RuntimeError on the write, which no caller expects.
            raise HTTPError(
                self._broken or "the server closed the connection before the request was sent",
                before_response=True,
            )
        self.response = Response(self)
        if watcher is not None:
            watcher.target = self.response
        self.headers_ready = self.loop.create_future()
        self.keep_alive = False
        self.transport.writelines([head, body])
        await self.headers_ready
        return self.response


class Pool:
    """Idle keep-alive connections to one engine."""

    def __init__(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        keepalive_s: float,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.host, self.port, self.ssl = host, port, ssl_context
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self._idle: deque[_Connection] = deque()
        self._all: set[_Connection] = set()

    def put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.reused = True
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def _take_idle(self) -> _Connection | None:
        stale_before = time.monotonic() - self.keepalive_s
        while self._idle:
            conn = self._idle.pop()  # most recently used first: the warmest connection
            if conn.closed:
                continue
            if conn.idle_since < stale_before:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectError(
                f"connecting to {self.host}:{self.port} timed out",
                before_response=True,
                timeout=True,
            ) from None
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}",
                before_response=True,
            ) from None
        self._all.add(conn)
        return conn

    async def request(self, head: bytes, body: bytes, watcher: Watcher | None) -> Response:
        conn = self._take_idle()
        if conn is not None:
            try:
                return await conn.exchange(head, body, watcher)
            except HTTPError as exc:
                if not exc.before_response or getattr(watcher, "expired", False):
                    raise
                conn.close()  # the server closed it while idle: try once on a new one
        conn = await self._connect()
        return await conn.exchange(head, body, watcher)

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()


class Client:
    """Pools per engine origin; the one upstream client of a router."""

    def __init__(
        self,
        connect_timeout: float = 2.0,
        keepalive_s: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.ssl_context = ssl_context
        self._pools: dict[tuple[str, str, int], Pool] = {}
        self._targets: dict[str, tuple[Pool, str]] = {}

    def _pool(self, scheme: str, host: str, port: int) -> Pool:
        key = (scheme, host, port)
        pool = self._pools.get(key)
        if pool is None:
            context = None
            if scheme == "https":
                context = self.ssl_context or ssl.create_default_context()
            pool = self._pools[key] = Pool(
                host, port, context, self.connect_timeout, self.keepalive_s
            )
        return pool

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        watcher: Watcher | None = None,
    ) -> Response:
        """Send a request; returns once the status line and headers arrived.

        ``watcher.target`` is set to the response as soon as the exchange starts, so a
        deadline can abort it while the headers are still awaited.
        """
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or parts.hostname is None:
                raise ValueError(f"not an http(s) URL: {url}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            prefix = f"{target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            known = (self._pool(parts.scheme, parts.hostname, port), prefix)
            if len(self._targets) < 4096:
                self._targets[url] = known
        pool, prefix = known
        lines = [f"{method} {prefix}"]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("latin-1")
        return await pool.request(head, body, watcher)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._targets.clear()

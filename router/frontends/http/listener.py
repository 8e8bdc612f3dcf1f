"""The client-facing HTTP listener: bound first, connections capped, slow clients timed out.

aiohttp times none of this itself: a connection that opens and sends a head a byte at a
time, or a body that never ends, was held forever, and a body being read holds an
admission slot. Every kvroute HTTP listener (``kvroute serve``, the sidecar) runs
through a :class:`ConnectionGuard`:

* **connection cap** (``server.max_connections``): a connection over it is closed as it
  arrives, before anything is read;
* **header timeout** (``server.header_timeout_s``): from the first byte of a request
  head to its end; past it the connection is dropped;
* **body timeout** (``server.body_timeout_s``): from the end of the head to the end of
  the body; past it the client gets a 408 and the connection closes, which cancels the
  handler and frees the admission slot it held;
* **keep-alive idle timeout** (``server.keepalive_timeout_s``): aiohttp's own
  ``keepalive_timeout``, from the connection's start or its last answer to the next
  request;
* **malformed requests**: what aiohttp refuses before any kvroute code runs (a request
  it cannot parse, an ``Expect`` header it cannot echo) is answered 400 in OpenAI's
  form, counted, and warned about at most once a minute without a traceback; aiohttp
  logged each as an ERROR with one, so a client decided how much ERROR output the
  router wrote.

The guard wraps aiohttp's protocol (one call per ``data_received``) and learns where a
request starts and ends from its middleware, so no aiohttp internals are touched; the
protocol is aiohttp's own with its ``handle_error`` answering malformed requests.
:func:`bind` binds the listening socket before anything else starts, so a taken port
fails fast (:class:`ListenError`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from router.metric_catalogue import (
    HTTP_CONNECTIONS,
    HTTP_CONNECTIONS_REFUSED,
    HTTP_MALFORMED_REQUESTS,
    HTTP_TIMEOUTS,
)
from router.serving.errors import ApiError, shape_for

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.http")

_MALFORMED_WARN_S = 60.0
"""At most one warning about malformed requests this often; the rest are counted."""


class ListenError(OSError):
    """The listening socket could not be bound (a taken port, say)."""


class ConnectionGuard:
    """Connection cap, timeouts and malformed-request accounting for one HTTP listener."""

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        body_timeout_s: float,
        keepalive_timeout_s: float,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.open = 0
        """Client connections open now."""
        self.refused = 0
        """Connections closed on arrival because ``max_connections`` were open."""
        self.timeouts = {"header": 0, "body": 0}
        """Connections closed because a request head or body did not arrive in time."""
        self.malformed = 0
        """Requests aiohttp refused before any kvroute code ran (answered 400)."""
        self._by_handler: dict[Any, _Guarded] = {}
        self._warned = False
        self._malformed_warned_at: float | None = None
        self._malformed_unwarned = 0

    def protocol_factory(self, make: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's ``make``."""
        return lambda: _Guarded(self, make)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Outermost: marks the request's connection busy, times its body."""
        conn = self._by_handler.get(request.protocol)
        if conn is None:
            return await handler(request)
        return await conn.serve(request, handler)

    def protocol(self, server: web.Server) -> web.RequestHandler:
        """aiohttp's protocol for one client connection of ``server`` (a runner's)."""
        return _ClientProtocol(
            server,
            self,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=self.keepalive_timeout_s,
            access_log=None,
            auto_decompress=False,  # bodies are inflated against the limit (body.py)
        )

    def count_malformed(self, peer: str | None, what: str) -> None:
        """Count a malformed request; warn at most once per ``_MALFORMED_WARN_S``."""
        self.malformed += 1
        self._malformed_unwarned += 1
        now = time.monotonic()
        if (
            self._malformed_warned_at is not None
            and now - self._malformed_warned_at < _MALFORMED_WARN_S
        ):
            return
        log.warning(
            "%d malformed request(s) answered 400 since the last warning, the last from %s: "
            "%s (all are counted in kvroute_http_malformed_requests_total; at most one "
            "warning every %.0f s)",
            self._malformed_unwarned,
            peer or "?",
            what[:200],
            _MALFORMED_WARN_S,
        )
        self._malformed_warned_at = now
        self._malformed_unwarned = 0

    def _refuse(self) -> None:
        self.refused += 1
        if not self._warned:
            self._warned = True
            log.warning(
                "%d client connections open (server.max_connections): closing new ones "
                "until some end",
                self.max_connections,
            )

    def metric_families(self) -> Iterator[StateFamily]:
        """Connections open and refused, timeouts by phase, malformed requests."""
        yield HTTP_CONNECTIONS.value(self.open)
        yield HTTP_CONNECTIONS_REFUSED.value(self.refused)
        yield HTTP_TIMEOUTS.labelled(((p,), n) for p, n in sorted(self.timeouts.items()))
        yield HTTP_MALFORMED_REQUESTS.value(self.malformed)


class _Guarded(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, timers outside."""

    __slots__ = ("busy", "guard", "inner", "make", "timer", "transport")

    def __init__(self, guard: ConnectionGuard, make: Callable[[], Any]) -> None:
        self.guard = guard
        self.make = make
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False
        """A request of this connection is being handled."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if guard.open >= guard.max_connections:
            guard._refuse()
            transport.abort()
            return
        guard.open += 1
        self.transport = transport  # type: ignore[assignment]
        self.inner = self.make()
        guard._by_handler[self.inner] = self
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        guard = self.guard
        guard.open -= 1
        if guard.open < guard.max_connections // 2:
            guard._warned = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        guard._by_handler.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.timer is None and not self.busy:  # the first bytes of a request head
            self.timer = asyncio.get_running_loop().call_later(
                self.guard.header_timeout_s, self._head_late
            )
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _head_late(self) -> None:
        self.timer = None
        if not self.busy and self.transport is not None:
            self.guard.timeouts["header"] += 1
            self.transport.abort()

    def _body_late(self, request: web.Request) -> None:
        if request.content.is_eof() or self.transport is None:
            return  # all there: the handler is only slow to read it
        self.guard.timeouts["body"] += 1
        # Every kvroute handler reads the whole body before it answers, so nothing has
        # been written on this connection for this request yet.
        self.transport.write(_timeout_answer(self.guard.body_timeout_s))
        self.transport.close()  # the handler is cancelled: its admission slot is freed

    async def serve(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.busy = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        body_timer = None
        if not request.content.is_eof():
            body_timer = asyncio.get_running_loop().call_later(
                self.guard.body_timeout_s, self._body_late, request
            )
        try:
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            self.busy = False
            if body_timer is not None:
                body_timer.cancel()


class _ClientProtocol(web.RequestHandler):
    """aiohttp's protocol for one client connection, answering malformed requests."""

    def __init__(self, server: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.guard = guard

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp refused before any kvroute code ran is the client's 400;
        anything else is aiohttp's own answer (a 500 the router did not catch stays an
        ERROR with its traceback)."""
        if isinstance(exc, HttpProcessingError):  # the request could not be parsed
            detail = exc.message.split("\n", 1)[0].rstrip(": ") or "unreadable"
            err = ApiError(400, f"malformed HTTP request: {detail}")
        elif isinstance(exc, UnicodeEncodeError) and _not_utf8(request.headers.get(hdrs.EXPECT)):
            # aiohttp refuses an Expect other than 100-continue with a 417 that quotes it,
            # and cannot encode a value that is not UTF-8 (a 500 then)
            err = ApiError(400, "the Expect header must be 100-continue")
        else:
            return super().handle_error(request, status, exc, message)
        self.guard.count_malformed(request.remote, err.message)
        answer = web.Response(
            status=err.status,
            body=shape_for(request.path).body(err),
            content_type="application/json",
        )
        answer.force_close()
        return answer


def _not_utf8(value: str | None) -> bool:
    """Whether a header value aiohttp decoded held bytes that are not UTF-8 (it keeps
    them as lone surrogates)."""
    if value is None:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def _timeout_answer(timeout_s: float) -> bytes:
    body = ApiError(408, f"the request body did not arrive within {timeout_s:g} s").body()
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundSite(web.BaseSite):
    """An aiohttp site on a server that :func:`bind` bound already."""

    __slots__ = ("_name",)

    def __init__(self, runner: web.BaseRunner, server: asyncio.Server, name: str) -> None:
        super().__init__(runner)
        self._server = server
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        assert self._server is not None
        await self._server.start_serving()


async def bind(
    host: str,
    port: int,
    guard: ConnectionGuard,
    runner: web.BaseRunner,
    ssl_context: Any = None,
    backlog: int = 1024,
) -> asyncio.Server:
    """Bind ``host:port`` for ``runner`` (not serving yet: :class:`BoundSite` starts it)."""
    fit_open_files(guard.max_connections)

    def make() -> Any:
        assert runner.server is not None
        return guard.protocol(runner.server)

    try:
        return await asyncio.get_running_loop().create_server(
            guard.protocol_factory(make),
            host,
            port,
            ssl=ssl_context,
            backlog=backlog,
            start_serving=False,
        )
    except OSError as exc:
        shown = f"[{host}]" if ":" in host else host
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(exc.errno, f"cannot listen on {shown}:{port}: {reason}") from None


def check_free(host: str, port: int, what: str) -> None:
    """Raise :class:`ListenError` now if ``host:port`` cannot be bound (for listeners
    bound late, like gRPC's: a taken port then fails before any engine is contacted)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        shown = f"[{host}]" if ":" in host else host
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(exc.errno, f"{what}: cannot listen on {shown}:{port}: {reason}") from None


def fit_open_files(max_connections: int) -> None:
    """Raise the soft open-file limit toward the hard one so ``max_connections`` client
    connections and as many to engines fit; warn if they cannot."""
    needed = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the open-file limit (%d) is below what server.max_connections=%d needs (about "
            "%d: a connection to an engine per client connection); raise `ulimit -n` or "
            "lower server.max_connections",
            soft,
            max_connections,
            needed,
        )

"""Forwarding to engines: the upstream client, deadlines, and error mapping.

Requests go out through :mod:`router.http1` (a lean HTTP/1.1 client; see there for
why). Deadlines cost no timer per request: each exchange gets a :class:`Deadline`
(a stamp and a limit) and one :class:`Deadlines` task per router aborts exchanges whose
stamp is older than their limit. Until the first byte the limit is
``first_byte_timeout_s`` (queueing and prefill); a stream then switches to
``idle_timeout_s`` and stamps each chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from router.config import ProxyConfig
from router.http1 import Client, ConnectError, HTTPError, Response


class UpstreamError(Exception):
    """The engine could not be reached, timed out, or answered with a server error."""

    def __init__(
        self, kind: str, message: str, status: int | None = None, *, accepted: bool = False
    ) -> None:
        super().__init__(message)
        self.kind = kind
        """``connect``, ``timeout``, ``status`` (5xx/429 answer) or ``protocol``."""
        self.status = status
        self.accepted = accepted
        """A timeout after the engine had the whole request (it may have queued or
        started it): not one to resend elsewhere."""

    @property
    def engine_fault(self) -> bool:
        """Whether this counts toward ejecting the engine: a 429 says the engine is busy
        (the request goes elsewhere), not that it is broken."""
        return not (self.kind == "status" and self.status is not None and self.status < 500)

    @property
    def http_status(self) -> int:
        """What the client gets if this is the final outcome."""
        return 504 if self.kind == "timeout" else 502


class Deadline:
    """A limit on silence for one exchange."""

    __slots__ = ("expired", "last", "limit", "target")

    def __init__(self, limit: float, now: float) -> None:
        self.limit = limit
        self.last = now
        self.expired = False
        self.target: Response | None = None


class Deadlines:
    """One task that aborts exchanges silent for longer than their deadline's limit."""

    def __init__(self, resolution: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._active: set[Deadline] = set()
        self.resolution = resolution
        """How often silent exchanges are looked for (a fraction of the shortest limit)."""
        self._task = asyncio.ensure_future(self._sweep())

    def start(self, limit: float) -> Deadline:
        deadline = Deadline(limit, self._loop.time())
        self._active.add(deadline)
        return deadline

    def touch(self, deadline: Deadline, limit: float | None = None) -> None:
        deadline.last = self._loop.time()
        if limit is not None:
            deadline.limit = limit

    def stop(self, deadline: Deadline) -> None:
        self._active.discard(deadline)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.resolution)
            now = self._loop.time()
            for d in [d for d in self._active if now - d.last > d.limit]:
                d.expired = True
                self._active.discard(d)
                if d.target is not None:
                    d.target.abort()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _upstream_error(exc: HTTPError, deadline: Deadline, url: str) -> UpstreamError:
    if deadline.expired or exc.timeout:
        return UpstreamError(
            "timeout", f"{url}: no answer in time", accepted=not isinstance(exc, ConnectError)
        )
    if isinstance(exc, ConnectError):
        return UpstreamError("connect", str(exc))
    return UpstreamError("protocol", f"{url}: {exc}")


def _resolution(config: ProxyConfig) -> float:
    shortest = min(config.first_byte_timeout_s, config.idle_timeout_s)
    return min(max(shortest / 20, 0.01), 0.5)


class Upstream:
    """The client every request to an engine goes through."""

    def __init__(self, config: ProxyConfig) -> None:
        from router.security import client_tls

        self.config = config
        self.client = Client(config.connect_timeout_s, config.keepalive_s, client_tls(config))
        self.own_authorization: str | None = None
        """``Authorization`` of the router's own calls (discovery, probes, scrapes,
        tokenization): the engines' key when ``auth.upstream`` is ``token``."""
        self.deadlines = Deadlines(_resolution(config))

    def reconfigure(self, config: ProxyConfig, own_authorization: str | None) -> None:
        """Apply a reloaded ``proxy`` section (its timeouts and retries; the connection
        pool's settings wait for a restart) and the router's own ``Authorization``."""
        self.config = config
        self.deadlines.resolution = _resolution(config)
        self.own_authorization = own_authorization

    async def open(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[Response, Deadline]:
        """POST ``body``; return the response (headers arrived) and its running deadline.

        The caller reads the body, then calls ``finish``. Raises :class:`UpstreamError`
        on connection failures, timeouts, and on 5xx or 429 answers.
        """
        deadline = self.deadlines.start(self.config.first_byte_timeout_s)
        try:
            response = await self.client.request("POST", url, body, headers, deadline)
        except HTTPError as exc:
            self.deadlines.stop(deadline)
            raise _upstream_error(exc, deadline, url) from None
        except BaseException:
            self.deadlines.stop(deadline)
            if deadline.target is not None:
                deadline.target.abort()
            raise
        if response.status >= 500 or response.status == 429:
            try:
                detail = (await response.read())[:200].decode("utf-8", "replace")
            except HTTPError:
                detail = ""
            finally:
                self.finish(response, deadline)
            raise UpstreamError(
                "status", f"{url} answered {response.status}: {detail}", status=response.status
            )
        return response, deadline

    def finish(self, response: Response, deadline: Deadline) -> None:
        """Done with an exchange: reuse its connection if complete, else drop it."""
        self.deadlines.stop(deadline)
        response.close()

    async def read(self, response: Response, deadline: Deadline, url: str) -> bytes:
        """The rest of a body, as an UpstreamError if it breaks or times out."""
        try:
            return await response.read()
        except HTTPError as exc:
            raise _upstream_error(exc, deadline, url) from None

    async def get(
        self, url: str, timeout: float, authorization: str | None = None
    ) -> tuple[int, bytes]:
        """A small GET (probes, scrapes, discovery); raises UpstreamError on failure."""
        return await self.call("GET", url, b"", timeout, authorization)

    async def call(
        self,
        method: str,
        url: str,
        body: bytes,
        timeout: float,
        authorization: str | None = None,
    ) -> tuple[int, bytes]:
        """A small whole exchange (status, body); raises UpstreamError on failure.

        ``authorization``: sent instead of the router's own (a client's call)."""
        deadline = self.deadlines.start(timeout)
        response: Response | None = None
        headers = {"Content-Type": "application/json"} if body else {}
        auth = authorization or self.own_authorization
        if auth:
            headers["Authorization"] = auth
        try:
            response = await self.client.request(method, url, body, headers, deadline)
            return response.status, await response.read()
        except HTTPError as exc:
            raise _upstream_error(exc, deadline, url) from None
        finally:
            self.deadlines.stop(deadline)
            if response is not None:
                response.close()

    async def close(self) -> None:
        await self.deadlines.close()
        self.client.close()

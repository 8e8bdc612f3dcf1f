"""Forwarding to engines: one pooled aiohttp client, deadlines, and error mapping.

Deadlines are enforced by a per-request :class:`Watchdog` rather than
``asyncio.wait_for`` around every read (which costs a task per call on Python 3.10
and 3.11): each received chunk only stamps the time, and one timer per request checks
the stamp. Until the first byte the limit is ``first_byte_timeout_s`` (queueing and
prefill), afterwards ``idle_timeout_s`` between chunks. An expired watchdog closes the
upstream response, which unblocks the read and tells the engine to abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from router.config import ProxyConfig


class UpstreamError(Exception):
    """The engine could not be reached, timed out, or answered with a server error."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        """``connect``, ``timeout``, ``status`` (5xx/429 answer) or ``protocol``."""
        self.status = status

    @property
    def http_status(self) -> int:
        """What the client gets if this is the final outcome."""
        return 504 if self.kind == "timeout" else 502


class Watchdog:
    """Closes a response when it goes quiet for longer than its current limit."""

    def __init__(self, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.limit = limit
        self.last = self._loop.time()
        self.expired = False
        self._response: aiohttp.ClientResponse | None = None
        self._task: asyncio.Task[object] | None = None
        self._handle = self._loop.call_later(limit, self._check)

    def guard(self, response: aiohttp.ClientResponse) -> None:
        """From now on, expiry closes ``response``."""
        self._response = response

    def guard_task(self, task: asyncio.Task[object]) -> None:
        """Until a response exists, expiry cancels the task waiting for it."""
        self._task = task

    def touch(self, limit: float | None = None) -> None:
        self.last = self._loop.time()
        if limit is not None:
            self.limit = limit

    def _check(self) -> None:
        remaining = self.last + self.limit - self._loop.time()
        if remaining > 0:
            self._handle = self._loop.call_later(remaining, self._check)
            return
        self.expired = True
        if self._response is not None:
            self._response.close()
        elif self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        self._handle.cancel()


class Upstream:
    """The pooled HTTP client every request to an engine goes through."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def open(
        self, url: str, body: bytes, headers: Mapping[str, str], watchdog: Watchdog
    ) -> aiohttp.ClientResponse:
        """POST ``body`` and return the response once its headers arrived.

        Raises :class:`UpstreamError` on connection failures, on the watchdog expiring,
        and on 5xx or 429 answers (their body is read and the response released).
        """
        task = asyncio.ensure_future(self.session.post(url, data=body, headers=headers))
        watchdog.guard_task(task)  # type: ignore[arg-type]
        try:
            response = await task
        except asyncio.CancelledError:
            if watchdog.expired:
                raise UpstreamError("timeout", f"no answer from {url} in time") from None
            raise
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError("connect", f"cannot reach {url}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError("protocol", f"bad answer from {url}: {exc}") from None
        watchdog.guard(response)
        if response.status >= 500 or response.status == 429:
            try:
                detail = (await response.read())[:200].decode("utf-8", "replace")
            except (aiohttp.ClientError, OSError):
                detail = ""
            finally:
                response.release()
            raise UpstreamError(
                "status", f"{url} answered {response.status}: {detail}", status=response.status
            )
        return response

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """A small GET (probes, scrapes, discovery); raises UpstreamError on failure."""
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                return response.status, await response.read()
        except asyncio.TimeoutError:
            raise UpstreamError("timeout", f"{url} timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError("connect", f"{url}: {exc}") from None

    async def close(self) -> None:
        await self.session.close()

"""An aiohttp client as the :class:`~router.serving.downstream.Downstream` of a request.

Every HTTP route that relays an engine's answer (the generation routes, the engine
routes, ``count_tokens``, a stored response's ``GET``, the sidecar) answers through
:class:`HttpDownstream`. ``Downstream`` itself, the pipeline's side of the contract, is
:mod:`router.serving.downstream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web


class HttpDownstream:
    """An aiohttp client as the :class:`~router.serving.downstream.Downstream` of a request.

    ``gone_at_end``: what a client that leaves at a stream's closing bytes (after its
    last event) means. None: :meth:`end` raises :class:`asyncio.CancelledError`, and the
    relay decides; else it is called and the answer counts as whole.
    """

    __slots__ = ("gone_at_end", "request", "response")

    def __init__(self, request: web.Request, gone_at_end: Callable[[], None] | None = None) -> None:
        self.request = request
        self.gone_at_end = gone_at_end
        self.response: web.StreamResponse | None = None

    @property
    def headers(self) -> Any:
        return self.request.headers

    @property
    def peer(self) -> str | None:
        return self.request.remote

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        out = web.StreamResponse(status=status, headers=headers)
        await out.prepare(self.request)
        self.response = out

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise asyncio.CancelledError from None  # the client left while we wrote

    async def end(self) -> None:
        assert self.response is not None
        try:
            await self.response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # The client left before the stream's closing bytes: many close as they read
            # the last event (data: [DONE]), so the relay or the caller decides what it means.
            if self.gone_at_end is None:
                raise asyncio.CancelledError from None
            self.gone_at_end()

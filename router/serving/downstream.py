"""Where an engine's answer goes: the HTTP client, or a gRPC ``Generate`` stream.

The serving pipeline (:mod:`router.serving`) and the handoff dialects write every
answer through this interface, so every front end shares one path: the same retries,
handoffs, load accounting and stream handling. Each front end brings its own:
:class:`~router.frontends.http.downstream.HttpDownstream`,
:class:`~router.frontends.grpc.api.GrpcDownstream`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Downstream(Protocol):
    """The caller of one request.

    Either ``whole`` is called once, or ``begin``, then ``write`` for every chunk, then
    ``end``. ``write`` raises :class:`asyncio.CancelledError` when the caller has gone.
    """

    @property
    def headers(self) -> Mapping[str, str]:
        """The caller's request headers; look names up in lower case."""
        ...

    @property
    def peer(self) -> str | None:
        """The caller's network address, where the transport knows it."""
        ...

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """A complete answer."""

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        """The head of a streamed answer."""

    async def write(self, chunk: bytes) -> None:
        """One chunk of a streamed answer."""

    async def end(self) -> None:
        """The streamed answer is complete."""

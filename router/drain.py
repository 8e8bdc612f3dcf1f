"""Draining: the router stops taking work and lets what it has finish.

Draining begins when shutdown starts (SIGTERM, SIGINT) or ``stop`` is called: from then
on health checks report not ready (HTTP ``/ready``, gRPC health through the listeners
told of it) and the front ends refuse new requests (503, "the router is shutting
down"). A graceful shutdown then closes the HTTP listener to new connections, lets the
requests in flight (streams included) finish for up to ``server.drain_timeout_s``, and
cancels the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.serving.services import RunState

log = logging.getLogger("kvroute")


class InFlight(Protocol):
    """What counts the requests in flight (the HTTP front end's request observer)."""

    @property
    def inflight(self) -> int:
        """Requests being served now."""
        ...

    async def wait_idle(self, timeout: float) -> int:
        """Wait until none is in flight or ``timeout`` passed; returns those left."""
        ...

    def cancel_all(self) -> None:
        """Cancel every request in flight."""


class Drain:
    """The router's drain state, who is told when it begins, and the graceful wait."""

    def __init__(self, state: RunState, observer: InFlight) -> None:
        """``state`` is what the front ends read (``draining``); ``observer`` counts the
        HTTP requests in flight."""
        self.state = state
        self.observer = observer
        self.listeners: list[Callable[[], None]] = []
        """Called once when draining begins (health checks report not ready)."""

    @property
    def draining(self) -> bool:
        return self.state.draining

    def begin(self) -> None:
        """Stop reporting ready (HTTP and gRPC health); in-flight requests continue."""
        if self.state.draining:
            return
        self.state.draining = True
        for listener in self.listeners:
            listener()

    async def run(self, timeout_s: float, stop_accepting: Callable[[], Awaitable[None]]) -> int:
        """Graceful shutdown: report not ready, stop accepting connections
        (``stop_accepting``), let in-flight requests (streams included) finish for up to
        ``timeout_s``, then cancel the rest. Returns how many had to be cancelled."""
        self.begin()
        await stop_accepting()
        inflight = self.observer.inflight
        if inflight:
            log.info("draining: waiting up to %.0f s for %d request(s)", timeout_s, inflight)
        left = await self.observer.wait_idle(timeout_s)
        if left:
            log.warning("drain deadline passed: cancelling %d request(s) still running", left)
            self.observer.cancel_all()
            await self.observer.wait_idle(5.0)
        return left

"""Admission control: bounded requests in flight, a bounded queue with a deadline.

Two limits, both from ``limits.*``:

* ``max_inflight`` requests through the router at once. A request over the limit waits
  in a FIFO queue (at most ``admission_queue`` long) for a slot; one that finds the
  queue full, or waits longer than ``admission_timeout_s``, gets 429 with
  ``Retry-After``. A finishing request hands its slot straight to the oldest waiter,
  so waiting requests are served in arrival order and never starve.
* ``max_inflight_per_engine`` requests on one routing target. The routing core skips
  full candidates; when every candidate is full (:class:`~router.core.Saturated`) the
  request waits for any engine's request to end, up to the same deadline, then 429
  (``router.api.decide.Decider.choose``).

Nothing here grows with traffic beyond the configured queue bounds.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from router.api.errors import ApiError
from router.config import LimitsConfig


class Overloaded(ApiError):
    """429: the router or every candidate engine is at its limit."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(429, message, code="overloaded", retry_after=retry_after)


class Admission:
    """The router-wide in-flight bound and the wait for per-engine capacity."""

    def __init__(self, limits: LimitsConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.in_flight = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self._capacity: list[asyncio.Future[None]] = []
        self.rejected: dict[str, int] = {"queue_full": 0, "timeout": 0, "engines_full": 0}

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot or for an engine with room."""
        return len(self._queue) + len(self._capacity)

    def deadline(self, started: float) -> float:
        """When a request that arrived at ``started`` (this clock) stops waiting."""
        return started + self.limits.admission_timeout_s

    async def enter(self, deadline: float) -> None:
        """Take an in-flight slot, waiting in the queue until ``deadline`` at most."""
        if self.in_flight < self.limits.max_inflight and not self._queue:
            self.in_flight += 1
            return
        if len(self._queue) >= self.limits.admission_queue:
            self.rejected["queue_full"] += 1
            raise Overloaded(
                f"too many requests: {self.in_flight} in flight and {len(self._queue)} waiting"
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await asyncio.wait_for(asyncio.shield(slot), max(deadline - self.clock(), 0.0))
        except asyncio.TimeoutError:
            if slot.done():  # handed over as the wait ended: keep it
                return
            slot.cancel()
            self._remove(slot)
            self.rejected["timeout"] += 1
            raise Overloaded(
                f"too many requests: waited {self.limits.admission_timeout_s:g} s for a slot"
            ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if slot.done() and not slot.cancelled():
                self.leave()
            else:
                slot.cancel()
                self._remove(slot)
            raise

    def leave(self) -> None:
        """Give a slot back: to the oldest waiter if any, else to the pool."""
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.in_flight -= 1

    def _remove(self, slot: asyncio.Future[None]) -> None:
        try:
            self._queue.remove(slot)
        except ValueError:
            pass

    # ------------------------------------------------------------------ per engine

    def engine_freed(self) -> None:
        """Some engine's request ended: requests waiting for capacity try again."""
        waiters, self._capacity = self._capacity, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_capacity(self, deadline: float) -> bool:
        """Wait until an engine's request ends; False at ``deadline`` or queue full."""
        remaining = deadline - self.clock()
        if remaining <= 0 or self.waiting >= self.limits.admission_queue:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._capacity.append(waiter)
        try:
            await asyncio.wait_for(waiter, remaining)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if waiter in self._capacity:
                self._capacity.remove(waiter)

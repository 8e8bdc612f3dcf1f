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
  (``router.serving.decide.Decider.choose``).

With ``flow.enabled`` a request comes with a :class:`~router.flow.ticket.FlowTicket` and
waits in the :class:`~router.flow.queue.BandedQueue` instead: a freed slot goes to the
highest priority band, to the flow its fairness policy picks, to that flow's first request
(:mod:`router.flow`). The in-flight bound, the per-engine wait and the counters are the
same ones.

Nothing here grows with traffic beyond the configured queue bounds.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from router.config import LimitsConfig
from router.flow.queue import BandedQueue, Waiter
from router.flow.ticket import FlowTicket
from router.metric_catalogue import (
    ADMISSION_INFLIGHT,
    ADMISSION_READING_BODY,
    ADMISSION_REJECTED,
    ADMISSION_WAITING,
)
from router.serving.errors import ApiError

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily


class Overloaded(ApiError):
    """429: the router or every candidate engine is at its limit."""

    def __init__(
        self, message: str, retry_after: float = 1.0, status: int = 429, reason: str = ""
    ) -> None:
        super().__init__(status, message, code="overloaded", retry_after=retry_after)
        self.reason = reason
        """Why (flow control's counters): ``band_full``, ``timeout``, ``shed``, or empty."""


class Admission:
    """The router-wide in-flight bound and the wait for per-engine capacity."""

    def __init__(
        self,
        limits: LimitsConfig,
        clock: Callable[[], float] = time.monotonic,
        flows: BandedQueue | None = None,
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.flows = flows
        """The banded queue (``flow.enabled``); requests entering with a ticket wait there."""
        self.tenant_share = 1.0
        """Of ``max_inflight``, the most one tenant may hold (``flow.tenant_share``)."""
        self.holding: dict[str, int] = {}
        """Tenant -> slots its requests hold (flow control)."""
        self.in_flight = 0
        self.reading_body = 0
        """Of ``in_flight``: requests whose body is still arriving (``server.body_timeout_s``
        bounds how long one holds its slot so)."""
        self._queue: deque[asyncio.Future[None]] = deque()
        self._capacity: list[asyncio.Future[None]] = []
        self.rejected: dict[str, int] = {"queue_full": 0, "timeout": 0, "engines_full": 0}

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot or for an engine with room."""
        return len(self._queue) + len(self._capacity) + (len(self.flows) if self.flows else 0)

    def deadline(self, started: float) -> float:
        """When a request that arrived at ``started`` (this clock) stops waiting."""
        return started + self.limits.admission_timeout_s

    async def enter(
        self,
        deadline: float,
        ticket: FlowTicket | None = None,
        *,
        band_queue: int = 0,
        timeout_status: int = 429,
    ) -> None:
        """Take an in-flight slot, waiting in the queue until ``deadline`` at most.

        With a ``ticket`` (flow control on) the wait is in the banded queue, whose band
        holds ``band_queue`` requests at most; a wait that runs out is answered
        ``timeout_status``.
        """
        if ticket is not None and self.flows is not None:
            await self._enter_flow(deadline, ticket, band_queue, timeout_status)
            return
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

    async def _enter_flow(
        self, deadline: float, ticket: FlowTicket, band_queue: int, timeout_status: int
    ) -> None:
        flows = self.flows
        assert flows is not None
        # A free slot means no waiter may take it (each freed slot goes to one that may).
        if (
            self.in_flight < self.limits.max_inflight
            and not self._queue
            and self._may_hold(ticket.tenant)
        ):
            self.in_flight += 1
            self._hold(ticket.tenant, 1)
            return
        if flows.in_band(ticket.priority) >= band_queue:
            self.rejected["band_full"] = self.rejected.get("band_full", 0) + 1
            raise Overloaded(
                f"too many requests: {flows.in_band(ticket.priority)} waiting at priority "
                f"{ticket.priority}",
                reason="band_full",
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = flows.push(ticket, future)
        started = self.clock()
        try:
            await asyncio.wait_for(asyncio.shield(future), max(deadline - started, 0.0))
        except asyncio.TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                return  # handed over as the wait ended: keep it
            flows.remove(waiter)
            if future.done() and not future.cancelled():  # evicted as the wait ended
                raise future.exception() or Overloaded("shed", reason="shed") from None
            future.cancel()
            self.rejected["timeout"] += 1
            raise Overloaded(
                f"too many requests: waited {deadline - started:.3g} s at priority "
                f"{ticket.priority}",
                status=timeout_status,
                reason="timeout",
            ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if future.done() and not future.cancelled() and future.exception() is None:
                self.leave(ticket)
            else:
                flows.remove(waiter)
                future.cancel()
            raise
        finally:
            ticket.waited_s = self.clock() - started

    def evict(self, waiter: Waiter, err: ApiError) -> None:
        """Refuse a request waiting in the banded queue with ``err`` (shedding)."""
        assert self.flows is not None
        self.flows.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(err)

    def tenant_cap(self) -> int:
        """Slots one tenant may hold; 0: no cap."""
        share = self.tenant_share
        return 0 if share >= 1 else max(1, math.ceil(share * self.limits.max_inflight))

    def _may_hold(self, tenant: str) -> bool:
        cap = self.tenant_cap()
        return not cap or self.holding.get(tenant, 0) < cap

    def _hold(self, tenant: str, n: int) -> None:
        held = self.holding.get(tenant, 0) + n
        if held > 0:
            self.holding[tenant] = held
        else:
            self.holding.pop(tenant, None)

    def leave(self, ticket: FlowTicket | None = None) -> None:
        """Give a slot back (``ticket``: the flow-control ticket it was taken with): to the
        next waiter that may take it, else to the pool."""
        flows = self.flows
        if ticket is not None and flows is not None:
            self._hold(ticket.tenant, -1)
        while flows:
            waiter = flows.pop(self._may_hold if self.tenant_cap() else None)
            if waiter is None:
                break  # every waiting tenant holds its share: the slot stays free for others
            if not waiter.future.done():
                self._hold(waiter.ticket.tenant, 1)
                waiter.future.set_result(None)
                return
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

    def metric_families(self) -> Iterator[StateFamily]:
        """Slots held, bodies being read, requests waiting, and refusals by reason."""
        yield ADMISSION_INFLIGHT.value(self.in_flight)
        yield ADMISSION_READING_BODY.value(self.reading_body)
        yield ADMISSION_WAITING.value(self.waiting)
        yield ADMISSION_REJECTED.labelled(
            ((reason,), n) for reason, n in sorted(self.rejected.items())
        )

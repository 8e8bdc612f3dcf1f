"""The banded admission queue: priority bands, flows per tenant, order within a flow.

Bands are served strictly by priority (highest first); within a band the
:class:`~router.flow.fairness.Fairness` policy picks a flow; within a flow the oldest
request (``fifo``) or the one with the earliest deadline (``deadline``) goes first. Each
band holds at most ``band_queue`` requests. Removal (a client that left, a wait that
ran out, a shed request) is immediate and O(log n).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from router.flow.fairness import Fairness
from router.flow.ticket import FlowTicket


@dataclass(slots=True, eq=False)
class Waiter:
    """A queued request: its ticket and the future its slot is handed over through."""

    ticket: FlowTicket
    future: asyncio.Future[None]
    seq: int
    removed: bool = False

    def order(self, by_deadline: bool) -> tuple[float, int]:
        deadline = self.ticket.deadline if by_deadline else None
        return (math.inf if deadline is None else deadline, self.seq)


@dataclass(slots=True)
class _Flow:
    heap: list[tuple[float, int, Waiter]] = field(default_factory=list)
    size: int = 0


@dataclass(slots=True)
class _Band:
    flows: dict[str, _Flow] = field(default_factory=dict)
    """Flows with requests waiting, in the order they became non-empty."""
    size: int = 0


class BandedQueue:
    """Waiting requests by band and flow."""

    def __init__(self, fairness: Fairness, ordering: str = "fifo") -> None:
        self.fairness = fairness
        self.by_deadline = ordering == "deadline"
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()
        self.size = 0
        self.by_model: dict[str | None, int] = {}
        """The ``model`` field of waiting requests -> how many (None: not given)."""

    def __len__(self) -> int:
        return self.size

    def in_band(self, priority: int) -> int:
        band = self._bands.get(priority)
        return band.size if band is not None else 0

    def in_flow(self, priority: int, tenant: str) -> int:
        """Requests of ``tenant`` waiting in band ``priority``."""
        band = self._bands.get(priority)
        flow = band.flows.get(tenant) if band is not None else None
        return flow.size if flow is not None else 0

    def waiting_above(self, priority: int) -> int:
        """Requests waiting in bands of a higher priority than ``priority``."""
        return sum(b.size for p, b in self._bands.items() if p > priority)

    def counts(self) -> dict[tuple[int, str], int]:
        """(band, tenant) -> requests waiting."""
        return {
            (p, tenant): flow.size
            for p, band in self._bands.items()
            for tenant, flow in band.flows.items()
        }

    def push(self, ticket: FlowTicket, future: asyncio.Future[None]) -> Waiter:
        waiter = Waiter(ticket, future, next(self._seq))
        band = self._bands.setdefault(ticket.priority, _Band())
        flow = band.flows.get(ticket.tenant)
        if flow is None:
            self.fairness.activated(ticket.tenant, band.flows.keys())
            flow = band.flows[ticket.tenant] = _Flow()
        heapq.heappush(flow.heap, (*waiter.order(self.by_deadline), waiter))
        flow.size += 1
        band.size += 1
        self.size += 1
        self.by_model[ticket.model] = self.by_model.get(ticket.model, 0) + 1
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """Take a waiter out (lazily: its heap entry is skipped when reached)."""
        if waiter.removed:
            return
        waiter.removed = True
        band = self._bands[waiter.ticket.priority]
        flow = band.flows[waiter.ticket.tenant]
        flow.size -= 1
        band.size -= 1
        self.size -= 1
        left = self.by_model[waiter.ticket.model] - 1
        if left:
            self.by_model[waiter.ticket.model] = left
        else:
            del self.by_model[waiter.ticket.model]
        if flow.size == 0:
            del band.flows[waiter.ticket.tenant]
        if band.size == 0:
            del self._bands[waiter.ticket.priority]

    def pop(self, eligible: Callable[[str], bool] | None = None) -> Waiter | None:
        """The next request to serve, taken out of the queue; None if none waits (of a
        tenant ``eligible`` says may be served)."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            tenants = [t for t in band.flows if eligible is None or eligible(t)]
            if tenants:
                return self._take(band.flows[self.fairness.choose(tenants)])
        return None

    def _take(self, flow: _Flow) -> Waiter:
        while True:
            _, _, waiter = heapq.heappop(flow.heap)
            if not waiter.removed:
                break
        self.remove(waiter)
        return waiter

    def sheddable(self) -> list[Waiter]:
        """Every waiting request of a negative band, lowest band first."""
        out: list[Waiter] = []
        for priority in sorted(p for p in self._bands if p < 0):
            for flow in self._bands[priority].flows.values():
                out.extend(w for _, _, w in flow.heap if not w.removed)
        return out

    def waiting(self) -> list[Waiter]:
        """Every waiting request (any order)."""
        return [
            w
            for band in self._bands.values()
            for flow in band.flows.values()
            for _, _, w in flow.heap
            if not w.removed
        ]

"""Load held by picks whose requests the caller forwards itself (gRPC Pick, ext_proc).

When kvroute forwards a request it opens load tickets and closes them as the answer
ends. A gateway that only asks where to send a request forwards it itself, so its pick
opens the same tickets (the engines a request occupies look the same to the next
decision whichever API routed it) and the gateway says when the request finished:
``Release`` for gRPC ``Pick``, the end of the response for ext_proc. A pick never
released expires after ``grpc.pick_ttl_s``, so a caller that forgets cannot inflate an
engine's load for ever.

Tickets are those the HTTP path opens for the same plan (:mod:`router.serving.charges`):
a split's prefill leg (one output token) and the decode leg, which prefills almost
nothing once the KV is pulled.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.fleet.load import LoadTracker, Ticket
from router.metric_catalogue import PICKS_ENDED
from router.plan import Plan
from router.policy.base import RouteRequest
from router.serving.charges import Charges
from router.types import EngineKey

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily


@dataclass(slots=True, eq=False)
class Lease:
    """One pick's tickets, until released or expired."""

    request_id: str
    plan: Plan
    charges: Charges
    """What the plan's legs charge (:mod:`router.serving.charges`)."""
    decode: Ticket
    prefill: Ticket | None
    opened_at: float
    expires_at: float | None
    """None: ended by its owner only (an ext_proc stream always ends)."""
    ended: bool = False

    @property
    def endpoint(self) -> str:
        """The engine serving the request (``host:port``), after any correction."""
        return self.decode.engine.endpoint


@dataclass(slots=True)
class PickCounters:
    """How picks ended, for metrics: released, expired, stream_end."""

    ended: dict[str, int] = field(default_factory=dict)


class DuplicatePick(KeyError):
    """An open pick already has this request id."""


class PickLedger:
    """Open picks by request id, with their expiry."""

    def __init__(
        self, loads: LoadTracker, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.loads = loads
        self.ttl_s = ttl_s
        self.clock = clock
        self.counters = PickCounters()
        self.on_move: Callable[[RouteRequest, EngineKey], None] | None = None
        """Told when a gateway served a pick elsewhere (the policy's session pin)."""
        self._open: dict[str, Lease] = {}
        self._unnamed = 0
        self._deadlines: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()

    @property
    def open_count(self) -> int:
        """Picks holding load now (registered and stream-owned)."""
        return len(self._open) + self._unnamed

    def hold(self, plan: Plan, *, register: bool = True) -> Lease:
        """Open ``plan``'s tickets. ``register``: reachable by request id (``release``)
        and expiring; else owned by the caller, who must ``end`` it.

        Raises :class:`DuplicatePick` when a registered pick has the same request id.
        """
        now = self.clock()
        self.sweep(now)
        route = plan.route
        if register and route.request_id in self._open:
            raise DuplicatePick(route.request_id)
        charges = Charges.of(plan)
        # The gateway may never say when the first token came.
        decode, prefill = charges.begin(self.loads, sees_first_token=False)
        lease = Lease(
            route.request_id,
            plan,
            charges,
            decode,
            prefill,
            now,
            now + self.ttl_s if register else None,
        )
        if register:
            self._open[route.request_id] = lease
            heapq.heappush(self._deadlines, (lease.expires_at or now, next(self._seq), lease))
        else:
            self._unnamed += 1
        return lease

    def get(self, request_id: str) -> Lease | None:
        self.sweep(self.clock())
        return self._open.get(request_id)

    def prefilled(self, lease: Lease) -> None:
        """The first token arrived: the prefill leg is over, the decode load stays."""
        if lease.prefill is not None:
            self.loads.end(lease.prefill)
        self.loads.prefilled(lease.decode)

    def move(self, lease: Lease, served: EngineKey) -> None:
        """The gateway sent the request to ``served`` instead (a fallback): its load
        moves there. Nothing was known to be cached on it."""
        if lease.ended or served == lease.decode.engine:
            return
        old = lease.decode
        self.loads.end(old)
        lease.decode = lease.charges.decode.on(served).begin(self.loads, sees_first_token=False)
        if old.prefilled:
            self.loads.prefilled(lease.decode)
        if self.on_move is not None:
            self.on_move(lease.plan.route, served)

    def end(self, lease: Lease, how: str) -> float:
        """Release the lease's tickets (idempotent); returns how long it was held."""
        if lease.ended:
            return 0.0
        lease.ended = True
        if lease.prefill is not None:
            self.loads.end(lease.prefill)
        self.loads.end(lease.decode)
        if lease.expires_at is None:
            self._unnamed -= 1
        elif self._open.get(lease.request_id) is lease:
            del self._open[lease.request_id]
        self.counters.ended[how] = self.counters.ended.get(how, 0) + 1
        return self.clock() - lease.opened_at

    def release(self, request_id: str) -> float | None:
        """End a registered pick; None when none is open under that id."""
        lease = self.get(request_id)
        if lease is None:
            return None
        return self.end(lease, "released")

    def sweep(self, now: float) -> int:
        """Expire registered picks past their deadline; returns how many."""
        expired = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, lease = heapq.heappop(heap)
            if not lease.ended:
                self.end(lease, "expired")
                expired += 1
        return expired

    def clear(self) -> None:
        """End every pick (the router stops)."""
        for lease in list(self._open.values()):
            self.end(lease, "expired")
        self._deadlines.clear()

    def next_deadline(self) -> float | None:
        """When the earliest registered pick expires."""
        while self._deadlines and self._deadlines[0][2].ended:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def metric_families(self) -> Iterator[StateFamily]:
        """Picks ended, by how (every way, ended so or not)."""
        ways = ("released", "expired", "stream_end")
        yield PICKS_ENDED.labelled(((how,), self.counters.ended.get(how, 0)) for how in ways)

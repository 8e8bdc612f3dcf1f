"""Prefill isolation: a request does not start its prefill beside one that outranks it.

Admission decides *when* a request may run; an engine step is still shared by every
prefill on that engine, so a request admitted first can lose half its speed to a
lower-ranked one sent to the same engine a moment later (two 2,000-token prefills in
one step take twice as long as one). With ``flow.prefill_isolation`` the routing core
(:meth:`router.core.RoutingCore.route`) leaves out the engines where a request that
outranks this one is still prefilling:

* a higher priority band outranks a lower one;
* within a band, a tenant with a backlog (requests waiting in the admission queue, or
  as many in flight as ``flow.tenant_share`` lets it hold) is outranked by one with
  fewer requests in flight and waiting in that band (a quiet tenant outranks a noisy
  one); tenants served as they ask are outranked by nobody.

That keeps a lower-ranked prefill from joining a higher-ranked one. The *reserve* keeps
the converse from happening: while requests that outrank a request have been routed
within ``flow.prefill_reserve_window_s``, prefills of its rank and below run one an
engine, on all but ``flow.prefill_reserve`` engines of the pool (1 by default) or all
but as many as outranking requests are prefilling and waiting for a slot, if more. So
the next higher-ranked request finds an engine with no prefill to share, and a burst of
them gets more engines as the prefills already running end. A pool of one engine is
never reserved.

A request with an engine left to go to goes there; one with none waits (in the same wait
as an engine at ``limits.max_inflight_per_engine``) until a prefill ends (its first
token, or its end), at most ``flow.prefill_isolation_wait_s``, then is routed as if
isolation were off. Front ends that never wait (gRPC ``Pick``, ext_proc) only steer:
with no engine left they route as usual. A prefill whose first token the router cannot
see (a non-streamed answer, a gateway's pick) stops outranking after an estimate of its
prefill time (uncached tokens x ``disaggregation.prefill_s_per_token``, doubled).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.core import Saturated
from router.metric_catalogue import FLOW_PREFILL_ISOLATION, FLOW_PREFILL_ISOLATION_WAIT_SECONDS

if TYPE_CHECKING:
    from router.fleet.load import LoadTracker, Ticket
    from router.flow.ticket import FlowTicket
    from router.metric_catalogue import StateFamily
    from router.policy.base import RouteRequest
    from router.types import EngineKey

ESTIMATE_MARGIN = 2.0
"""An unseen first token is expected within this many times the estimated prefill."""
ESTIMATE_FLOOR_S = 0.05
MAX_CLASSES = 1024
"""Request classes (priority, tenant) remembered before those outside the window go."""


class Yielding(Saturated):
    """Every candidate runs an outranking prefill: wait for one to end, until ``until``."""

    def __init__(self, message: str, until: float) -> None:
        super().__init__(message)
        self.until = until


@dataclass(slots=True)
class IsolationCounters:
    avoided: int = 0
    """Decisions that left out an engine because an outranking prefill ran there."""
    waited: int = 0
    """Requests that waited because every candidate ran one."""
    reserved: int = 0
    """Decisions kept off engines by the reserve (``flow.prefill_reserve``)."""
    overridden: int = 0
    """Requests routed beside an outranking prefill: the wait ran out, or could not wait."""
    wait_s: float = 0.0
    """Seconds requests spent waiting so."""


@dataclass(slots=True)
class PrefillIsolation:
    """The rules above, over the load tracker's prefilling tickets."""

    loads: LoadTracker
    holding: Mapping[str, int]
    """Tenant -> in-flight slots held (:attr:`router.admission.Admission.holding`)."""
    max_wait_s: Callable[[], float]
    s_per_token: Callable[[], float]
    reserve: Callable[[], int] = lambda: 0
    """Engines kept free of this request's prefills while requests that outrank it are
    about (``flow.prefill_reserve``)."""
    window_s: Callable[[], float] = lambda: 10.0
    """How long a request class counts as about after its last request."""
    queued: Callable[[], Mapping[tuple[int, str], int]] = dict
    """(band, tenant) -> requests waiting in the admission queue."""
    in_flow: Callable[[int, str], int] = lambda priority, tenant: 0
    """Requests of (band, tenant) waiting in the admission queue."""
    tenant_cap: Callable[[], int] = lambda: 0
    """Slots one tenant may hold (``flow.tenant_share``; 0: no cap): a tenant at it counts
    as one with a backlog."""
    clock: Callable[[], float] = time.monotonic
    counters: IsolationCounters = field(default_factory=IsolationCounters)
    seen: dict[tuple[int, str], float] = field(default_factory=dict)
    """(priority, tenant) -> when a request of it was last routed."""

    def outranks(self, a: FlowTicket, b: FlowTicket) -> bool:
        """Whether ``a``'s prefill is kept clear of ``b``'s."""
        return self._outranks(a.priority, a.tenant, b)

    def _outranks(self, priority: int, tenant: str, b: FlowTicket) -> bool:
        if priority != b.priority:
            return priority > b.priority
        if tenant == b.tenant:
            return False
        holding = self.holding
        theirs = holding.get(b.tenant, 0)
        theirs_waiting = self.in_flow(priority, b.tenant)
        cap = self.tenant_cap()
        if not theirs_waiting and not (cap and theirs >= cap):
            return False  # a tenant served as it asks is outranked by nobody
        mine = holding.get(tenant, 0) + self.in_flow(priority, tenant)
        return mine < theirs + theirs_waiting

    def _expires(self, ticket: Ticket) -> float:
        """When the ticket's prefill is over at the latest (``inf``: at a first token the
        router will see)."""
        if not ticket.estimated:
            return math.inf
        estimate = ticket.prefill_tokens * self.s_per_token() * ESTIMATE_MARGIN
        return ticket.started + max(estimate, ESTIMATE_FLOOR_S)

    def _engine(self, engine: EngineKey, flow: FlowTicket, now: float) -> tuple[float, float, int]:
        """(when the outranking prefills there are over at the latest, when the first of
        the others is, how many outrank): ``-inf`` where there are none."""
        blocked = background = -math.inf
        outranking = 0
        over: list[Ticket] = []
        for ticket in self.loads.prefilling.get(engine, {}).values():
            other = ticket.flow
            if other is None or other is flow:
                continue
            expires = self._expires(ticket)
            if expires <= now:
                over.append(ticket)  # its estimate ran out: it prefills no more
                continue
            if self.outranks(other, flow):
                blocked = max(blocked, expires)
                outranking += 1
            else:
                background = expires if background == -math.inf else min(background, expires)
        for ticket in over:
            self.loads.unprefill(ticket)
        return blocked, background, outranking

    def _waiting(self, flow: FlowTicket) -> int:
        """Requests waiting in the admission queue that outrank ``flow``."""
        return sum(
            n
            for (priority, tenant), n in self.queued().items()
            if priority > flow.priority
            or (
                priority == flow.priority
                and tenant != flow.tenant
                and self._outranks(priority, tenant, flow)
            )
        )

    def _outranked(self, flow: FlowTicket, now: float) -> bool:
        """Whether requests that outrank ``flow`` were routed within the window (and
        note ``flow``'s own class as seen)."""
        seen = self.seen
        horizon = now - self.window_s()
        if len(seen) > MAX_CLASSES:
            for key in [k for k, t in seen.items() if t < horizon]:
                del seen[key]
            if len(seen) > MAX_CLASSES:  # a flood of tenants: keep the latest half
                kept = sorted(seen.items(), key=lambda item: item[1])[-MAX_CLASSES // 2 :]
                self.seen = seen = dict(kept)
        seen[(flow.priority, flow.tenant)] = now
        for (priority, tenant), t in seen.items():
            if t < horizon or priority < flow.priority:
                continue
            if priority > flow.priority:
                return True
            if tenant != flow.tenant and self._outranks(priority, tenant, flow):
                return True
        return False

    def clear(self, request: RouteRequest, candidates: Sequence[EngineKey]) -> Sequence[EngineKey]:
        """The candidates ``request`` may start on; raises :class:`Yielding` when it
        should wait instead."""
        flow = request.flow
        if flow is None:
            return candidates
        now = self.clock()
        reserve = self.reserve()
        reserving = reserve > 0 and len(candidates) > 1 and self._outranked(flow, now)
        if not self.loads.prefilling and not reserving:
            return self._go(flow, candidates, now)
        state = {c: self._engine(c, flow, now) for c in candidates}
        clear = [c for c in candidates if state[c][0] == -math.inf]
        avoided = 0 < len(clear) < len(candidates)
        reserved = False
        if clear and reserving:
            # Prefills of this rank and below run one an engine, on all but `reserve`
            # engines, or all but as many as outranking requests prefill or wait. Waiting
            # ones count only as many as outranking requests run (their ends free slots
            # for them): were the slots held by requests like this one, holding those
            # back would keep the waiting ones from a slot (a priority inversion).
            demand = sum(s[2] for s in state.values())
            if demand:
                demand += min(self._waiting(flow), demand)
            room = len(candidates) - max(reserve, demand)
            busy = sum(1 for c in candidates if state[c][1] != -math.inf)
            free = [c for c in clear if state[c][1] == -math.inf] if busy < room else []
            reserved = len(free) < len(clear)
            clear = free
        if clear:  # counted once a request is routed, not at every try
            self.counters.avoided += avoided
            self.counters.reserved += reserved
            return self._go(flow, clear, now)
        if request.wait_until is None:
            self.counters.overridden += 1
            return candidates
        if flow.yield_until is None:
            flow.yield_until = now + self.max_wait_s()
            flow.yield_started = now
            self.counters.waited += 1
        if now >= flow.yield_until or now >= request.wait_until:
            self.stop_waiting(flow, now)
            self.counters.overridden += 1
            return candidates
        ends = [e for s in state.values() for e in s[:2] if e != -math.inf]
        raise Yielding(
            f"all {len(candidates)} candidate engine(s) are prefilling requests that "
            "outrank this one, or are kept for them",
            min(flow.yield_until, request.wait_until, *ends),  # an end may be inf
        )

    def _go(self, flow: FlowTicket, clear: Sequence[EngineKey], now: float) -> Sequence[EngineKey]:
        if flow.yield_started is not None:  # it waited, and an engine came clear
            self.stop_waiting(flow, now)
        return clear

    def stop_waiting(self, flow: FlowTicket, now: float) -> None:
        """``flow`` waits no more (routed beside the prefills it yielded to, if any)."""
        if flow.yield_started is not None:
            flow.yielded_s += now - flow.yield_started
            self.counters.wait_s += now - flow.yield_started
            flow.yield_started = None
        flow.yield_until = now

    def metric_families(self) -> Iterator[StateFamily]:
        """Decisions and requests by outcome, and the seconds requests waited."""
        c = self.counters
        outcomes = {
            "avoided": c.avoided,
            "reserved": c.reserved,
            "waited": c.waited,
            "overridden": c.overridden,
        }
        yield FLOW_PREFILL_ISOLATION.labelled(((o,), n) for o, n in sorted(outcomes.items()))
        yield FLOW_PREFILL_ISOLATION_WAIT_SECONDS.value(c.wait_s)

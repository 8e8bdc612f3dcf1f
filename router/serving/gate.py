"""The gate: one admission protocol for every front end.

A front end maps its transport to an :class:`Entry` (the request's headers, its body or
how to read it, a caller's deadline, flow metadata) and asks the :class:`Gate`:

* :meth:`Gate.refuse_closed`: the router is draining (:class:`~router.serving.errors.Draining`);
* :meth:`Gate.refuse_full`: ``limits.max_inflight`` requests are on the engines
  (:class:`~router.serving.errors.TooManyInFlight`), for the front ends that do not wait
  (gRPC ``Pick``, ext_proc);
* :meth:`Gate.enter`: wait for an in-flight slot (HTTP, gRPC ``Generate``), filling a
  :class:`Permit` that :meth:`Gate.leave` gives back at the end;
* :meth:`Gate.check`: the no-wait check of a request its caller forwards itself
  (``Pick``, ext_proc), and :meth:`Gate.finish` once its answer is known.

Refusals are :class:`~router.serving.errors.ApiError` values (statuses and ``Retry-After``),
which each front end writes in its own form. Two implementations, chosen once at wiring
(:func:`make_gate`): :class:`AdmissionGate`, the plain FIFO
:class:`~router.admission.Admission`, and :class:`FlowGate`, flow control
(:class:`~router.flow.control.FlowControl`: bands, fairness, rate limits, shedding).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.serving.errors import Draining, TooManyInFlight

if TYPE_CHECKING:
    from router.admission import Admission
    from router.fleet.load import LoadTracker
    from router.flow.control import FlowControl
    from router.flow.ticket import FlowTicket
    from router.live_config import LiveConfig
    from router.serving.services import RunState


@dataclass(slots=True, eq=False)
class Entry:
    """A request's facts at the gate, from whichever transport it came by."""

    headers: Mapping[str, str]
    body: bytes = b""
    """Its body, when the transport has it already."""
    read: Callable[[], Awaitable[bytes]] | None = None
    """How to read its body (HTTP): after the slot without flow control (a waiting
    request holds no body), before it with (its tenant and model may be there)."""
    metadata: Mapping[str, object] | None = None
    """Flow-control facts sent beside the request (ext_proc's dynamic metadata)."""
    deadline: float | None = None
    """The caller's own deadline (``time.monotonic``; gRPC)."""
    model: str | None = None
    """The model, when the transport names it beside the body (gRPC ``Pick``)."""
    prompt_chars: int = 0
    """A prompt sent beside the body (``Pick``'s text), in characters."""


@dataclass(slots=True, eq=False)
class Permit:
    """What the gate gave a request: its body, its flow ticket, its in-flight slot."""

    body: bytes = b""
    ticket: FlowTicket | None = None
    holds_slot: bool = False


class Gate(Protocol):
    """Admission, as every front end sees it."""

    def refuse_closed(self) -> None:
        """Raise :class:`~router.serving.errors.Draining` while the router drains."""

    def refuse_full(self) -> None:
        """Raise :class:`~router.serving.errors.TooManyInFlight` at ``limits.max_inflight``."""

    def deadline(self) -> float:
        """When a request arriving now stops waiting (``limits.admission_timeout_s``)."""

    async def enter(self, entry: Entry, deadline: float, permit: Permit) -> None:
        """Wait for an in-flight slot until ``deadline``, filling ``permit`` as it goes
        (give it back with :meth:`leave` whether this returns or raises)."""

    def leave(self, permit: Permit, usage: Mapping[str, Any] | None) -> None:
        """The request ended (``usage``: its answer's, if seen)."""

    async def check(self, entry: Entry) -> FlowTicket | None:
        """The no-wait check of a request its caller forwards itself; its ticket."""

    def finish(self, ticket: FlowTicket | None, usage: Mapping[str, Any] | None) -> None:
        """A checked request ended (``usage``: its answer's, if seen)."""


class AdmissionGate:
    """The plain FIFO admission queue (``flow.enabled`` off)."""

    def __init__(
        self, admission: Admission, state: RunState, loads: LoadTracker, live: LiveConfig
    ) -> None:
        self.admission = admission
        self.state = state
        self.loads = loads
        self.live = live

    def refuse_closed(self) -> None:
        if self.state.draining:
            raise Draining()

    def refuse_full(self) -> None:
        if self.loads.in_flight >= self.live.current.limits.max_inflight:
            raise TooManyInFlight()

    def deadline(self) -> float:
        return self.admission.deadline(time.monotonic())

    async def enter(self, entry: Entry, deadline: float, permit: Permit) -> None:
        admission = self.admission
        await admission.enter(deadline)
        permit.holds_slot = True
        if entry.read is None:
            permit.body = entry.body
            return
        admission.reading_body += 1
        try:
            permit.body = await entry.read()
        finally:
            admission.reading_body -= 1

    def leave(self, permit: Permit, usage: Mapping[str, Any] | None) -> None:
        if permit.holds_slot:
            permit.holds_slot = False
            self.admission.leave(permit.ticket)

    async def check(self, entry: Entry) -> FlowTicket | None:
        return None

    def finish(self, ticket: FlowTicket | None, usage: Mapping[str, Any] | None) -> None:
        pass


class FlowGate(AdmissionGate):
    """Flow control (``flow.enabled``): the banded queue, rate limits and shedding."""

    def __init__(
        self,
        flow: FlowControl,
        admission: Admission,
        state: RunState,
        loads: LoadTracker,
        live: LiveConfig,
    ) -> None:
        super().__init__(admission, state, loads, live)
        self.flow = flow

    def ticket(self, entry: Entry, body: bytes) -> FlowTicket:
        ticket = self.flow.ticket(
            entry.headers, body, metadata=entry.metadata, deadline=entry.deadline
        )
        if entry.model is not None:
            ticket.model = ticket.model or entry.model or None
        if entry.prompt_chars:
            ticket.estimate += entry.prompt_chars // 4
            ticket.prompt_estimate += entry.prompt_chars // 4
        return ticket

    async def enter(self, entry: Entry, deadline: float, permit: Permit) -> None:
        body = entry.body if entry.read is None else await entry.read()
        permit.body = body
        permit.ticket = self.ticket(entry, body)
        await self.flow.admit(permit.ticket, deadline)
        permit.holds_slot = True

    def leave(self, permit: Permit, usage: Mapping[str, Any] | None) -> None:
        super().leave(permit, usage)
        self.finish(permit.ticket, usage)

    async def check(self, entry: Entry) -> FlowTicket | None:
        ticket = self.ticket(entry, entry.body)
        await self.flow.check(ticket)
        return ticket

    def finish(self, ticket: FlowTicket | None, usage: Mapping[str, Any] | None) -> None:
        if ticket is not None:
            self.flow.finish(ticket, usage)


def make_gate(
    admission: Admission,
    flow: FlowControl | None,
    state: RunState,
    loads: LoadTracker,
    live: LiveConfig,
) -> Gate:
    """The gate of this router: flow control's when it is on, else the FIFO queue's."""
    if flow is None:
        return AdmissionGate(admission, state, loads, live)
    return FlowGate(flow, admission, state, loads, live)

"""The sidecar header dialect: a sidecar beside the decode engine runs the legs.

llm-d's P/D sidecar protocol (and ``kvroute sidecar``, :mod:`router.frontends.sidecar`): the
request goes to the decode pod with :data:`HEADER` naming the prefill engine
(``host:port``); the sidecar runs the NIXL prefill leg there, then the decode leg on
its engine, and falls back to decoding alone when the prefill fails. The gateway front
ends (gRPC ``Pick``, ext_proc) send this header for every dialect
(:meth:`~router.handoff.base.Handoff.directions`).

As a router dialect (``disaggregation.handoff: sidecar``, decode engines registered by
their sidecars' URLs) the router sends the client's request once, to the decode pod,
with the header; the prefill engine's load is held until the answer's first byte, as
for a gateway's pick. A failure is the decode pod's (another decode engine is tried);
there is no prefill retry, the sidecar's fallback covers it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.handoff.base import PREFILLER, Handoff, Legs
from router.serving.charges import Charges

if TYPE_CHECKING:
    from router.fleet.load import LoadTracker, Ticket
    from router.plan import Plan
    from router.serving.context import RequestContext
    from router.serving.downstream import Downstream

HEADER = PREFILLER


class SidecarHandoff(Handoff):
    """The client's request to the decode pod's sidecar, naming the prefill engine."""

    name = "sidecar"

    async def serve(self, ctx: RequestContext, plan: Plan, legs: Legs) -> None:
        prefill = plan.prefill
        charges = Charges.of(plan)
        assert prefill is not None and charges.prefill is not None
        sink = _UntilFirstByte(ctx.sink, legs.loads, charges.prefill.begin(legs.loads))
        try:
            await legs.decode_leg(
                ctx,
                plan.decode,
                ctx.body,
                sink=sink,
                cached_tokens=charges.decode.cached_tokens,
                headers={"x-kvroute-mode": "split", "x-kvroute-prefill": prefill.engine.label},
                upstream_headers={HEADER: prefill.engine.endpoint},
            )
        finally:
            sink.release()


class _UntilFirstByte:
    """A :class:`Downstream` that ends the prefill engine's load ticket once the answer
    begins (the sidecar's prefill leg is over by then)."""

    __slots__ = ("loads", "sink", "ticket")

    def __init__(self, sink: Downstream, loads: LoadTracker, ticket: Ticket) -> None:
        self.sink = sink
        self.loads = loads
        self.ticket: Ticket | None = ticket

    @property
    def headers(self) -> Any:
        return self.sink.headers

    def release(self) -> None:
        if self.ticket is not None:
            self.loads.end(self.ticket)
            self.ticket = None

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.release()
        await self.sink.whole(status, headers, body)

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        self.release()
        await self.sink.begin(status, headers)

    async def write(self, chunk: bytes) -> None:
        await self.sink.write(chunk)

    async def end(self) -> None:
        await self.sink.end()
